"""Database failovers under load on the HA bed (``Bed(ha=True)``), shared by tests/cluster/test_failover.py
and bench/failover.py: each puts at least 100 wakes in flight, does one fault to the database
hosts, and counts every wake from the surviving database with the bed's counters (acted once, twice,
recorded not done, claims without a ledger row, acknowledged posts missing).

The figures: seconds without a primary (from the fault until Patroni runs a primary again), the
longest time posts were refused (the longest gap between two acknowledged posts of a client posting
one after another all along), and seconds from the fault until every wake was done.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tests.cluster.bed import Bed, host_ips
from tests.cluster.ha import HA_HOSTS, PG_PORT, TTL, HaDatabase, HaError
from tests.cluster.world import Outcome, World, agent_replies, count_outcome, wait_settled, wait_until, world_on

WAKES = 100
LATE_WAKES = 20  # posted while the fault happens, each retried until a Gateway answers
# Runs sit this long in their model call, so that the fault meets them in flight.
MODEL_DELAY_SECONDS = 3.0
# Longer than Patroni's TTL: the leader key of a cut-off or dead primary expires before it ends.
DOWN_SECONDS = TTL + 6.0
PRIMARY_LIMIT_SECONDS = 60.0
SETTLE_LIMIT_SECONDS = 150.0
PROBE_EVERY_SECONDS = 0.1


@dataclass
class Prober:
    """A client posting one message after another (no mention: it wakes nobody) through either
    Gateway, each retried until answered; when each was acknowledged."""

    world: World
    acked_at: list[float] = field(default_factory=list)
    stopping: bool = False

    async def run(self) -> None:
        i = 0
        while not self.stopping:
            await self.world.post_message(f"{self.world.tag} probe {i}", key=f"{self.world.tag}-probe-{i}", limit=90)
            self.acked_at.append(time.monotonic())
            i += 1
            await asyncio.sleep(PROBE_EVERY_SECONDS)

    def longest_gap(self, since: float) -> float:
        """The longest wait for an acknowledgement after ``since``."""
        times = [since, *(t for t in self.acked_at if t >= since)]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


@dataclass
class FaultRun:
    name: str
    outcome: Outcome
    no_primary_seconds: float | None  # None: the fault never left the cluster without a primary
    posts_refused_seconds: float
    drained_seconds: float | None  # None: not every wake was done within the limit
    unavailable: int  # UNAVAILABLE or DEADLINE_EXCEEDED answers to posts, each retried
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        o = self.outcome
        no_primary = "never" if self.no_primary_seconds is None else f"{self.no_primary_seconds:.1f} s"
        drained = "not within the limit" if self.drained_seconds is None else f"{self.drained_seconds:.1f} s"
        notes = "".join(f"\n    {n}" for n in self.notes)
        return (
            f"{self.name}: wakes {o.wakes}: once {o.once}, twice {o.twice}, not done {o.not_done_total} "
            f"({', '.join(f'{n} {r}' for r, n in sorted(o.not_done.items())) or 'none'}), "
            f"claims without a ledger row {o.claims_without_row}, never claimed {o.never_claimed}, "
            f"acknowledged posts missing {o.posts_missing}; without a primary {no_primary}, posts refused "
            f"for at most {self.posts_refused_seconds:.1f} s, every wake done {drained} after the fault; "
            f"retried UNAVAILABLE/DEADLINE answers {self.unavailable}{notes}"
        )


@dataclass
class Load:
    """What a fault function may use: the bed, the world under load, and where to note figures."""

    bed: Bed
    world: World
    ha: HaDatabase
    started: float = 0.0
    primary_back: float | None = None
    notes: list[str] = field(default_factory=list)

    def post_late(self) -> asyncio.Future[list[str]]:
        return asyncio.ensure_future(self.world.post_many(WAKES, LATE_WAKES))

    async def wait_new_primary(self, old: str, limit: float = PRIMARY_LIMIT_SECONDS) -> str:
        """Until a host other than ``old`` runs as the primary; notes when."""
        others = [h for h in HA_HOSTS if h != old]
        new = await asyncio.to_thread(self.ha.wait_primary, among=others, limit=limit)
        self.primary_back = time.monotonic()
        return new


Fault = Callable[[Load], Awaitable[None]]


async def seen_by_models(world: World, at_least: int, limit: float = 60.0) -> None:
    async def enough() -> bool:
        return sum((await asyncio.to_thread(world.model_requests)).values()) >= at_least

    await wait_until(enough, limit=limit)


async def under_load(
    bed: Bed,
    name: str,
    fault: Fault,
    *,
    settle: bool = True,
    settle_limit: float = SETTLE_LIMIT_SECONDS,
    label: str = "",
) -> FaultRun:
    """WAKES wakes posted and in flight, a client posting all along, then ``fault``; counted once
    every wake is done (or, ``settle=False``, once the limit has passed: a wake whose post was lost
    never ends)."""
    assert bed.ha_db is not None
    async with world_on(bed, name) as world:
        world.script_standins(times=2 * (WAKES + LATE_WAKES), delay_seconds=MODEL_DELAY_SECONDS)
        await world.post_many(0, WAKES)
        await seen_by_models(world, 20)
        load = Load(bed=bed, world=world, ha=bed.ha_db)
        prober = Prober(world)
        probing = asyncio.create_task(prober.run())
        load.started = time.monotonic()
        try:
            await fault(load)
            drained: float | None = None
            try:
                await wait_settled(world, limit=settle_limit)
                drained = time.monotonic() - load.started
            except AssertionError:
                if settle:
                    raise
        finally:
            prober.stopping = True
            await asyncio.wait_for(probing, timeout=120)
        outcome = await count_outcome(world, await asyncio.to_thread(world.model_requests))
    no_primary = None if load.primary_back is None else load.primary_back - load.started
    return FaultRun(
        name=label or name,
        outcome=outcome,
        no_primary_seconds=no_primary,
        posts_refused_seconds=prober.longest_gap(load.started),
        drained_seconds=drained,
        unavailable=world.unavailable,
        notes=load.notes,
    )


async def rejoined(load: Load, host: str, limit: float = 120) -> None:
    """Until the cluster is healthy again and ``host`` is one of its standbys."""
    await asyncio.to_thread(load.ha.wait_healthy, limit)
    role = load.ha.roles()[host]
    own = await asyncio.to_thread(load.ha.status, host, 2.0)
    load.notes.append(f"{host} back as {role}; cluster {load.ha.roles()}")
    assert role.split("/")[0] in ("replica", "sync_standby"), role
    assert own is not None and own.get("role") == "replica", own


# -- the faults -------------------------------------------------------------------------------------


async def kill_primary(load: Load) -> None:
    """Every process of the primary's host SIGKILLed and the host silent; back DOWN_SECONDS later."""
    old = load.ha.wait_primary()
    late = load.post_late()
    await asyncio.to_thread(load.bed.kill_host, old)
    new = await load.wait_new_primary(old)
    load.notes.append(f"primary {old} killed; {new} promoted")
    await asyncio.sleep(max(0.0, load.started + DOWN_SECONDS - time.monotonic()))
    await load.bed.restart_host(old)
    await late
    await rejoined(load, old)


