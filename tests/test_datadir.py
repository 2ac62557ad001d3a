"""A data folder has one owner: a stack alone, or services started on their own together."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quayutec.datadir import DataDirTaken, Owner, holder, own, share

REPO = Path(__file__).resolve().parent.parent


def test_a_stack_owns_its_folder_alone(tmp_path: Path) -> None:
    assert holder(tmp_path) == "nobody"
    with own(tmp_path, again="quayutec up --base-port 61051") as lock:
        lock.record(Owner(os.getpid(), "quayutec up", {"gateway": "127.0.0.1:61051", "console": "http://x"}))
        said = f"`quayutec up` (pid {os.getpid()}; gateway 127.0.0.1:61051, console http://x)"
        assert holder(tmp_path) == said
        with pytest.raises(DataDirTaken) as second:
            own(tmp_path, again="quayutec up --base-port 61051")
        assert str(second.value) == (
            f"the data folder {tmp_path} is in use by {said}. Use that stack (the exports it printed point the "
            "commands at it) or stop it (Ctrl-C in its terminal), or give this one a folder of its own: "
            f"`QUAYUTEC_DATA_DIR={tmp_path}-2 quayutec up --base-port 61051`"
        )
        with pytest.raises(DataDirTaken, match="belongs to `quayutec up`"):
            share(tmp_path)
    assert holder(tmp_path) == "nobody"
    own(tmp_path, again=None).release()  # free again


def test_services_on_their_own_share_it_and_keep_a_stack_out(tmp_path: Path) -> None:
    with share(tmp_path), share(tmp_path):
        assert holder(tmp_path) == f"services started on their own (pid {os.getpid()}), sharing its embedded PostgreSQL"
        with pytest.raises(DataDirTaken, match="in use by services started on their own") as refused:
            own(tmp_path, again=None)
        assert "Stop them" in str(refused.value) and "QUAYUTEC_DATA_DIR" not in str(refused.value)
    assert holder(tmp_path) == "nobody"


def test_the_lock_ends_with_its_process_even_when_killed(tmp_path: Path) -> None:
    """No stale lock: a stack ended by SIGKILL leaves the folder free for the next one."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, os; from pathlib import Path; from quayutec.datadir import own, Owner\n"
            "lock = own(Path(sys.argv[1]), again=None); lock.record(Owner(os.getpid(), 'quayutec up'))\n"
            "print('held', flush=True); sys.stdin.read()",
            str(tmp_path),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        assert holder(tmp_path) == f"`quayutec up` (pid {child.pid})"
        child.kill()
        child.wait()
        assert holder(tmp_path) == "nobody"
        own(tmp_path, again=None).release()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
