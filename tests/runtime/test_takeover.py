"""A Runtime killed (or stalled) between a wake's claim and its run's first ledger write.

The run's first ledger write, made with its room read, is the fence (Run.attempt): at most one run
of a wake reads the room. A claim whose run never got there is taken over by the next delivery's
run, so the wake is finished, once; a run that got past it is never redone, and housekeeping ends
it if its Runtime died. Every claim has a ledger row: while no Runtime takes the wake over,
housekeeping records it NOT_STARTED.

Real processes: the Runtime is ``python -m services.runtime``, SIGKILLed while a StartRuns batch of
150 wakes is being claimed (right after its first ClaimMany, and mid-batch with runs past their room
read), or while a lone StartRun is between its claim and its read; or stalled there while a
redelivery races it. Each test prints its figures (acted on once, twice, recorded not done, claims
without a row, seconds to finish after the restart): run with ``-s``.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg
import grpc
import pytest

from quayutec.ledger import run_id_for
from quayutec.v1 import common_pb2, runtime_pb2
from services.runtime.standin import StandinProvider
from services.stack import free_port
from tests.harness.claims import running_claims
from tests.harness.gateway import running_gateway
from tests.harness.room import running_room
from tests.harness.runtime import RuntimeProcess, running_runtime
from tests.runtime.world import ENDED, World, make_world, runtime_stub, start_request

ACCEPTED = runtime_pb2.START_RUN_RESULT_ACCEPTED
ALREADY_CLAIMED = runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED
BATCH_WAKES = 150
# How long each model request takes.
MODEL_DELAY = 0.2
# Model requests seen before the "mid" kill: past the Gateway's first batch (64), into the second.
MID_KILL_AFTER_REQUESTS = 70
# "Mid": the runs let past their room read sit in their model call until the kill (an answer that
# does not come within the test), so none of them has posted when it is killed, however slow the
# machine; the runs after the restart get answers after MODEL_DELAY.
STALLED_MODEL_SECONDS = 600.0
GATEWAY_ENV = {
    "QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.05",
    "QUAYUTEC_GATEWAY_BACKOFF_BASE_SECONDS": "0.2",
    "QUAYUTEC_GATEWAY_BACKOFF_CEILING_SECONDS": "1",
    "QUAYUTEC_GATEWAY_LEASE_SECONDS": "30",
    "QUAYUTEC_GATEWAY_EXPIRE_INTERVAL_SECONDS": "0.1",
    "QUAYUTEC_GATEWAY_ABANDON_AFTER_SECONDS": "600",
    "QUAYUTEC_GATEWAY_NOT_STARTED_AFTER_SECONDS": "1",
}
# Bounds of the tests' waits (failsafes, not timing assertions).
LIMIT_SECONDS = 120.0
_NOTE = re.compile(r"You were woken by: @planner note (\d+)")


@dataclass(frozen=True)
class Figures:
    wakes: int
    acted_once: int  # one succeeded run, one reply, one memory line, one model request
    twice: int  # more than one reply, memory line or model request
    not_done: int  # the run ended without acting, its reason in the ledger
    claims_without_row: int
    taken_over: int  # runs whose row another delivery took over (its attempt is not the claimant's)
    past_read_at_kill: int  # runs that had read the room when their Runtime was killed
    finished_after_restart: float  # seconds from the restart until every wake that had done nothing acted

    def line(self, name: str) -> str:
        return (
            f"{name}: wakes {self.wakes}, acted once {self.acted_once}, twice {self.twice}, "
            f"recorded not done {self.not_done}, claims without a ledger row {self.claims_without_row}, "
            f"taken over {self.taken_over}, past the room read at the kill {self.past_read_at_kill}, "
            f"finished {self.finished_after_restart:.1f} s after the restart"
        )


def model_requests_per_wake(standin: StandinProvider, w: World, notes: dict[int, str]) -> Counter[str]:
    """Model requests per wake id, told apart by the note number each prompt carries."""
    counted: Counter[str] = Counter()
    for request in standin.requests(w.model_a):
        found = _NOTE.search(json.dumps(request.body))
        assert found is not None, "a model request for no wake of the test"
        counted[notes[int(found[1])]] += 1
    return counted


async def count(
    database_url: str,
    w: World,
    wake_ids: list[str],
    requests: Counter[str],
    *,
    past_read: set[str],
    finished_after_restart: float,
) -> Figures:
    """The figures, from the tables themselves (claims, ledger, messages, memory) and the model's log."""
    agent = w.agent_a.agent_id
    run_ids = {run_id_for(agent, wake_id): wake_id for wake_id in wake_ids}
    conn = await asyncpg.connect(database_url)
    try:
        claims = {
            r["wake_id"]: r["claimant"]
            for r in await conn.fetch("SELECT wake_id, claimant FROM agent_run_locks WHERE agent_id = $1", agent)
        }
        runs = {
            r["run_id"]: r
            for r in await conn.fetch(
                "SELECT run_id, status, error, attempt FROM runs WHERE run_id = ANY($1::text[])", list(run_ids)
            )
        }
        replies = Counter(
            dict(await conn.fetch("SELECT run_id, count(*) FROM messages WHERE run_id IS NOT NULL GROUP BY run_id"))
        )
        memory = Counter(
            dict(await conn.fetch("SELECT run_id, count(*) FROM memory_lines WHERE run_id IS NOT NULL GROUP BY run_id"))
        )
    finally:
        await conn.close()
    acted = twice = not_done = 0
    for run_id, wake_id in run_ids.items():
        run = runs.get(run_id)
        if replies[run_id] > 1 or memory[run_id] > 1 or requests[wake_id] > 1:
            twice += 1
        elif run is not None and run["status"] == "succeeded" and (replies[run_id], memory[run_id]) == (1, 1):
            acted += 1
        elif run is not None and run["status"] in ("failed", "timed_out") and run["error"]:
            assert (replies[run_id], memory[run_id]) == (0, 0), f"run {run_id} ended undone yet acted"
            not_done += 1
    return Figures(
        wakes=len(wake_ids),
        acted_once=acted,
        twice=twice,
        not_done=not_done,
        claims_without_row=sum(1 for wake_id in claims if run_id_for(agent, wake_id) not in runs),
        taken_over=sum(1 for r in runs.values() if r["attempt"] != claims.get(run_ids[r["run_id"]])),
        past_read_at_kill=len(past_read),
        finished_after_restart=finished_after_restart,
    )


