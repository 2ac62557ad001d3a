"""`quayutec up` goes where it is pointed and stops what it started, the embedded PostgreSQL too."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quayutec.config import SERVICES
from quayutec.db import embedded_pgdata, embedded_pid
from services.stack import LocalStack, free_port, port_is_free

REPO = Path(__file__).resolve().parent.parent


def test_ports_follow_the_listen_and_addr_settings() -> None:
    gateway, room = free_port(), free_port()
    env = {"QUAYUTEC_GATEWAY_LISTEN": f"127.0.0.1:{gateway}", "QUAYUTEC_ROOM_ADDR": f"localhost:{room}"}
    stack = LocalStack.with_ports(ephemeral=False, env=env) if _defaults_free() else None
    if stack is None:
        pytest.fail("the default ports 50053-50054 are taken on this machine; free them to run this test")
    assert stack.ports["gateway"] == gateway and stack.listen("gateway") == f"127.0.0.1:{gateway}"
    assert stack.ports["room"] == room and stack.addr("room") == f"localhost:{room}"
    assert stack.env()["QUAYUTEC_ROOM_ADDR"] == f"localhost:{room}"
    assert stack.ports["claims"] == 50053 and stack.ports["runtime"] == 50054


def _defaults_free() -> bool:
    return all(port_is_free(p) for p in (50053, 50054))


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
    """A port with the next four free too (four services and the console; bounded tries)."""
    for _ in range(50):
        base = free_port()
        if base + 4 < 65536 and all(port_is_free(base + i) for i in range(5)):
            return base
    raise AssertionError("found no five consecutive free ports")


def test_up_on_a_base_port_then_ctrl_c_stops_everything_it_started(data_dir: Path) -> None:
    base = _base_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "QUAYUTEC_DATA_DIR": str(data_dir)}
    env.pop("DATABASE_URL", None)
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--base-port", str(base)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert up.stdout is not None
    lines: list[str] = []
    try:
        for line in up.stdout:
            lines.append(line)
            if line.startswith("export QUAYUTEC_DATA_DIR"):
                break
        out = "".join(lines)
        assert "Ctrl-C stops everything" in out, out
        for i, spec in enumerate(sorted(SERVICES, key=lambda s: s.port)):
            assert f"export {spec.addr_env}=127.0.0.1:{base + i}" in out
        assert f"console  http://127.0.0.1:{base + 4}" in out
        pgdata = embedded_pgdata(data_dir)
        pid = embedded_pid(pgdata)
        assert pid is not None
        status = subprocess.run(
            [sys.executable, "-m", "services.cli", "db", "status"], env=env, cwd=REPO, capture_output=True, text=True
        )
        assert f"running (pid {pid})" in status.stdout
        up.send_signal(signal.SIGINT)
        rest = up.communicate(timeout=60)[0]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 0, rest
    assert "stopping the embedded PostgreSQL this command started" in rest and "RuntimeDirWarning" not in out + rest
    assert embedded_pid(pgdata) is None
    assert not _alive(pid)
    for i in range(5):
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


def test_services_end_when_up_itself_is_killed(data_dir: Path) -> None:
    """SIGKILL leaves `up` no chance to stop anything: the kernel ends its services for it."""
    import psutil

    from quayutec.db import embedded_ctl

    base = _base_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "QUAYUTEC_DATA_DIR": str(data_dir)}
    env.pop("DATABASE_URL", None)
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--base-port", str(base)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert up.stdout is not None
    try:
        for line in up.stdout:
            if line.startswith("export QUAYUTEC_DATA_DIR"):
                break
        services = [c for c in psutil.Process(up.pid).children() if "services." in " ".join(c.cmdline())]
        assert len(services) == 5  # the four services and the console
        up.kill()
        up.wait()
        _, alive = psutil.wait_procs(services, timeout=60)
        for proc in alive:
            proc.kill()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        # The embedded PostgreSQL outlives a killed `up`; `quayutec db stop` is for that.
        if embedded_pid(embedded_pgdata(data_dir)) is not None:
            embedded_ctl("stop", embedded_pgdata(data_dir))
    assert alive == []
