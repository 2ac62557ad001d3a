"""A Runtime SIGKILLed while a batch of wakes is being claimed: what became of each wake.

``python bench/claim_kill.py [--wakes 150] [--kill early,mid] [--repeat 1] [--down-seconds 3] [--json PATH]``

All four services run as processes on one PostgreSQL (``DATABASE_URL``'s server or an embedded
one), each scenario on a fresh database and stack. One agent is mentioned by ``wakes`` messages
posted through RoomService at once; the Gateway delivers them to the Runtime in batches
(StartRuns). The stand-in model answers each request with a reply and one ``remember`` after
``model seconds``. The Runtime process is SIGKILLed from outside, at a moment seen in the database
or the model's log (no failpoint, so the same kill applies to any checkout):

- early: as soon as a second claim of the agent is committed (a StartRuns' ClaimMany), model 0.2 s;
- mid: once 70 model requests were made (past the Gateway's first batch of 64), model 3 s.

The Runtime stays down ``down seconds``, is started again on its port, and the stack runs until
every wake is settled (a bounded wait); runs that were past their room read at the kill are then
aged past ``QUAYUTEC_GATEWAY_ABANDON_AFTER_SECONDS`` so housekeeping ends them. Figures, per kill,
from the tables themselves (claims, ledger, messages, memory) and the model's log:

- acted once: a succeeded run with one reply, one memory line and one model request;
- twice: more than one reply, memory line or model request for a wake;
- recorded not done: an ended run (failed or timed out) with its reason, nothing posted or written;
- claims without a ledger row: claimed wakes whose run has no row at the end;
- vanished: wakes neither acted on nor recorded (no row, or a row never ended);
- finished after the restart: seconds from the Runtime's restart until every wake that was not
  past its room read at the kill has ended (NaN when some never did, or there were none).

The code before the fence (the baseline) is measured by running this same file in a checkout of
that code: ``git worktree add /tmp/qy-base <ref> && cp bench/claim_kill.py /tmp/qy-base/bench/ &&
(cd /tmp/qy-base && <this checkout>/.venv/bin/python bench/claim_kill.py)``; the services then
run from that checkout (settings it does not know are ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

import asyncpg
import httpx

from bench.common import (
    BenchError,
    Figures,
    World,
    add_json_argument,
    base_env,
    create_migrated_database,
    drop_database,
    make_room_world,
    post_wakes,
    postgres_server,
    print_table,
    room_callers,
    run_main,
    running_stack,
    scratch_dir,
    standin_process,
    wait_for_room,
)
from quayutec.config import SERVICES
from services.stack import LocalStack

try:
    from quayutec.ledger import run_id_for
except ImportError:  # a checkout from before the fence keeps it in the Runtime
    from services.runtime.run import run_id_for  # type: ignore[attr-defined]

MODEL = "bench-model"
MODEL_SECONDS = {"early": 0.2, "mid": 3.0}
MID_KILL_AFTER_REQUESTS = 70
GATEWAY_ENV = {
    "QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.05",
    "QUAYUTEC_GATEWAY_BACKOFF_BASE_SECONDS": "0.2",
    "QUAYUTEC_GATEWAY_BACKOFF_CEILING_SECONDS": "1",
    "QUAYUTEC_GATEWAY_LEASE_SECONDS": "30",
    "QUAYUTEC_GATEWAY_EXPIRE_INTERVAL_SECONDS": "0.1",
    "QUAYUTEC_GATEWAY_ABANDON_AFTER_SECONDS": "600",
    "QUAYUTEC_GATEWAY_NOT_STARTED_AFTER_SECONDS": "1",
}
# Failsafes of the waits (the figures say what had not happened by then).
KILL_LIMIT_SECONDS = 120.0
SETTLE_LIMIT_SECONDS = 90.0
# post_wakes' messages say "question <i>"; a model request names its own wake after "You were woken by".
_ITEM = re.compile(r"question (\d+) about the launch plan")
_WOKEN_BY = re.compile(r"You were woken by: [^\"]*?question (\d+) about the launch plan")


@dataclass(frozen=True)
class Outcome:
    kill: str
    wakes: int
    claimed_at_kill: int
    past_read_at_kill: int
    acted_once: int
    twice: int
    not_done: int
    claims_without_row: int
    vanished: int
    finished_after_restart: float


async def _count(conn: asyncpg.Connection, query: str, *args: object) -> int:
    return int(await conn.fetchval(query, *args))


async def standin_requests(standin_url: str) -> list[Any]:
    """The model requests the stand-in saw for the bench's model."""
    async with httpx.AsyncClient(timeout=30) as http:
        got = await http.get(f"{standin_url}/_standin/requests", params={"model": MODEL})
    return list(got.json()["requests"])


