"""The cluster tests share one bed per session (about 30 s to start); each test heals what it broke.

They run inside a network namespace of their own: `make test-cluster` (or
`python -m scripts.cluster test`) makes it with `unshare` and runs them there. Run anywhere else,
they fail saying so; they are never skipped.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from services.stack import REPO
from tests.cluster.bed import Bed, BedError, new_root

__all__ = ["REPO"]


@pytest.fixture(scope="session")
def bed() -> Iterator[Bed]:
    yield from _session_bed(ha=False)


@pytest.fixture(scope="session")
def ha_bed() -> Iterator[Bed]:
    """The bed with a highly available database (three hosts under Patroni): tests/cluster/ha.py. A
    session holds one bed only (both own the same addresses): `scripts.cluster test` runs the HA
    tests in a session of their own."""
    yield from _session_bed(ha=True)


def _session_bed(*, ha: bool) -> Iterator[Bed]:
    the_bed = Bed(new_root(), ha=ha)
    try:
        asyncio.run(the_bed.start())
    except BedError as exc:
        the_bed.stop()
        the_bed.remove_files()
        pytest.fail(str(exc), pytrace=False)
    except BaseException:
        the_bed.stop()
        raise
    try:
        yield the_bed
    finally:
        the_bed.stop()
        if os.environ.get("QUAYUTEC_BED_KEEP") == "1":
            print(f"\nthe bed's files are kept in {the_bed.root} (QUAYUTEC_BED_KEEP=1)")
        else:
            the_bed.remove_files()


# A failed test's report shows, per service log of the bed, its last warnings and errors written
# during the test (the bed's files are gone after the session).
LOG_LINES_ON_FAILURE = 25
_LOG_MARKS = pytest.StashKey[dict[Path, int]]()


def _log_marks(bed: Bed) -> dict[Path, int]:
    return {path: path.stat().st_size for path in sorted(bed.log_dir.glob("*.log"))}


def _warnings_since(marks: dict[Path, int], log_dir: Path) -> str:
    parts = []
    for path in sorted(log_dir.glob("*.log")):
        with path.open("rb") as log:
            log.seek(marks.get(path, 0))
            lines = log.read().decode(errors="replace").splitlines()
        worth = [line for line in lines if "WARNING" in line or "ERROR" in line or "Traceback" in line]
        if worth:
            parts.append(f"--- {path.name}: the last {min(len(worth), LOG_LINES_ON_FAILURE)} of {len(worth)}")
            parts.extend(worth[-LOG_LINES_ON_FAILURE:])
    return "\n".join(parts)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    marks = item.stash.get(_LOG_MARKS, None)
    bed = getattr(item, "funcargs", {}).get("healed")
    if report.failed and marks is not None and isinstance(bed, Bed) and bed.log_dir.is_dir():
        report.sections.append(("the bed's warnings and errors during the test", _warnings_since(marks, bed.log_dir)))
    return report


@pytest.fixture
def healed(bed: Bed, request: pytest.FixtureRequest) -> Iterator[Bed]:
    """The bed, its counters zeroed, with every partition and delay lifted after the test (whatever it left)."""
    bed.counters(reset=True)
    request.node.stash[_LOG_MARKS] = _log_marks(bed)
    try:
        yield bed
    finally:
        bed.heal()
        bed.set_delay(0)
