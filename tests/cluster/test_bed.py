"""The bed from its one command: `python -m scripts.cluster up` starts it in namespaces of its own,
`down` stops it, and nothing is left: no process, no network device or address, no mount, no file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.cluster import leftovers
from tests.cluster.bed import Bed, BedError, check_isolated, interfaces, new_root
from tests.cluster.conftest import REPO


def cluster(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scripts.cluster", "--root", str(root), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )


def addresses() -> str:
    return subprocess.run(["ip", "-o", "addr", "show"], check=True, capture_output=True, text=True).stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ha", [False, True], ids=["one-database", "ha-database"])
def test_up_then_down_leaves_nothing_behind(ha: bool) -> None:
    """With ``--ha``, the three database hosts' etcd, Patroni and PostgreSQL go too."""
    # Not under pytest's private temporary folder: PostgreSQL runs as another user and must reach it.
    root = new_root() / "bed"
    links, addrs = interfaces(), addresses()
    mounts = Path("/proc/self/mountinfo").read_text()
    up = cluster(root, *(["--ha"] if ha else []), "up")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "10.77.2.11:50051" in up.stdout, up.stdout
    assert ("pg1, pg2, pg3" in up.stdout) == ha, up.stdout
    assert leftovers(root), "the bed runs processes of its own"
    # From inside the bed's network, host b's Gateway answers; from here (another namespace) nothing of the bed shows.
    probe = "import socket; socket.create_connection(('10.77.3.11', 50051), timeout=5).close(); print('reached')"
    inside = cluster(root, "exec", "--", sys.executable, "-c", probe)
    assert inside.stdout.strip() == "reached", inside.stdout + inside.stderr
    assert interfaces() == links and addresses() == addrs
    assert cluster(root, "fault", "delay", "1").returncode == 0
    down = cluster(root, "down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert leftovers(root) == []
    assert interfaces() == links and addresses() == addrs
    assert Path("/proc/self/mountinfo").read_text() == mounts
    assert not root.exists()
    root.parent.rmdir()


def test_the_bed_refuses_a_namespace_with_any_interface_but_loopback(bed: Bed) -> None:
    """The session's bed has given this namespace its client device: a second bed here must refuse."""
    assert "qyclient" in interfaces()
    with pytest.raises(BedError, match="only interface is lo"):
        check_isolated()
