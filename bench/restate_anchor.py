"""Restate as an anchor of ``bench/runs.py``: the server binary from npm, a loopback-only network
namespace to run it in, and an SDK endpoint process serving a handler of the run's steps.

The Restate server tries to reach the internet when it starts (a release check no setting turns
off), so it only ever runs inside a network namespace whose one interface is ``lo``:
``bench/runs.py --baseline restate`` re-runs itself under ``unshare --net`` (the whole bench: ours,
the anchors, PostgreSQL, the stand-in, the Restate server, the endpoint and the load), brings ``lo``
up there, and ``restate_server`` refuses to start the binary unless ``lo`` is the only interface.

The server (``@restatedev/restate-server``, pinned to ``RESTATE_VERSION``) is installed on first use,
outside the namespace, into the bench cache (``~/.cache/quayutec-bench`` or ``QY_BENCH_CACHE``)::

    npm install --prefix ~/.cache/quayutec-bench/restate-server-1.7.12 --no-audit --no-fund \\
        --ignore-scripts @restatedev/restate-server@1.7.12

The endpoint (``python bench/restate_anchor.py --endpoint``, the ``restate-sdk`` and ``hypercorn``
of the ``bench`` extra on uvloop, as our services run) serves one Restate service, ``QuayutecRun``,
whose handler runs ``bench.run_steps.agent_run`` with every step a durable ``ctx.run``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

import httpx

from bench.common import ROOT, BenchError, bench_cache_dir
from bench.run_steps import RunSteps, agent_run
from services.stack import free_port

RESTATE_VERSION = "1.7.12"
SERVICE = "QuayutecRun"
# The server's default ports; inside a fresh network namespace nothing else holds them.
INGRESS_PORT = 8080
ADMIN_PORT = 9070
STEP_ATTEMPTS = 3
ENDPOINT_POOL_SIZE = 10
NAMESPACE_FLAG = "--in-loopback-netns"
START_SECONDS = 120.0


# -- the server binary ----------------------------------------------------------------------------------


def server_dir() -> Path:
    return bench_cache_dir() / f"restate-server-{RESTATE_VERSION}"


def server_binary() -> Path:
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower(), "")
    package = f"restate-server-{sys.platform}-{arch}"
    return server_dir() / "node_modules" / "@restatedev" / package / "bin" / "restate-server"


def install_command() -> list[str]:
    return [
        "npm",
        "install",
        "--prefix",
        str(server_dir()),
        "--no-audit",
        "--no-fund",
        "--ignore-scripts",
        f"@restatedev/restate-server@{RESTATE_VERSION}",
    ]


def ensure_server() -> Path:
    """The server binary, installed from npm into the bench cache when missing (run outside the namespace)."""
    binary = server_binary()
    if binary.exists():
        return binary
    if shutil.which("npm") is None:
        raise BenchError("installing the Restate server needs npm: " + " ".join(install_command()))
    server_dir().mkdir(parents=True, exist_ok=True)
    print("installing the Restate server: " + " ".join(install_command()), file=sys.stderr, flush=True)
    subprocess.run(install_command(), check=True)
    if not binary.exists():
        raise BenchError(f"npm installed @restatedev/restate-server but {binary} is missing (platform not shipped?)")
    return binary


# -- the loopback-only network namespace ------------------------------------------------------------------


def rerun_in_loopback_namespace(argv: Sequence[str]) -> int:
    """Run ``python argv... --in-loopback-netns`` in a new network namespace; its exit code."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise BenchError("--baseline restate needs unshare and ip (util-linux, iproute2) for its network namespace")
    as_root = [] if os.geteuid() == 0 else ["--map-root-user"]
    return subprocess.call(["unshare", "--net", *as_root, "--", sys.executable, *argv, NAMESPACE_FLAG])


def enter_loopback_namespace() -> None:
    """In the new namespace: bring ``lo`` up and check it is the only interface."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    assert_loopback_only()


def assert_loopback_only() -> None:
    """BenchError unless this process's network namespace has ``lo``, up, and no other interface."""
    names = [name for _, name in socket.if_nameindex()]
    if names != ["lo"]:
        raise BenchError(f"refusing to start the Restate server: interfaces {names}, not only lo")
    with socket.socket() as listener, socket.socket() as probe:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        try:
            probe.connect(listener.getsockname())
        except OSError as exc:
            raise BenchError(f"lo is not up in this network namespace: {exc}") from exc


# -- the server and the endpoint as processes -------------------------------------------------------------