async def model_requests(standin_url: str, items: dict[int, str]) -> Counter[str]:
    """Model requests per wake id, told apart by the question number each prompt carries."""
    counted: Counter[str] = Counter()
    for record in await standin_requests(standin_url):
        found = _WOKEN_BY.search(json.dumps(record))
        if found is None:
            raise BenchError("a model request for no wake of the bench")
        counted[items[int(found[1])]] += 1
    return counted


async def scenario(admin_url: str, kill: str, wakes: int, down_seconds: float) -> Outcome:
    database_url = await create_migrated_database(admin_url)
    try:
        with standin_process() as standin_url, scratch_dir("qy-claim-kill-") as data_dir:
            env = {**base_env(standin_url, data_dir), **GATEWAY_ENV}
            names = ["claims", "room", "runtime", "gateway"]
            async with running_stack(database_url, names, env, data_dir / "logs") as stack:
                await wait_for_room(stack, 60)
                async with room_callers(stack) as room:
                    world = await make_room_world(room, f"kill-{kill}", model=MODEL)
                    reply = {
                        "text": "Noted.",
                        "tool_calls": [{"name": "remember", "arguments": {"text": "noted once", "private": False}}],
                        "model": MODEL,
                        "times": wakes,
                        "delay_seconds": MODEL_SECONDS[kill],
                    }
                    async with httpx.AsyncClient(timeout=10) as http:
                        (await http.post(f"{standin_url}/_standin/replies", json=reply)).raise_for_status()
                    conn = await asyncpg.connect(database_url)
                    try:
                        return await _kill_and_count(stack, room, world, conn, standin_url, kill, wakes, down_seconds)
                    finally:
                        await conn.close()
    finally:
        await drop_database(admin_url, database_url)


async def _kill_and_count(
    stack: LocalStack,
    room: Any,
    world: World,
    conn: asyncpg.Connection,
    standin_url: str,
    kill: str,
    wakes: int,
    down_seconds: float,
) -> Outcome:
    agent = world.agent_id
    # post_wakes numbers its messages "question i"; the wakes it returns are in completion order.
    posted = await post_wakes(room, world, wakes)
    by_message = {
        str(r["message_id"]): int(_ITEM.findall(r["body"])[0])
        for r in await conn.fetch("SELECT message_id, body FROM messages WHERE room_id = $1", world.room_id)
        if _ITEM.search(r["body"])
    }
    items = {by_message[p.message_id]: p.wake_id for p in posted}
    run_ids = {run_id_for(agent, wake_id): wake_id for wake_id in items.values()}

    deadline = time.monotonic() + KILL_LIMIT_SECONDS
    while True:
        if kill == "early":
            due = await _count(conn, "SELECT count(*) FROM agent_run_locks WHERE agent_id = $1", agent) >= 2
        else:
            due = len(await standin_requests(standin_url)) >= MID_KILL_AFTER_REQUESTS
        if due:
            break
        if time.monotonic() > deadline:
            raise BenchError(f"the {kill} kill's moment did not come within {KILL_LIMIT_SECONDS} s")
        await asyncio.sleep(0.001 if kill == "early" else 0.02)
    stack.kill("runtime")
    claimed = await _count(conn, "SELECT count(*) FROM agent_run_locks WHERE agent_id = $1", agent)
    past_read = {
        r["run_id"]
        for r in await conn.fetch(
            "SELECT run_id FROM runs WHERE run_id = ANY($1::text[]) AND status = 'running'", list(run_ids)
        )
    }

    await asyncio.sleep(down_seconds)
    stack.start("runtime")
    restarted = time.monotonic()
    await stack.wait_serving(next(s for s in SERVICES if s.name == "runtime"))
    did_nothing = [r for r in run_ids if r not in past_read]
    finished = float("nan")
    deadline = time.monotonic() + SETTLE_LIMIT_SECONDS
    while time.monotonic() < deadline:
        ended = await _count(
            conn, "SELECT count(*) FROM runs WHERE run_id = ANY($1::text[]) AND ended_at IS NOT NULL", did_nothing
        )
        if did_nothing and ended == len(did_nothing):
            finished = time.monotonic() - restarted
            break
        pending = await _count(conn, "SELECT count(*) FROM wake_outbox WHERE delivered_at IS NULL")
        running = await _count(
            conn,
            "SELECT count(*) FROM runs WHERE run_id = ANY($1::text[]) AND ended_at IS NULL AND status <> 'not_started'",
            did_nothing,
        )
        if pending == 0 and running == 0 and time.monotonic() - restarted > 15:
            break  # delivered, nothing left running: what has not ended by now never will
        await asyncio.sleep(0.05)

    # The runs past their read at the kill made no progress since: age them past ABANDON_AFTER (600 s)
    # so housekeeping ends them now rather than in ten minutes.
    await conn.execute(
        "UPDATE runs SET updated_at = now() - interval '700 seconds'"
        " WHERE run_id = ANY($1::text[]) AND ended_at IS NULL",
        sorted(past_read),
    )
    deadline = time.monotonic() + SETTLE_LIMIT_SECONDS
    while time.monotonic() < deadline:
        left = await _count(
            conn,
            "SELECT count(*) FROM runs WHERE run_id = ANY($1::text[]) AND ended_at IS NULL",
            sorted(past_read),
        )
        if left == 0:
            break
        await asyncio.sleep(0.1)
    return await _outcome(conn, standin_url, kill, agent, items, run_ids, claimed, len(past_read), finished)


