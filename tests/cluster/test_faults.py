"""Faults across the bed's network, each bounded in count and time, each counted from the database:
wakes acted on once, twice, recorded not done (with the ledger's reason), lost (claims without a
ledger row, wakes never claimed), and how long after the heal the last run ended.

Each test prints its figures: run with ``-s`` (``python -m scripts.cluster test -- -s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import pytest

from quayutec.v1 import gateway_pb2
from tests.cluster.bed import CLIENT_IP, DB_HOST, Bed, host_ips, pod_ip
from tests.cluster.world import Outcome, World, count_outcome, merge_counts, wait_settled, wait_until, world_on

WAKES = 40
# Runs sit in their model call this long, so the fault meets them in flight.
MODEL_DELAY_SECONDS = 1.0
# Longer than the bed's lease (6 s): wakes leased by the cut-off side must expire and be taken over.
PARTITION_SECONDS = 9.0
SETTLE_LIMIT_SECONDS = 75.0


def report(name: str, outcome: Outcome, bed: Bed, **figures: float) -> None:
    """Print the test's figures, with the packets the wire dropped since the last report."""
    extra = "".join(f", {k.replace('_', ' ')} {v:.1f} s" for k, v in figures.items())
    dropped = bed.counters(reset=True)["dropped"]
    print(f"\n{outcome.line(name)}{extra}; packets dropped by the partition {dropped}")


def assert_at_most_once(outcome: Outcome) -> None:
    """The promise: nothing twice; and every wake accounted for, acted once or recorded not done:
    no claim without its ledger row (the fence: a claim whose run never read the room is taken over
    or recorded NOT_STARTED), none never claimed."""
    assert outcome.twice == 0, outcome
    assert outcome.open_runs == 0, outcome
    assert outcome.once + outcome.not_done_total + outcome.lost == outcome.wakes, outcome
    assert outcome.claims_without_row == 0, outcome
    assert outcome.never_claimed == 0, outcome


async def seen_by_models(world: World, at_least: int, limit: float = 30.0) -> None:
    """Until the stand-ins have been asked ``at_least`` of this world's wakes (runs are in flight)."""

    async def enough() -> bool:
        return sum((await asyncio.to_thread(world.model_requests)).values()) >= at_least

    await wait_until(enough, limit=limit)


async def test_latency_between_hosts_changes_nothing(healed: Bed) -> None:
    """5 ms each way between hosts (every call between pods of different hosts, and every SQL
    statement, pays it): every wake is acted on once."""
    healed.set_delay(5)
    async with world_on(healed, "latency") as world:
        world.script_standins(times=WAKES, delay_seconds=0.2)
        started = time.monotonic()
        await world.post_many(0, WAKES)
        took = await wait_settled(world, limit=SETTLE_LIMIT_SECONDS)
        outcome = await count_outcome(world, await asyncio.to_thread(world.model_requests))
    report("5 ms between hosts", outcome, healed, all_ended_after=time.monotonic() - started, settled_in=took)
    assert_at_most_once(outcome)
    assert outcome.once == WAKES, outcome


