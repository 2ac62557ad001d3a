"""What network latency costs a wake: its p50 from post to reply with 0, 1 and 5 ms each way, and
the round trips it makes, counted by the bed's wire (request bursts per service, less the idle
rate of the same bed measured just before), never estimated.

Wakes go one at a time (post, then wait for the reply event on a WatchRoom stream), so each
wake's round trips are its own. Run with ``-s`` to see the table (docs/scaling.md quotes it).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

from quayutec.config import CLAIMS, GATEWAY, ROOM, RUNTIME
from tests.cluster.bed import DB_PORT, Bed
from tests.cluster.world import World, agent_replies, world_on

WAKES_PER_STEP = 15
IDLE_SECONDS = 4.0
REPLY_LIMIT_SECONDS = 30.0
PORTS = {"PostgreSQL": DB_PORT, "Room": ROOM.port, "Claims": CLAIMS.port, "Runtime": RUNTIME.port}


@dataclass(frozen=True)
class Step:
    delay_ms: float
    every_hop: bool
    p50_ms: float
    p90_ms: float
    round_trips: dict[str, float]  # per wake, by service called (the client's own calls excluded)
    packets: float  # per wake, every service

    def line(self) -> str:
        trips = ", ".join(f"{name} {n:.1f}" for name, n in self.round_trips.items())
        where = "every hop" if self.every_hop else "between hosts"
        return (
            f"{self.delay_ms:g} ms one way {where}: p50 post->reply {self.p50_ms:.0f} ms, p90 {self.p90_ms:.0f} ms; "
            f"round trips per wake {sum(self.round_trips.values()):.1f} ({trips}); packets per wake {self.packets:.0f}"
        )


async def measure(bed: Bed, world: World, delay_ms: float, *, every_hop: bool, start: int) -> Step:
    bed.set_delay(delay_ms, every_hop=every_hop)
    bed.counters(reset=True)
    idle_started = time.monotonic()
    await asyncio.sleep(IDLE_SECONDS)
    idle = bed.counters(reset=True)
    idle_seconds = time.monotonic() - idle_started
    latencies: list[float] = []
    async with agent_replies(world, "a") as queue:  # live before the first post
        bed.counters(reset=True)
        busy_started = time.monotonic()
        for i in range(start, start + WAKES_PER_STEP):
            posted_at = time.monotonic()
            await world.post(i, via=["a"])
            replied_at = await asyncio.wait_for(queue.get(), timeout=REPLY_LIMIT_SECONDS)
            latencies.append((replied_at - posted_at) * 1000)
    busy = bed.counters(reset=True)
    busy_seconds = time.monotonic() - busy_started
    scale = busy_seconds / idle_seconds

    def per_wake(kind: str, port: int) -> float:
        extra = float(busy[kind].get(str(port), 0)) - float(idle[kind].get(str(port), 0)) * scale
        return max(0.0, extra / WAKES_PER_STEP)

    packets = sum(
        per_wake("packets", p) for p in {int(k) for k in (*busy["packets"], *idle["packets"])} if p != GATEWAY.port
    )
    return Step(
        delay_ms=delay_ms,
        every_hop=every_hop,
        p50_ms=statistics.median(latencies),
        p90_ms=statistics.quantiles(latencies, n=10)[-1],
        round_trips={name: per_wake("requests", port) for name, port in PORTS.items()},
        packets=packets,
    )


async def test_latency_between_hosts_costs_round_trips_on_the_wake_path(healed: Bed) -> None:
    """0, 1 and 5 ms each way between hosts (calls inside a host and the client's are not delayed;
    every SQL statement is, the database being a host of its own)."""
    async with world_on(healed, "rtt") as world:
        world.script_standins(times=3 * WAKES_PER_STEP, delay_seconds=0.0)
        steps = [
            await measure(healed, world, ms, every_hop=False, start=n * WAKES_PER_STEP)
            for n, ms in enumerate((0, 1, 5))
        ]
    print("\n" + "\n".join(step.line() for step in steps))
    slope = (steps[2].p50_ms - steps[0].p50_ms) / (2 * 5)
    print(f"p50 grows {slope:.1f} ms per ms of round-trip time: {slope:.1f} round trips in sequence on the wake's path")
    for step in steps:
        assert step.round_trips["PostgreSQL"] > 0 and step.round_trips["Claims"] > 0, step


async def test_latency_on_every_hop(healed: Bed) -> None:
    """1 and 5 ms each way on every hop between pods, as when every service runs on its own machine."""
    async with world_on(healed, "rtt-every") as world:
        world.script_standins(times=2 * WAKES_PER_STEP, delay_seconds=0.0)
        steps = [
            await measure(healed, world, ms, every_hop=True, start=n * WAKES_PER_STEP) for n, ms in enumerate((1, 5))
        ]
    print("\n" + "\n".join(step.line() for step in steps))
    slope = (steps[1].p50_ms - steps[0].p50_ms) / (2 * 4)
    print(f"p50 grows {slope:.1f} ms per ms of round-trip time: {slope:.1f} round trips in sequence on the wake's path")
    for step in steps:
        assert step.round_trips["Runtime"] > 0 and step.round_trips["Room"] > 0, step