async def _outcome(
    conn: asyncpg.Connection,
    standin_url: str,
    kill: str,
    agent: str,
    items: dict[int, str],
    run_ids: dict[str, str],
    claimed: int,
    past_read: int,
    finished: float,
) -> Outcome:
    requests = await model_requests(standin_url, items)
    claims = {r["wake_id"] for r in await conn.fetch("SELECT wake_id FROM agent_run_locks WHERE agent_id = $1", agent)}
    runs = {
        r["run_id"]: r
        for r in await conn.fetch(
            "SELECT run_id, status, error, ended_at FROM runs WHERE run_id = ANY($1::text[])", list(run_ids)
        )
    }
    replies = Counter(
        {r["run_id"]: r["n"] for r in await conn.fetch("SELECT run_id, count(*) AS n FROM messages GROUP BY run_id")}
    )
    memory = Counter(
        {
            r["run_id"]: r["n"]
            for r in await conn.fetch("SELECT run_id, count(*) AS n FROM memory_lines GROUP BY run_id")
        }
    )
    acted = twice = not_done = vanished = 0
    for run_id, wake_id in run_ids.items():
        run = runs.get(run_id)
        if replies[run_id] > 1 or memory[run_id] > 1 or requests[wake_id] > 1:
            twice += 1
        elif run is not None and run["status"] == "succeeded" and (replies[run_id], memory[run_id]) == (1, 1):
            acted += 1
        elif run is not None and run["ended_at"] is not None and run["error"]:
            not_done += 1
        else:
            vanished += 1
    return Outcome(
        kill=kill,
        wakes=len(run_ids),
        claimed_at_kill=claimed,
        past_read_at_kill=past_read,
        acted_once=acted,
        twice=twice,
        not_done=not_done,
        claims_without_row=sum(1 for wake_id in claims if run_id_for(agent, wake_id) not in runs),
        vanished=vanished,
        finished_after_restart=finished,
    )


async def amain(opts: argparse.Namespace) -> Figures:
    kills = [k.strip() for k in opts.kill.split(",") if k.strip()]
    if not kills or any(k not in MODEL_SECONDS for k in kills):
        raise BenchError(f"--kill takes early, mid or both, got {opts.kill!r}")
    outcomes: list[Outcome] = []
    with postgres_server() as admin_url:
        for _ in range(opts.repeat):
            for kill in kills:
                outcome = await scenario(admin_url, kill, opts.wakes, opts.down_seconds)
                outcomes.append(outcome)
                print(outcome, file=sys.stderr, flush=True)
    headers = [
        "kill",
        "wakes",
        "claimed at kill",
        "past read at kill",
        "acted once",
        "twice",
        "recorded not done",
        "claims without row",
        "vanished",
        "finished after restart s",
    ]
    print_table(
        headers,
        [
            [
                o.kill,
                o.wakes,
                o.claimed_at_kill,
                o.past_read_at_kill,
                o.acted_once,
                o.twice,
                o.not_done,
                o.claims_without_row,
                o.vanished,
                o.finished_after_restart,
            ]
            for o in outcomes
        ],
    )
    figures: Figures = {}
    for i, o in enumerate(outcomes):
        name = f"{o.kill} #{i // len(kills) + 1}"
        figures[f"{name} acted once"] = o.acted_once
        figures[f"{name} twice"] = o.twice
        figures[f"{name} recorded not done"] = o.not_done
        figures[f"{name} claims without row"] = o.claims_without_row
        figures[f"{name} vanished"] = o.vanished
        figures[f"{name} finished after restart s"] = o.finished_after_restart
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--wakes", type=int, default=150)
    parser.add_argument("--kill", default="early,mid", help="early, mid or both (comma-separated)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each kill")
    parser.add_argument("--down-seconds", type=float, default=3.0, help="how long the Runtime stays down")
    add_json_argument(parser)
    return run_main(amain, parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