@dataclass(frozen=True)
class RestateServer:
    ingress_url: str
    admin_url: str

    def register(self, endpoint_url: str) -> None:
        """Register the endpoint's deployment (discovery); BenchError when the server refuses it."""
        answer = httpx.post(f"{self.admin_url}/deployments", json={"uri": endpoint_url}, timeout=30)
        if answer.status_code >= 300:
            raise BenchError(f"Restate refused the deployment {endpoint_url}: {answer.status_code} {answer.text}")


@contextmanager
def restate_server(base_dir: Path, log_path: Path) -> Iterator[RestateServer]:
    """The Restate server on its default ports of this namespace's loopback, its data in ``base_dir``."""
    assert_loopback_only()
    binary = server_binary()
    if not binary.exists():
        raise BenchError(f"no Restate server at {binary}: run {' '.join(install_command())}")
    for port in (INGRESS_PORT, ADMIN_PORT):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise BenchError(f"port {port} is taken in this namespace; the Restate server needs it")
    env = {**os.environ, "RESTATE_DISABLE_TELEMETRY": "true", "RESTATE_LOG_FILTER": "warn"}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [binary, "--no-logo", "--listen-mode", "tcp", "--bind-ip", "127.0.0.1", "--base-dir", str(base_dir)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = RestateServer(f"http://127.0.0.1:{INGRESS_PORT}", f"http://127.0.0.1:{ADMIN_PORT}")
    try:
        _wait_until(lambda: _answers(f"{server.admin_url}/health"), proc, "the Restate server", log_path)
        yield server
    finally:
        _stop(proc)


@contextmanager
def restate_endpoint(database_url: str, standin_url: str, encryption_key: str, log_path: Path) -> Iterator[str]:
    """The SDK endpoint (this module with ``--endpoint``) as a process; yields its URL."""
    port = free_port()
    env = {
        **os.environ,
        "QY_RESTATE_DATABASE_URL": database_url,
        "QY_RESTATE_STANDIN_URL": standin_url,
        "QUAYUTEC_ENCRYPTION_KEY": encryption_key,
    }
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--endpoint", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_until(lambda: _listening(port), proc, "the Restate SDK endpoint", log_path)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_until(ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, log_path: Path) -> None:
    deadline = time.monotonic() + START_SECONDS
    while not ready():
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise BenchError(f"{what} exited with {proc.returncode}; its log ends:\n{tail}")
        if time.monotonic() > deadline:
            raise BenchError(f"{what} was not ready in {START_SECONDS:.0f} s (log: {log_path})")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the endpoint ---------------------------------------------------------------------------------------


def make_service(steps: RunSteps) -> Any:
    """A Restate service whose handler runs the run's steps, each a durable ``ctx.run``."""
    import restate

    service = restate.Service(SERVICE)
    options: Any = restate.RunOptions(max_attempts=STEP_ATTEMPTS)

    @service.handler()
    async def run(ctx: Any, request: dict[str, str]) -> str:  # (annotations must resolve in this module)
        async def do(name: str, step: Callable[..., Awaitable[Any]], *args: Any) -> Any:
            return await ctx.run_typed(name, step, options, *args)

        wake = (request["agent_id"], request["wake_id"], request["room_id"], request["source_id"])
        return await agent_run(do, steps, *wake)

    return service


async def serve_endpoint(port: int) -> None:
    import hypercorn.asyncio
    import hypercorn.config
    import restate

    from quayutec.crypto import Fernet, MultiFernet
    from quayutec.db import create_pool
    from quayutec.sql import Queries

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    pool = await create_pool(os.environ["QY_RESTATE_DATABASE_URL"], min_size=2, max_size=ENDPOINT_POOL_SIZE)
    cipher = MultiFernet([Fernet(os.environ["QUAYUTEC_ENCRYPTION_KEY"].encode())])
    queries = Queries(ROOT / "services" / "room" / "sql" / "queries.sql")
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            steps = RunSteps(pool, http, os.environ["QY_RESTATE_STANDIN_URL"], cipher, queries)
            config = hypercorn.config.Config()
            config.bind = [f"127.0.0.1:{port}"]
            # As Restate's serving guide sets them: one long-lived HTTP/2 connection, many streams.
            config.h2_max_concurrent_streams = 2**31 - 1
            config.keep_alive_max_requests = 2**31 - 1
            config.keep_alive_timeout = 2**31 - 1
            config.loglevel = "WARNING"
            app = restate.app(services=[make_service(steps)])
            await hypercorn.asyncio.serve(app, config, shutdown_trigger=stop.wait)
    finally:
        await pool.close()


def main() -> int:
    parser = argparse.ArgumentParser(description="The Restate SDK endpoint of bench/runs.py (started by it).")
    parser.add_argument("--endpoint", action="store_true", required=True)
    parser.add_argument("--port", type=int, required=True)
    opts = parser.parse_args()
    import uvloop

    uvloop.run(serve_endpoint(opts.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
