"""A PostgreSQL a test module alone starts and stops (for outage tests): ``own_postgres`` fixture.

It lives in a short folder under /tmp (the Unix socket path limit) and is removed at the end of the
module. Tests stop and start it to simulate an outage; other tests never share it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest

from quayutec.db import embedded_ctl


class OwnPostgres:
    """A PostgreSQL this module alone starts and stops, in a short tmp folder (Unix socket limit)."""

    def __init__(self, prefix: str = "qy-own-") -> None:
        self.root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
        self.root.chmod(0o755)  # pgserver runs PostgreSQL as its own user when we are root
        self.pgdata = self.root / "pg"
        self.running = False
        self.url = self._ctl("start")
        self.running = True

    def _ctl(self, action: Literal["start", "stop"]) -> str:
        return embedded_ctl(action, self.pgdata)

    def stop(self) -> None:
        if self.running:
            self._ctl("stop")
            self.running = False

    def start(self) -> None:
        """Starts it again (a no-op when running) on the same folder and address."""
        if not self.running:
            assert self._ctl("start") == self.url
            self.running = True

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def own_postgres() -> Iterator[OwnPostgres]:
    pg = OwnPostgres()
    try:
        yield pg
    finally:
        pg.remove()
