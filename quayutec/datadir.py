"""Who owns a data folder (``QUAYUTEC_DATA_DIR``): its embedded PostgreSQL, logs and dev certificates.

One stack at a time owns a folder: ``quayutec up`` and ``quayutec demo`` hold an exclusive lock on
``<data dir>/stack.lock`` for as long as they run, and write into it who they are (pid, command,
addresses). Services started on their own (``python -m services.room`` with no ``DATABASE_URL``)
share the folder's embedded PostgreSQL with each other, so each holds a shared lock instead. A
stack cannot take a folder in use, and a service cannot join a folder a stack owns: each gets a
``DataDirTaken`` naming the holder and how to choose another folder.

The locks are ``flock`` locks on an open file: the kernel drops them when their process ends, by
SIGKILL too, so a lock never outlives its owner (what the file says may; it is read only while
its writer still holds the lock).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quayutec.config import DATA_DIR_ENV, ConfigError

LOCK_FILE = "stack.lock"
# How long a reader waits for a new owner to write who it is (it writes right after locking).
_RECORD_WAIT_SECONDS = 2.0


class DataDirTaken(ConfigError):
    """The data folder belongs to someone else; the message names them and what to do."""


@dataclass(frozen=True)
class Owner:
    """What the stack owning a folder says about itself."""

    pid: int
    command: str
    # Where its parts answer, by name: gateway, room, claims, runtime (host:port), console (URL).
    addresses: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        where = ", ".join(f"{name} {addr}" for name, addr in self.addresses.items())
        return f"`{self.command}` (pid {self.pid}{'; ' + where if where else ''})"

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        try:
            raw: Any = json.loads(text)
            return cls(int(raw["pid"]), str(raw["command"]), {str(k): str(v) for k, v in raw["addresses"].items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


class DataDirLock:
    """A held lock on a data folder; ``release`` (or leaving the ``with`` block) lets it go."""

    def __init__(self, data_dir: Path, fd: int, *, exclusive: bool) -> None:
        self.data_dir = data_dir
        self.exclusive = exclusive
        self._fd: int | None = fd

    def record(self, owner: Owner) -> None:
        """Write who owns the folder into the lock file, for a stack that meets it to name."""
        if not self.exclusive or self._fd is None:
            raise RuntimeError("only the exclusive owner of a data folder records itself")
        text = json.dumps({"pid": owner.pid, "command": owner.command, "addresses": dict(owner.addresses)})
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text.encode(), 0)

    def release(self) -> None:
        """Safe to call twice. An exclusive owner empties the file first: what it said is no longer true."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self.exclusive:
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the file drops the lock

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _open(data_dir: Path) -> int:
    data_dir.mkdir(parents=True, exist_ok=True)
    return os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def own(data_dir: Path, *, again: str | None) -> DataDirLock:
    """The folder for one stack alone, or ``DataDirTaken`` naming whoever has it; ``again`` is the
    command to run elsewhere instead (e.g. ``quayutec up --base-port 61051``), for the hint."""
    fd = _open(data_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        who, stack = _holder(data_dir)
        hint = (
            "Use that stack (the exports it printed point the commands at it) or stop it (Ctrl-C in its terminal)"
            if stack
            else "Stop them"
        )
        if again:
            hint += f", or give this one a folder of its own: `{DATA_DIR_ENV}={_sibling(data_dir)} {again}`"
        raise DataDirTaken(f"the data folder {data_dir} is in use by {who}. {hint}") from None
    return DataDirLock(data_dir, fd, exclusive=True)


def share(data_dir: Path) -> DataDirLock:
    """The folder shared with other services started on their own, or ``DataDirTaken`` when a
    stack owns it."""
    fd = _open(data_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DataDirTaken(
            f"the data folder {data_dir} belongs to {holder(data_dir)}, which runs its own services on "
            f"its embedded PostgreSQL. Set {DATA_DIR_ENV} to another folder for a service of your own, "
            "or DATABASE_URL to a database of your own"
        ) from None
    return DataDirLock(data_dir, fd, exclusive=False)


def holder(data_dir: Path) -> str:
    """Who holds the folder's lock now, in words; "nobody" when it is free."""
    return _holder(data_dir)[0]


def _holder(data_dir: Path) -> tuple[str, bool]:
    """Who holds the folder's lock, and whether that is a stack (rather than services on their own)."""
    path = data_dir / LOCK_FILE
    if not path.exists():
        return "nobody", False
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _stack_holder(path), True
        # A shared lock is granted beside other shared ones only: no stack holds the folder.
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pids = _lock_pids(path)
            them = f" (pid {', '.join(map(str, pids))})" if pids else ""
            return f"services started on their own{them}, sharing its embedded PostgreSQL", False
        return "nobody", False
    finally:
        os.close(fd)


def _stack_holder(path: Path) -> str:
    deadline = time.monotonic() + _RECORD_WAIT_SECONDS
    while True:
        owner = Owner.parse(path.read_text(errors="replace"))
        if owner is not None:
            return owner.describe()
        if time.monotonic() > deadline:
            pids = _lock_pids(path)
            return f"another stack (pid {', '.join(map(str, pids))})" if pids else "another stack"
        time.sleep(0.05)


def _lock_pids(path: Path) -> list[int]:
    """The processes holding a lock on ``path``, from Linux's /proc/locks (none where it is missing)."""
    try:
        st = path.stat()
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a blocked waiter has "->" after the number)
        if "->" in parts:
            continue
        if len(parts) >= 6 and parts[1] == "FLOCK":
            try:
                major, minor, inode = parts[5].split(":")
                same = (int(major, 16), int(minor, 16), int(inode)) == (
                    os.major(st.st_dev),
                    os.minor(st.st_dev),
                    st.st_ino,
                )
                pid = int(parts[4])
            except ValueError:
                continue
            if same and pid not in pids:
                pids.append(pid)
    return pids


def _sibling(data_dir: Path) -> Path:
    """Another folder beside ``data_dir``, for the hint (short: its path holds a Unix socket)."""
    return data_dir.with_name(f"{data_dir.name}-2")