async def cut_primary(load: Load) -> None:
    """The primary's host cut from every other host (the other database hosts, the services, this
    client) for DOWN_SECONDS; meanwhile a client on the host itself writes to it. The write must not
    be acknowledged unless it survives: synchronous replication cannot confirm it, and Patroni
    demotes the cut-off primary once it cannot renew its leader key."""
    old = load.ha.wait_primary()
    others = [ip for h, pod in load.bed.pods.items() if h != old for ip in [pod.ip]]
    await asyncio.to_thread(load.ha.local_sql, old, "CREATE TABLE IF NOT EXISTS bed_probe (tag text PRIMARY KEY)")
    await asyncio.to_thread(load.ha.wait_healthy, 30)  # the table is on a standby too
    late = load.post_late()
    load.bed.partition(f"cut-{old}", host_ips(old), [*others, "10.77.9.1"])
    load.bed.unreachable_database_hosts.add(old)
    tag = load.world.tag
    write = asyncio.create_task(
        asyncio.to_thread(load.ha.local_sql, old, f"INSERT INTO bed_probe VALUES ('{tag}')", timeout=DOWN_SECONDS - 1)
    )
    demoted_after = None
    deadline = load.started + DOWN_SECONDS
    new = None
    while time.monotonic() < deadline:
        if demoted_after is None:
            ok, out = await asyncio.to_thread(load.ha.local_sql, old, "SELECT pg_is_in_recovery()", timeout=2)
            if not (ok and out == "f"):
                demoted_after = time.monotonic() - load.started
        if new is None:
            found = await asyncio.to_thread(load.ha.primaries, [h for h in HA_HOSTS if h != old])
            if found:
                new = found[0]
                load.primary_back = time.monotonic()
        await asyncio.sleep(0.2)
    acknowledged, said = await write
    load.bed.heal(f"cut-{old}")
    load.bed.unreachable_database_hosts.discard(old)
    if new is None:
        new = await load.wait_new_primary(old)
    await late
    try:
        await rejoined(load, old, limit=60)
    except HaError as exc:
        # A cut-off primary whose last local commits (never acknowledged: no standby confirmed them)
        # were not rewound cannot stream from the new primary. Patroni usually rewinds it; when it
        # does not, an operator rebuilds it from the primary, as here. Nothing acknowledged is lost
        # either way: the counts below are taken from the new primary.
        load.notes.append(f"{old} did not rejoin by itself ({exc}); rebuilt from the primary")
        await asyncio.to_thread(load.ha.reinit, old)
        await rejoined(load, old)
    ok, kept = await asyncio.to_thread(load.ha.local_sql, new, f"SELECT count(*) FROM bed_probe WHERE tag = '{tag}'")
    load.notes.append(
        f"primary {old} cut off {DOWN_SECONDS:g} s; {new} promoted; the old primary stopped being one "
        f"{'never' if demoted_after is None else f'{demoted_after:.1f} s'} after the cut; a write on it during "
        f"the cut acknowledged {acknowledged} ({said!r}), on the new primary after the heal: {kept}"
    )
    assert ok, kept
    # Whatever the cut-off primary acknowledged is on the new primary; nothing it acknowledged is lost.
    assert not acknowledged or kept == "1", (acknowledged, kept)