async def wait_for(what: str, predicate: Callable[[], Awaitable[bool] | bool], limit: float = LIMIT_SECONDS) -> None:
    """Poll ``predicate`` until it holds (bounded: a failsafe, not a timing assertion)."""
    deadline = time.monotonic() + limit
    while True:
        held = predicate()
        if held if isinstance(held, bool) else await held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {limit} s: {what}")
        await asyncio.sleep(0.02)


async def count_of(database_url: str, query: str, *args: object) -> int:
    conn = await asyncpg.connect(database_url)
    try:
        return int(await conn.fetchval(query, *args))
    finally:
        await conn.close()


async def claims_without_row(database_url: str, agent_id: str) -> int:
    """Claims of ``agent_id`` whose run has no ledger row (run ids are computed here, as everywhere)."""
    conn = await asyncpg.connect(database_url)
    try:
        claimed = [
            r["wake_id"] for r in await conn.fetch("SELECT wake_id FROM agent_run_locks WHERE agent_id = $1", agent_id)
        ]
        rows = await conn.fetchval(
            "SELECT count(*) FROM runs WHERE run_id = ANY($1::text[])", [run_id_for(agent_id, w) for w in claimed]
        )
    finally:
        await conn.close()
    return len(claimed) - int(rows)


async def runs_with_a_row(database_url: str, run_ids: list[str], status: str) -> set[str]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT run_id FROM runs WHERE run_id = ANY($1::text[]) AND status = $2", run_ids, status
        )
    finally:
        await conn.close()
    return {r["run_id"] for r in rows}


def script_replies(standin: StandinProvider, w: World, times: int, delay: float = 0.0) -> None:
    """``times`` replies of agent A's model, each with one remember (each wake's one write)."""
    standin.enqueue_reply(
        "Noted.",
        [{"name": "remember", "arguments": {"text": "noted once", "private": False}}],
        model=w.model_a,
        delay_seconds=delay,
        times=times,
    )