async def test_a_service_host_cut_from_the_database_longer_than_a_lease(healed: Bed) -> None:
    """Host a loses the database for longer than a lease while runs are in flight and more wakes
    are posted; then the partition heals."""
    async with world_on(healed, "db-cut") as world:
        world.script_standins(times=WAKES, delay_seconds=MODEL_DELAY_SECONDS)
        await world.post_many(0, WAKES // 2)
        await seen_by_models(world, 5)
        healed.partition("a-db", host_ips("a"), host_ips(DB_HOST))
        # Posted during the cut as a client does (each tried on either Gateway until one answers); the
        # cut lasts PARTITION_SECONDS however long the posts take: a post still unanswered then is
        # answered after the heal.
        posting = asyncio.ensure_future(world.post_many(WAKES // 2, WAKES // 2))
        await asyncio.sleep(PARTITION_SECONDS)
        healed.heal("a-db")
        healed_at = time.time()
        await posting
        await wait_settled(world, limit=SETTLE_LIMIT_SECONDS)
        outcome = await count_outcome(world, await asyncio.to_thread(world.model_requests))
    recovered = (outcome.last_ended_at or healed_at) - healed_at
    report("host a cut from the database 9 s", outcome, healed, last_run_ended_after_heal=recovered)
    assert_at_most_once(outcome)


async def test_a_runtime_cut_from_the_other_hosts_gateway(healed: Bed) -> None:
    """Host a's Runtime cannot reach or be reached by host b's Gateway (everything else works)
    while wakes are posted and delivered; then the partition heals."""
    async with world_on(healed, "rt-cut") as world:
        world.script_standins(times=WAKES, delay_seconds=MODEL_DELAY_SECONDS)
        healed.partition("rt-a-gw-b", [pod_ip("a", "runtime")], [pod_ip("b", "gateway")], a_port=50054)
        await world.post_many(0, WAKES)
        await asyncio.sleep(PARTITION_SECONDS)
        healed.heal("rt-a-gw-b")
        healed_at = time.time()
        await wait_settled(world, limit=SETTLE_LIMIT_SECONDS)
        outcome = await count_outcome(world, await asyncio.to_thread(world.model_requests))
    recovered = max(0.0, (outcome.last_ended_at or healed_at) - healed_at)
    report("host a's Runtime cut from host b's Gateway 9 s", outcome, healed, last_run_ended_after_heal=recovered)
    assert_at_most_once(outcome)


@pytest.mark.timeout(150)
async def test_a_whole_host_killed_with_runs_in_flight(healed: Bed) -> None:
    """Every process of host a is killed at once (and the host falls silent) while runs are in
    flight on it; it comes back 9 s later. Its runs are ended by the other host's housekeeping."""
    async with world_on(healed, "kill") as world:
        world.script_standins(times=WAKES, delay_seconds=2 * MODEL_DELAY_SECONDS)
        await world.post_many(0, WAKES)
        await seen_by_models(world, 10)
        before = await asyncio.to_thread(world.model_requests_by_host)
        healed.kill_host("a")
        killed_at = time.time()
        await asyncio.sleep(PARTITION_SECONDS)
        await healed.restart_host("a")
        back_at = time.time()
        await wait_settled(world, limit=SETTLE_LIMIT_SECONDS)
        after = await asyncio.to_thread(world.model_requests_by_host)
        # Host a's stand-in died with it: its requests before the kill, and the new one's since.
        asked = merge_counts(before.get("a", {}), *after.values())
        outcome = await count_outcome(world, asked)
    report(
        "host a killed with runs in flight, back after 9 s",
        outcome,
        healed,
        back_after=back_at - killed_at,
        last_run_ended_after_restart=max(0.0, (outcome.last_ended_at or back_at) - back_at),
    )
    assert_at_most_once(outcome)


MESSAGES = 60
POST_EVERY_SECONDS = 0.1
# A stream silent for this long (three of the bed's 1 s heartbeats) is given up and resumed elsewhere.
WATCH_SILENCE_SECONDS = 3.0
# The whole follow, posting included, ends within this (it takes about 15 s).
FOLLOW_SECONDS = 90.0


@dataclass
class Follower:
    """A client following a room: one WatchRoom stream at a time, through the first Gateway of
    ``order`` that answers; when a stream ends or falls silent past the heartbeats it resumes on
    the next Gateway after the last cursor it received."""

    world: World
    order: list[str]
    seqs: list[int] = field(default_factory=list)  # message seqs received, in order, repeats included
    cursor: int | None = None
    hosts_used: list[str] = field(default_factory=list)
    resumed_at: float | None = None
    gave_up_at: float | None = None
    # How each stream ended, in order ("silent", "EOF", a status code, "done", "out of time").
    ends: list[str] = field(default_factory=list)

    async def follow(self, until: Callable[[], bool], limit: float) -> None:
        deadline = time.monotonic() + limit
        turn = 0
        while not until() and time.monotonic() < deadline:
            host = self.order[turn % len(self.order)]
            turn += 1
            self.hosts_used.append(host)
            request = gateway_pb2.WatchRoomRequest(room_id=self.world.room_id)
            if self.cursor is not None:
                request.after = self.cursor
            call = self.world.gateways[host].WatchRoom(
                request, metadata=(("authorization", f"Bearer {self.world.secret}"),)
            )
            end = "done"
            try:
                while not until():
                    if time.monotonic() >= deadline:
                        end = "out of time"
                        break
                    item = await asyncio.wait_for(call.read(), timeout=WATCH_SILENCE_SECONDS)
                    if item is grpc.aio.EOF:
                        end = "EOF"
                        break
                    if self.gave_up_at is not None and self.resumed_at is None:
                        self.resumed_at = time.monotonic()
                    for event in item.events:
                        if event.HasField("message") and event.message.body.startswith(self.world.tag):
                            self.seqs.append(event.message.seq)
                        self.cursor = event.cursor
                    if item.HasField("heartbeat"):
                        self.cursor = item.heartbeat.cursor
            except grpc.aio.AioRpcError as exc:
                end = exc.code().name
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise  # resuming cannot cure it
                if self.gave_up_at is None and self.seqs:
                    self.gave_up_at = time.monotonic()
            except TimeoutError:
                end = "silent"
                if self.gave_up_at is None and self.seqs:
                    self.gave_up_at = time.monotonic()
            finally:
                self.ends.append(end)
                call.cancel()


async def test_a_client_following_a_room_through_a_cut_off_gateway_resumes_on_the_other(healed: Bed) -> None:
    """A client follows a room through host a's Gateway while messages are posted through host b's;
    host a is cut off from every other host and the client. The client's stream falls silent, it
    resumes after its last cursor through host b's Gateway, and has every message once, in order."""
    async with world_on(healed, "watch") as world:
        # From the room's first event: a stream started "from now" could start after the first post.
        follower = Follower(world, order=["a", "b"], cursor=0)
        expected: list[int] = []

        async def post_all() -> None:
            for i in range(MESSAGES):
                if i == MESSAGES // 3:
                    healed.partition("a-off", host_ips("a"), [*host_ips("b"), *host_ips(DB_HOST), CLIENT_IP])
                got = await world.post_message(f"{world.tag} line {i}", key=f"{world.tag}-line-{i}", via=["b"])
                expected.append(got.message.seq)
                await asyncio.sleep(POST_EVERY_SECONDS)

        poster = asyncio.create_task(post_all())
        await follower.follow(lambda: poster.done() and len(set(follower.seqs)) >= len(expected), limit=FOLLOW_SECONDS)
        posting_done = poster.done()
        if not posting_done:
            poster.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poster  # raises what a post raised
        healed.heal("a-off")
    resumed = (follower.resumed_at or 0.0) - (follower.gave_up_at or 0.0)
    duplicates = len(follower.seqs) - len(set(follower.seqs))
    gaps = sorted(set(expected) - set(follower.seqs))
    print(
        f"\nwatch through host a, host a cut off after {MESSAGES // 3} of {MESSAGES} messages: received "
        f"{len(set(follower.seqs))}, duplicates {duplicates}, missing {len(gaps)}, in order "
        f"{follower.seqs == sorted(follower.seqs)}; streams on hosts {follower.hosts_used}, ended "
        f"{follower.ends}; posted {len(expected)}, posts retried {world.unavailable}; resumed "
        f"{resumed:.1f} s after giving up on the silent stream"
    )
    assert posting_done, f"only {len(expected)} of {MESSAGES} messages posted in {FOLLOW_SECONDS} s"
    assert follower.hosts_used[:2] == ["a", "b"], follower.hosts_used
    assert follower.seqs == expected, (gaps, duplicates)