async def switchover(load: Load) -> None:
    """A planned switchover (``patronictl switchover``) to the synchronous standby while under load."""
    old = load.ha.wait_primary()
    candidate = load.ha.sync_standbys()[0]
    late = load.post_late()
    await asyncio.to_thread(load.ha.switchover, old, candidate)
    new = await load.wait_new_primary(old)
    load.notes.append(f"switchover {old} -> {candidate}: {new} is the primary")
    await late
    await rejoined(load, old)


async def lose_sync_standby_then_primary(load: Load) -> None:
    """The synchronous standby's host killed; once Patroni has made the other standby synchronous,
    the primary's host killed too. Two of three hosts gone: two of three etcd members gone with them,
    so no leader can be elected until one comes back."""
    old = load.ha.wait_primary()
    standby = load.ha.sync_standbys()[0]
    await asyncio.to_thread(load.bed.kill_host, standby)
    other = next(h for h in HA_HOSTS if h not in (old, standby))
    took = await asyncio.to_thread(
        load.ha.wait_for, "the other standby synchronous", lambda: load.ha.sync_standbys([old, other]) == [other], 60
    )
    load.notes.append(f"sync standby {standby} killed; {other} synchronous after {took:.1f} s")
    late = load.post_late()
    await asyncio.to_thread(load.bed.kill_host, old)
    killed_at = time.monotonic()
    await asyncio.sleep(DOWN_SECONDS)
    alone = await asyncio.to_thread(load.ha.status, other)
    load.notes.append(
        f"primary {old} killed; {DOWN_SECONDS:g} s later {other} is {alone and alone.get('role')} "
        f"({alone and alone.get('state')}): no etcd quorum, no election"
    )
    await load.bed.restart_host(standby)
    new = await load.wait_new_primary(old)
    load.notes.append(f"{standby} back: {new} promoted {time.monotonic() - killed_at:.1f} s after the primary's kill")
    await load.bed.restart_host(old)
    await late
    await rejoined(load, old)


async def negative_control(load: Load) -> None:
    """Asynchronous replication, the standbys' replication link cut, then the primary killed: what
    the primary acknowledged since the cut is gone after the failover. Synchronous replication is
    restored afterwards."""
    await asyncio.to_thread(load.ha.set_synchronous, False)
    old = load.ha.wait_primary()
    standbys = [h for h in HA_HOSTS if h != old]
    load.bed.partition(f"no-wal-{old}", host_ips(old), [ip for h in standbys for ip in host_ips(h)], a_port=PG_PORT)
    late = load.post_late()
    await late  # acknowledged by the primary, never sent to a standby
    await asyncio.sleep(MODEL_DELAY_SECONDS)  # runs claim, reply, remember on the primary alone
    await asyncio.to_thread(load.bed.kill_host, old)
    load.bed.heal(f"no-wal-{old}")
    new = await load.wait_new_primary(old)
    load.notes.append(f"async, replication cut, primary {old} killed; {new} promoted")
    await asyncio.sleep(max(0.0, load.started + DOWN_SECONDS - time.monotonic()))
    await load.bed.restart_host(old)
    await asyncio.to_thread(load.ha.wait_healthy, 120)
    await asyncio.to_thread(load.ha.set_synchronous, True)
    await asyncio.to_thread(load.ha.wait_healthy, 60)


# -- what the promise costs ----------------------------------------------------------------------------


async def post_to_reply_ms(world: World, start: int, count: int, limit: float = 30.0) -> list[float]:
    """``count`` wakes one at a time through host a's Gateway: milliseconds from each post to its
    reply on a WatchRoom stream (the client's view)."""
    took = []
    async with agent_replies(world, "a") as queue:  # live before the first post
        for i in range(start, start + count):
            posted_at = time.monotonic()
            await world.post(i, via=["a"])
            took.append((await asyncio.wait_for(queue.get(), timeout=limit) - posted_at) * 1000)
    return took