@pytest.mark.parametrize("kill", ["early", "mid"])
async def test_a_runtime_killed_while_a_start_runs_batch_is_claimed_loses_and_doubles_nothing(
    kill: str, database_url: str, standin: StandinProvider
) -> None:
    """150 wakes through a real Gateway; the Runtime process is SIGKILLed right after its first
    ClaimMany committed (every run paused before its room read), or mid-batch with the first batch's
    runs in their model call and the second batch's being claimed and read. While no Runtime runs,
    housekeeping gives every claim a ledger row; after the restart every wake whose run had done
    nothing is taken over and acted on once, and every run past its read is ended by housekeeping,
    recorded not done, never redone."""
    async with running_claims(database_url) as claims_addr, running_room(database_url) as room_addr:
        channels: list[grpc.aio.Channel] = []
        w = await make_world(room_addr, claims_addr, channels)
        agent = w.agent_a.agent_id
        stalled = MID_KILL_AFTER_REQUESTS if kill == "mid" else 0
        if stalled:
            script_replies(standin, w, stalled, STALLED_MODEL_SECONDS)
        script_replies(standin, w, BATCH_WAKES - stalled, MODEL_DELAY)
        port = free_port()
        # Early: every run pauses before its room read. Mid: the first 70 runs (the first batch and
        # a few of the second) read the room and call the model, the second batch's others pause.
        failpoints = "before_room_read" if kill == "early" else f"before_room_read:{MID_KILL_AFTER_REQUESTS}"
        procs = [RuntimeProcess(claims_addr, room_addr, standin.base_url, failpoints, port=port)]
        try:
            await procs[0].wait_ready()
            async with running_gateway(database_url, room_addr, procs[0].addr, **GATEWAY_ENV):
                posted = await asyncio.gather(*(w.post(f"@planner note {i}", [agent]) for i in range(BATCH_WAKES)))
                notes = {i: p.wakes[0].wake_id for i, p in enumerate(posted)}
                wake_ids = list(notes.values())
                run_ids = [run_id_for(agent, wake_id) for wake_id in wake_ids]
                # Early: the lone first claim's run, then the first ClaimMany's, reach the failpoint.
                await procs[0].wait_for_line("failpoint before_room_read reached", LIMIT_SECONDS, count=2)
                if kill == "mid":
                    model_called = lambda: len(standin.requests(w.model_a)) >= MID_KILL_AFTER_REQUESTS  # noqa: E731
                    await wait_for("runs in their model call", model_called)
                procs[0].kill()
                past_read = await runs_with_a_row(database_url, run_ids, "running")
                claimed = await count_of(
                    database_url, "SELECT count(*) FROM agent_run_locks WHERE agent_id = $1", agent
                )
                assert claimed > len(past_read), "the kill found no claim between its claim and its room read"
                # No Runtime runs now: housekeeping records each claim without a row as NOT_STARTED.
                await wait_for("every claim has a ledger row", lambda: _no_claim_without_row(database_url, agent))

                procs.append(RuntimeProcess(claims_addr, room_addr, standin.base_url, port=port))
                await procs[1].wait_ready()
                restarted = time.monotonic()
                did_nothing = [r for r in run_ids if r not in past_read]
                await wait_for(
                    "every wake that had done nothing is finished", lambda: _all_ended(database_url, did_nothing)
                )
                finished = time.monotonic() - restarted
                await wait_for("every wake delivered", lambda: _none_pending(database_url))

                # The runs past their read when killed: no progress for ABANDON_AFTER (600 s, moved
                # on here), and housekeeping ends them.
                await _age(database_url, sorted(past_read), seconds=700)
                await wait_for("the killed runs are ended", lambda: _all_ended(database_url, run_ids))
        finally:
            for proc in procs:
                proc.kill()
            for channel in channels:
                await channel.close()

    requests = model_requests_per_wake(standin, w, notes)
    figures = await count(database_url, w, wake_ids, requests, past_read=past_read, finished_after_restart=finished)
    print(figures.line(f"StartRuns batch, Runtime killed {kill}"))
    assert figures.twice == 0
    assert figures.claims_without_row == 0
    assert figures.acted_once + figures.not_done == BATCH_WAKES
    assert figures.not_done == len(past_read)  # exactly the runs past their read: never redone
    assert figures.acted_once == BATCH_WAKES - len(past_read)  # every wake that had done nothing
    assert figures.taken_over >= claimed - len(past_read) - (BATCH_WAKES - claimed)
    assert sum(requests.values()) == BATCH_WAKES  # one model request per wake, none again
    conn = await asyncpg.connect(database_url)
    try:
        reasons = {r["error"].split(":")[0] for r in await conn.fetch("SELECT error FROM runs WHERE status = 'failed'")}
    finally:
        await conn.close()
    assert reasons <= {"abandoned"}


