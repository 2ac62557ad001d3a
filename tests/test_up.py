"""`quayutec up` goes where it is pointed and stops what it started, the embedded PostgreSQL too."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from quayutec.config import SERVICES
from quayutec.datadir import holder
from quayutec.db import embedded_pgdata, embedded_pid
from services.stack import LocalStack, free_port, port_is_free

REPO = Path(__file__).resolve().parent.parent


def test_ports_follow_the_listen_and_addr_settings() -> None:
    gateway, room = free_port(), free_port()
    env = {"QUAYUTEC_GATEWAY_LISTEN": f"127.0.0.1:{gateway}", "QUAYUTEC_ROOM_ADDR": f"localhost:{room}"}
    stack = LocalStack.with_ports(ephemeral=False, env=env) if _defaults_free() else None
    if stack is None:
        pytest.fail("the default ports 50053-50055 are taken on this machine; free them to run this test")
    assert stack.ports["gateway"] == gateway and stack.listen("gateway") == f"127.0.0.1:{gateway}"
    assert stack.ports["room"] == room and stack.addr("room") == f"localhost:{room}"
    assert stack.env()["QUAYUTEC_ROOM_ADDR"] == f"localhost:{room}"
    assert stack.ports["claims"] == 50053 and stack.ports["runtime"] == 50054
    assert stack.env()["QUAYUTEC_CONSOLE_GATEWAY_CONSOLE_ADDR"] == "127.0.0.1:50055"


def _defaults_free() -> bool:
    return all(port_is_free(p) for p in (50053, 50054, 50055))


def test_a_malformed_address_is_named() -> None:
    with pytest.raises(SystemExit, match="QUAYUTEC_RUNTIME_LISTEN must be host:port"):
        LocalStack.with_ports(ephemeral=False, env={"QUAYUTEC_RUNTIME_LISTEN": "nowhere"})


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """A short folder (the server's Unix socket lives in it) that PostgreSQL's own user can reach
    (pgserver runs it as that user when we are root)."""
    root = Path(tempfile.mkdtemp(prefix="qy-up-", dir="/tmp"))
    root.chmod(0o755)
    (root / "d").mkdir(mode=0o755)
    yield root / "d"
    shutil.rmtree(root, ignore_errors=True)


def _base_port() -> int:
    """A port with the next five free too (four services, the console and the Gateway's console port;
    bounded tries)."""
    for _ in range(50):
        base = free_port()
        if base + 5 < 65536 and all(port_is_free(base + i) for i in range(6)):
            return base
    raise AssertionError("found no six consecutive free ports")


def test_up_on_a_base_port_then_ctrl_c_stops_everything_it_started(data_dir: Path) -> None:
    base = _base_port()
    env = _env(QUAYUTEC_DATA_DIR=str(data_dir))
    with running_up(env, base) as up:
        for i, spec in enumerate(sorted(SERVICES, key=lambda s: s.port)):
            assert f"export {spec.addr_env}=127.0.0.1:{base + i}" in up.out
        assert f"console  http://127.0.0.1:{base + 4}" in up.out
        pgdata = embedded_pgdata(data_dir)
        pid = embedded_pid(pgdata)
        assert pid is not None
        status = subprocess.run(
            [sys.executable, "-m", "services.cli", "db", "status"], env=env, cwd=REPO, capture_output=True, text=True
        )
        assert f"running (pid {pid})" in status.stdout
        assert f"in use by `quayutec up` (pid {up.proc.pid}; gateway 127.0.0.1:{base}" in status.stdout
    assert "stopping the embedded PostgreSQL of this stack" in up.rest
    assert "RuntimeDirWarning" not in up.out + up.rest
    assert embedded_pid(pgdata) is None
    assert not _alive(pid)
    for i in range(6):
        assert port_is_free(base + i)


def _alive(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    return True


def test_db_stop_stops_a_server_left_running(data_dir: Path) -> None:
    from quayutec.db import embedded_ctl

    pgdata = embedded_pgdata(data_dir)
    embedded_ctl("start", pgdata)
    pid = embedded_pid(pgdata)
    assert pid is not None
    env = {**os.environ, "PYTHONPATH": str(REPO), "QUAYUTEC_DATA_DIR": str(data_dir)}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", "db", "stop"], env=env, cwd=REPO, capture_output=True, text=True
        )
    finally:
        if embedded_pid(pgdata) is not None:
            embedded_ctl("stop", pgdata)
    assert done.returncode == 0 and f"pid {pid}" in done.stdout, done.stdout + done.stderr
    assert "RuntimeDirWarning" not in done.stderr and "INFO" not in done.stderr
    assert embedded_pid(pgdata) is None
    again = subprocess.run(
        [sys.executable, "-m", "services.cli", "db", "stop"], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert again.returncode == 0 and "no embedded PostgreSQL running" in again.stdout


def test_services_end_when_up_itself_is_killed_and_the_next_up_takes_over(data_dir: Path) -> None:
    """SIGKILL leaves `up` no chance to stop anything: the kernel ends its services and drops its
    lock; the embedded PostgreSQL it leaves is taken over, and stopped, by the next `up`."""
    import psutil

    from quayutec.db import embedded_ctl

    base = _base_port()
    env = _env(QUAYUTEC_DATA_DIR=str(data_dir))
    pgdata = embedded_pgdata(data_dir)
    try:
        with running_up(env, base) as up:
            services = [c for c in psutil.Process(up.proc.pid).children() if "services." in " ".join(c.cmdline())]
            assert len(services) == 5  # the four services and the console
            up.proc.kill()
            up.proc.wait()
            _, alive = psutil.wait_procs(services, timeout=60)
            for proc in alive:
                proc.kill()
        assert alive == []
        left = embedded_pid(pgdata)
        assert left is not None and holder(data_dir) == "nobody"
        with running_up(env, base) as again:
            assert f"an embedded PostgreSQL (pid {left}) was left running in {data_dir}" in again.out
            assert embedded_pid(pgdata) == left
        assert "stopping the embedded PostgreSQL of this stack" in again.rest
        assert embedded_pid(pgdata) is None
    finally:
        if embedded_pid(pgdata) is not None:
            embedded_ctl("stop", pgdata)


@dataclass
class RunningUp:
    """A `quayutec up` started by a test: its process, what it printed until its hints, and after
    Ctrl-C the rest."""

    proc: subprocess.Popen[str]
    out: str
    rest: str = ""


@contextmanager
def running_up(env: Mapping[str, str], base: int, cwd: Path = REPO, *args: str) -> Iterator[RunningUp]:
    """`quayutec up --base-port base [args]` until its hints are printed; Ctrl-C on leaving, and it must stop."""
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--base-port", str(base), *args],
        cwd=cwd,
        env=dict(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert up.stdout is not None
    lines: list[str] = []
    try:
        for line in up.stdout:
            lines.append(line)
            if "company list" in line:  # the last hint
                break
        running = RunningUp(up, "".join(lines))
        assert "Ctrl-C stops everything" in running.out, running.out
        yield running
        if up.poll() is None:  # a test may have ended it itself
            up.send_signal(signal.SIGINT)
            running.rest = up.communicate(timeout=60)[0]
            assert up.returncode == 0, running.rest
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
    for name in ("DATABASE_URL", "QUAYUTEC_API_KEY", *(s.addr_env for s in SERVICES)):
        env.pop(name, None)
    return env


def _serving(addr: str) -> bool:
    import asyncio

    from services.stack import wait_serving

    asyncio.run(wait_serving(addr, limit=30))
    return True


def test_a_second_stack_on_the_same_data_folder_is_refused_and_the_first_keeps_working(data_dir: Path) -> None:
    env = _env(QUAYUTEC_DATA_DIR=str(data_dir))
    first, second = _base_port(), _base_port()
    with running_up(env, first) as running:
        up = running.proc
        pid = embedded_pid(embedded_pgdata(data_dir))
        assert pid is not None
        refused = subprocess.run(
            [sys.executable, "-m", "services.cli", "up", "--base-port", str(second)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 1, refused.stdout + refused.stderr
        said = refused.stderr
        assert "Traceback" not in said and refused.stdout == ""
        assert f"the data folder {data_dir} is in use by `quayutec up` (pid {up.pid}; gateway 127.0.0.1:{first}" in said
        assert f"console http://127.0.0.1:{first + 4}" in said
        assert f"QUAYUTEC_DATA_DIR={data_dir}-2 " in said and "up --base-port" in said
        assert all(port_is_free(second + i) for i in range(5))  # it started nothing
        # A service started on its own would share the stack's database: refused too.
        lone = subprocess.run(
            [sys.executable, "-m", "services.claims"],
            cwd=REPO,
            env={**env, "QUAYUTEC_CLAIMS_LISTEN": f"127.0.0.1:{second}"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert lone.returncode == 2, lone.stdout + lone.stderr
        assert f"belongs to `quayutec up` (pid {up.pid}" in lone.stderr and "Traceback" not in lone.stderr
        # `db stop` does not pull the database from under the stack either.
        stop = subprocess.run(
            [sys.executable, "-m", "services.cli", "db", "stop"], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert stop.returncode == 1 and "in use by `quayutec up`" in stop.stderr
        # The first stack is untouched: same PostgreSQL, its services answer, its admin commands work.
        assert embedded_pid(embedded_pgdata(data_dir)) == pid
        assert _serving(f"127.0.0.1:{first}")
        made = subprocess.run(
            [sys.executable, "-m", "services.cli", "company", "create", "Acme"],
            cwd=REPO,
            env={**env, "QUAYUTEC_ROOM_ADDR": f"127.0.0.1:{first + 1}"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert made.returncode == 0 and made.stdout.startswith("company "), made.stderr
    assert embedded_pid(embedded_pgdata(data_dir)) is None
    assert holder(data_dir) == "nobody"


def test_the_demo_runs_beside_a_stack_of_the_same_checkout(tmp_path: Path) -> None:
    """With `quayutec up` running on the checkout's default data folder, the demo, with every default
    of its own, runs to the end in a folder and on ports of its own, and the stack is untouched.
    (The checkout here is a fresh folder running this code, so a developer's own stack is never met.)"""
    checkout = Path(tempfile.mkdtemp(prefix="qy-co-", dir="/tmp"))
    checkout.chmod(0o755)
    env = _env()
    env.pop("QUAYUTEC_DATA_DIR", None)
    folder = checkout / ".quayutec"
    try:
        base = _base_port()
        with running_up(env, base, cwd=checkout) as running:
            up, out = running.proc, running.out
            assert f"export QUAYUTEC_DATA_DIR={folder}" in out
            pid = embedded_pid(embedded_pgdata(folder))
            demo = subprocess.run(
                [sys.executable, "-m", "services.cli", "demo", "--then-stop"],
                cwd=checkout,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=240,
            )
            said = demo.stdout
            assert demo.returncode == 0, said[-3000:] + demo.stderr[-3000:]
            assert f"{folder} is in use by `quayutec up` (pid {up.pid}" in said
            [temporary] = re.findall(r"a temporary folder of its own, (\S+)", said)
            assert "planner replies: 3 for 4 wakes" in said
            assert not Path(temporary).exists()  # removed, its PostgreSQL stopped
            # The stack's database, services and data folder are as they were.
            assert embedded_pid(embedded_pgdata(folder)) == pid
            assert _serving(f"127.0.0.1:{base}")
            assert holder(folder).startswith(f"`quayutec up` (pid {up.pid}")
            ports = re.findall(r"^   (?:gateway|room|claims|runtime|console)\s+\S+:(\d+)$", said, re.M)
            assert len(ports) == 5 and not {int(p) for p in ports} & {base + i for i in range(5)}, ports
    finally:
        shutil.rmtree(checkout, ignore_errors=True)


def test_ups_hints_work_as_printed(data_dir: Path) -> None:
    """The commands `quayutec up` suggests, run as printed with its exports: a company, its key, the list."""
    env = _env(QUAYUTEC_DATA_DIR=str(data_dir))
    with running_up(env, _base_port()) as running:
        out = running.out
        exports = dict(re.findall(r"^export (\w+)=(\S+)$", out, re.M))
        hints = [line.split("#")[0].strip() for line in out.split("act as that company:\n", 1)[1].splitlines()]
        assert len(hints) == 4, out
        shell = {**env, **exports}
        said: dict[str, str] = {}
        for hint in hints:
            if hint.startswith("export "):
                name, value = hint.removeprefix("export ").split("=", 1)
                assert value == "<the key>"
                shell[name] = said["key"]
                continue
            argv = [said.get("company", word) if word == "<company-id>" else word for word in shlex.split(hint)]
            done = subprocess.run(argv, cwd=data_dir, env=shell, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, (hint, done.stdout, done.stderr)
            if " company create " in f" {hint} ":
                said["company"] = done.stdout.split()[1]
            elif " keys create " in f" {hint} ":
                said["key"] = done.stdout.splitlines()[1]
            else:
                assert f"{said['company']}  Acme" in done.stdout, done.stdout
        # The key made as printed signs the client commands in.
        who = subprocess.run(
            [sys.executable, "-m", "services.cli", "room", "list"], cwd=REPO, env=shell, capture_output=True, text=True
        )
        assert who.returncode == 0 and "no rooms" in who.stdout, who.stderr


def test_up_piped_to_a_reader_that_ctrl_c_ended_still_stops_postgresql(data_dir: Path) -> None:
    """`quayutec up | tee log`, then Ctrl-C: tee ends with it, and `up` must stop PostgreSQL all the same."""
    env = _env(QUAYUTEC_DATA_DIR=str(data_dir))
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--base-port", str(_base_port())],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if "company list" in line:  # the last hint: everything runs
                break
        pid = embedded_pid(embedded_pgdata(data_dir))
        assert pid is not None
        up.stdout.close()  # the reader is gone, as tee is after Ctrl-C
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        assert embedded_pid(embedded_pgdata(data_dir)) is None
        assert not _alive(pid)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


async def test_the_demos_ports_are_held_for_its_services_until_they_stop(database_url: str, tmp_path: Path) -> None:
    """Issue 35: the demo's stack does not pick ports and let them go before its services bind them.
    Each is held from the moment it is chosen until its service starts (and again while a service is
    down after a crash): no other program can bind it meanwhile, the services and the console serve on
    exactly it, and stopping frees it. (The moment between a hold let go and the bind:
    tests/test_ports.py.)"""
    from quayutec.config import CLAIMS

    stack = LocalStack.with_ports(ephemeral=True, data_dir=tmp_path / "d")
    stack.database_url = database_url
    console_port = int(str(stack.console_listen).rpartition(":")[2])
    assert stack.gateway_console_port is not None
    ports = [*stack.ports.values(), console_port, stack.gateway_console_port]
    assert len(set(ports)) == 6
    try:
        assert not any(port_is_free(p) for p in ports)  # held before anything of ours listens
        await stack.start_services([CLAIMS.name])
        await stack.start_console()
        claims = stack.ports[CLAIMS.name]
        stack.kill(CLAIMS.name)  # a crash, as in the demo: its port is held again for the restart
        assert claims in stack.reserved and not _plain_bind_works(claims)
        await stack.start_services([CLAIMS.name])  # SERVING on the very port it was given
        assert stack.ports[CLAIMS.name] == claims and claims not in stack.reserved
    finally:
        stack.stop_all()
    assert all(port_is_free(p) for p in ports)


def _plain_bind_works(port: int) -> bool:
    """Whether another program binding ``port`` with no socket options would get it."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
