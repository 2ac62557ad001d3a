"""The cluster tests share one bed per session (about 30 s to start); each test heals what it broke.

They run inside a network namespace of their own: `make test-cluster` (or
`python -m scripts.cluster test`) makes it with `unshare` and runs them there. Run anywhere else,
they fail saying so; they are never skipped.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

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


@pytest.fixture
def healed(bed: Bed) -> Iterator[Bed]:
    """The bed, its counters zeroed, with every partition and delay lifted after the test (whatever it left)."""
    bed.counters(reset=True)
    try:
        yield bed
    finally:
        bed.heal()
        bed.set_delay(0)
