"""PostgreSQL failovers under load on the HA bed (three database hosts under Patroni, synchronous
replication): the primary's host killed, cut off longer than the TTL, and switched over on purpose.
Each with at least 100 wakes in flight, counted from the surviving database: nothing acted on twice,
no claim without its ledger row, no acknowledged post missing.

The sync standby lost before the primary, and the negative control (asynchronous replication with
the standbys kept behind, which loses acknowledged work), run in bench/failover.py.

Run with ``-s`` to see the figures (``python -m scripts.cluster test tests/cluster/test_failover.py -s``).
"""

from __future__ import annotations

import pytest

from tests.cluster.bed import Bed
from tests.cluster.failover import FaultRun, cut_primary, kill_primary, switchover, under_load


def assert_nothing_lost_nothing_twice(run: FaultRun) -> None:
    o = run.outcome
    assert o.twice == 0, run.line()
    assert o.claims_without_row == 0, run.line()
    assert o.never_claimed == 0, run.line()
    assert o.posts_missing == 0, run.line()
    assert o.open_runs == 0, run.line()
    assert o.once + o.not_done_total == o.wakes, run.line()


@pytest.mark.timeout(360)
async def test_the_primary_host_killed_then_back_as_a_standby(ha_bed: Bed) -> None:
    run = await under_load(ha_bed, "pg-kill", kill_primary)
    print("\n" + run.line())
    assert_nothing_lost_nothing_twice(run)


@pytest.mark.timeout(360)
async def test_the_primary_host_cut_off_longer_than_the_ttl_demotes_and_loses_nothing(ha_bed: Bed) -> None:
    run = await under_load(ha_bed, "pg-cut", cut_primary)
    print("\n" + run.line())
    assert_nothing_lost_nothing_twice(run)


@pytest.mark.timeout(360)
async def test_a_switchover_under_load(ha_bed: Bed) -> None:
    """Clients see at most UNAVAILABLE answers (retried): any other code fails the posting client."""
    run = await under_load(ha_bed, "pg-switch", switchover)
    print("\n" + run.line())
    assert_nothing_lost_nothing_twice(run)