async def test_a_start_run_killed_between_its_claim_and_its_room_read_is_finished_once(
    database_url: str, standin: StandinProvider
) -> None:
    """A lone StartRun: claimed, then the Runtime is SIGKILLed before its run reads the room (the
    call never answers). Of 24 concurrent redeliveries to a fresh Runtime exactly one takes the wake
    over and acts on it, once; the claim stays the first delivery's."""
    async with running_claims(database_url) as claims_addr, running_room(database_url) as room_addr:
        channels: list[grpc.aio.Channel] = []
        w = await make_world(room_addr, claims_addr, channels)
        script_replies(standin, w, 1)
        wake = (await w.post("@planner note 0", [w.agent_a.agent_id])).wakes[0]
        run_id = run_id_for(wake.agent_id, wake.wake_id)
        proc = RuntimeProcess(claims_addr, room_addr, standin.base_url, failpoints="before_room_read")
        try:
            await proc.wait_ready()
            first = asyncio.ensure_future(runtime_stub(proc.addr, channels).StartRun(start_request(wake), timeout=60))
            await proc.wait_for_line("failpoint before_room_read reached")
        finally:
            proc.kill()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await first
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await claims_without_row(database_url, w.agent_a.agent_id) == 1
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await w.run(run_id)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND

        async with running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as fresh:
            restarted = time.monotonic()
            again = await asyncio.gather(
                *(runtime_stub(fresh, channels).StartRun(start_request(wake)) for _ in range(24))
            )
            run = await w.wait_for_run(run_id, ENDED)
            finished = time.monotonic() - restarted
        for channel in channels:
            await channel.close()

    assert sorted(a.result for a in again) == [ACCEPTED] + [ALREADY_CLAIMED] * 23
    assert {a.run_id for a in again} == {run_id}
    assert run.status == common_pb2.RUN_STATUS_SUCCEEDED, run.error
    requests = model_requests_per_wake(standin, w, {0: wake.wake_id})
    figures = await count(database_url, w, [wake.wake_id], requests, past_read=set(), finished_after_restart=finished)
    print(figures.line("lone StartRun, Runtime killed between the claim and the room read"))
    assert (figures.acted_once, figures.twice, figures.not_done, figures.claims_without_row) == (1, 0, 0, 0)
    assert figures.taken_over == 1


