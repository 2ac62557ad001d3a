"""Start a real Runtime for tests, in this process or as a separate one (for crash tests)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpcore

from quayutec.config import ServerConfig
from quayutec.egress import Resolver
from services.runtime.config import RuntimeConfig
from services.runtime.model import Clock, RetryPolicy
from services.runtime.server import create_server
from services.stack import free_port
from tests.harness.channels import TEST_MTLS, mtls_env
from tests.harness.egress import TableResolver

REPO = Path(__file__).resolve().parent.parent.parent


def runtime_config(claims_addr: str, room_addr: str, standin_url: str | None = None, **overrides: Any) -> RuntimeConfig:
    config = RuntimeConfig(
        server=ServerConfig(listen="127.0.0.1:0", grace_seconds=1.0, mtls=TEST_MTLS),
        claims_addr=claims_addr,
        room_addr=room_addr,
        model_timeout_seconds=5.0,
    )
    if standin_url:
        config = replace(config, anthropic_base_url=standin_url, openai_base_url=standin_url)
    return replace(config, **overrides)


@asynccontextmanager
async def running_runtime(
    claims_addr: str,
    room_addr: str,
    *,
    standin_url: str | None = None,
    clock: Clock | None = None,
    policy: RetryPolicy | None = None,
    resolver: Resolver | None = None,
    dialer: httpcore.AsyncNetworkBackend | None = None,
    **overrides: Any,
) -> AsyncIterator[str]:
    """Yields "127.0.0.1:PORT" of a Runtime started in this process. ``resolver`` and ``dialer``
    replace the system's for owner-supplied addresses (tests.harness.egress); the resolver defaults to
    the test table, as the Room's does, so no DNS query leaves the machine."""
    server = await create_server(
        runtime_config(claims_addr, room_addr, standin_url, **overrides),
        clock=clock,
        policy=policy,
        resolver=resolver or TableResolver(),
        dialer=dialer,
    )
    port = await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop()


class ServiceProcess:
    """``python -m services.<name>`` as a child process presenting its own test certificate, to be killed
    with SIGKILL. ``env`` adds to this process's environment. Its log (stderr) is read all along by a
    thread of ours, so the child never blocks on a full pipe, and kept in ``stderr_lines``."""

    def __init__(self, name: str, env: Mapping[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"],
            cwd=REPO,
            env={**os.environ, **env, **mtls_env(name), "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr_lines: list[str] = []
        self._log_changed = threading.Condition()
        self._log_ended = False
        threading.Thread(target=self._read_log, name=f"{name} log", daemon=True).start()

    def _read_log(self) -> None:
        assert self.proc.stderr is not None
        try:
            for line in self.proc.stderr:
                with self._log_changed:
                    self.stderr_lines.append(line)
                    self._log_changed.notify_all()
        except (OSError, ValueError):
            pass
        with self._log_changed:
            self._log_ended = True
            self._log_changed.notify_all()

    def lines_with(self, needle: str) -> list[str]:
        with self._log_changed:
            return [line for line in self.stderr_lines if needle in line]

    async def wait_ready(self, limit: float = 30.0) -> None:
        await self.wait_for_line("listening on port", limit)

    async def wait_for_line(self, needle: str, limit: float = 30.0, *, count: int = 1) -> str:
        """Wait until the child has logged ``count`` lines containing ``needle`` (or fail after ``limit``
        s, or when it exits first); the last of them."""

        def scan() -> str:
            with self._log_changed:
                while True:
                    found = [line for line in self.stderr_lines if needle in line]
                    if len(found) >= count:
                        return found[count - 1]
                    if self._log_ended:
                        tail = "".join(self.stderr_lines[-30:])
                        raise AssertionError(f"{self.name} exited before {needle!r}:\n{tail}")
                    self._log_changed.wait(0.5)

        return await asyncio.wait_for(asyncio.to_thread(scan), limit)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


class RuntimeProcess(ServiceProcess):
    """``python -m services.runtime`` against the given Claims, Room and model stand-in, on ``port``
    (a free one by default; give the port of a killed one to restart it at the same address)."""

    def __init__(
        self,
        claims_addr: str,
        room_addr: str,
        standin_url: str,
        failpoints: str = "",
        env: Mapping[str, str] | None = None,
        *,
        port: int | None = None,
    ) -> None:
        self.port = port or free_port()
        self.addr = f"127.0.0.1:{self.port}"
        super().__init__(
            "runtime",
            {
                "QUAYUTEC_RUNTIME_LISTEN": self.addr,
                "QUAYUTEC_CLAIMS_ADDR": claims_addr,
                "QUAYUTEC_ROOM_ADDR": room_addr,
                "QUAYUTEC_RUNTIME_ANTHROPIC_BASE_URL": standin_url,
                "QUAYUTEC_RUNTIME_OPENAI_BASE_URL": standin_url,
                "QUAYUTEC_RUNTIME_FAILPOINTS": failpoints,
                **(env or {}),
            },
        )

    def release_failpoints(self) -> None:
        """Runs paused at a failpoint go on (the Runtime's SIGUSR1)."""
        self.proc.send_signal(signal.SIGUSR1)