async def test_a_stalled_run_and_a_redelivery_that_takes_over_never_both_act(
    database_url: str, standin: StandinProvider
) -> None:
    """Runs stalled (not dead) between their claim and their room read, in a real Runtime process,
    while redeliveries reach other Runtimes: wakes taken over while the stalled runs wait, wakes
    whose redeliveries' runs (three each, in a second process) wait at the same point and are let
    go with the stalled ones at once (a true race at the fence), and wakes left alone. For every
    wake exactly one run acts; the others stop before their room read."""
    groups = {"taken over while stalled": 4, "raced": 6, "left alone": 4}
    wakes_in: dict[str, list[common_pb2.Wake]] = {}
    async with running_claims(database_url) as claims_addr, running_room(database_url) as room_addr:
        channels: list[grpc.aio.Channel] = []
        w = await make_world(room_addr, claims_addr, channels)
        script_replies(standin, w, sum(groups.values()))
        notes: dict[int, str] = {}
        for name, n in groups.items():
            wakes_in[name] = []
            for _ in range(n):
                wake = (await w.post(f"@planner note {len(notes)}", [w.agent_a.agent_id])).wakes[0]
                notes[len(notes)] = wake.wake_id
                wakes_in[name].append(wake)
        wakes = [wake for group in wakes_in.values() for wake in group]
        procs = [RuntimeProcess(claims_addr, room_addr, standin.base_url, failpoints="before_room_read") for _ in "ab"]
        stalled, racing = procs
        try:
            await stalled.wait_ready()
            await racing.wait_ready()
            answers: dict[str, list[asyncio.Future[runtime_pb2.StartRunResponse]]] = {}

            def deliver(addr: str, group: list[common_pb2.Wake], times: int) -> None:
                for wake in group:
                    for _ in range(times):
                        call = runtime_stub(addr, channels).StartRun(start_request(wake), timeout=90)
                        answers.setdefault(wake.wake_id, []).append(asyncio.ensure_future(call))

            deliver(stalled.addr, wakes, 1)  # the first delivery of each wake: claimed, then stalled
            await stalled.wait_for_line("failpoint before_room_read reached", count=len(wakes))
            async with running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as other:
                deliver(other, wakes_in["taken over while stalled"], 3)
                taking_over = [answers[wake.wake_id][1:] for wake in wakes_in["taken over while stalled"]]
                await asyncio.gather(*(a for calls in taking_over for a in calls))  # the stalled ones wait on
                deliver(racing.addr, wakes_in["raced"], 3)
                await racing.wait_for_line("failpoint before_room_read reached", count=3 * groups["raced"])
                stalled.release_failpoints()  # both sides go on at once and meet at the fence
                racing.release_failpoints()
                results = {wake_id: [(await a).result for a in calls] for wake_id, calls in answers.items()}
                for wake in wakes:
                    await w.wait_for_run(run_id_for(wake.agent_id, wake.wake_id), ENDED)
        finally:
            for proc in procs:
                proc.kill()
            for channel in channels:
                await channel.close()

    for wake in wakes:
        assert results[wake.wake_id].count(ACCEPTED) == 1, f"wake {wake.wake_id}: {results[wake.wake_id]}"
    firsts = {wake_id: results[wake_id][0] for wake_id in results}
    assert all(firsts[w_.wake_id] == ALREADY_CLAIMED for w_ in wakes_in["taken over while stalled"])
    assert all(firsts[w_.wake_id] == ACCEPTED for w_ in wakes_in["left alone"])
    requests = model_requests_per_wake(standin, w, notes)
    figures = await count(
        database_url, w, [wake.wake_id for wake in wakes], requests, past_read=set(), finished_after_restart=0.0
    )
    stalled_lost = sum(1 for result in firsts.values() if result == ALREADY_CLAIMED)
    raced_won = sum(1 for w_ in wakes_in["raced"] if firsts[w_.wake_id] == ACCEPTED)
    print(
        f"race: wakes {len(wakes)}, acted once {figures.acted_once}, twice {figures.twice}, "
        f"claims without a ledger row {figures.claims_without_row}; raced wakes won by the stalled run "
        f"{raced_won} of {groups['raced']}, by a redelivery {groups['raced'] - raced_won}"
    )
    assert (figures.acted_once, figures.twice, figures.claims_without_row) == (len(wakes), 0, 0)
    assert figures.taken_over == stalled_lost
    assert len(stalled.lines_with("was taken over by another delivery before it read the room")) == stalled_lost


async def _no_claim_without_row(database_url: str, agent_id: str) -> bool:
    return await claims_without_row(database_url, agent_id) == 0


async def _none_pending(database_url: str) -> bool:
    return await count_of(database_url, "SELECT count(*) FROM wake_outbox WHERE delivered_at IS NULL") == 0


async def _all_ended(database_url: str, run_ids: list[str]) -> bool:
    ended = await count_of(
        database_url, "SELECT count(*) FROM runs WHERE run_id = ANY($1::text[]) AND ended_at IS NOT NULL", run_ids
    )
    return ended == len(run_ids)


async def _age(database_url: str, run_ids: list[str], *, seconds: int) -> None:
    """Move the last progress of ``run_ids`` that long into the past (as if no one touched them since)."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "UPDATE runs SET updated_at = now() - $2::bigint * interval '1 second'"
            " WHERE run_id = ANY($1::text[]) AND ended_at IS NULL",
            run_ids,
            seconds,
        )
    finally:
        await conn.close()
