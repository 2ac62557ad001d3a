"""Where PostgreSQL's time per wake goes, statement by statement, and what one round trip costs.

``python bench/statements.py [--wakes 200] [--warmup 10] [--concurrency 1,32] [--posts 2000] [--rounds 4]
[--json PATH]``

Part 1, per statement. The four services run as processes on an embedded PostgreSQL (this part reads
the server's log, so ``DATABASE_URL`` is refused). P posters post a message mentioning the agent
through the Gateway and wait for its reply, as in ``bench/wakes.py``. For each level the same number
of wakes runs twice: first plain, where PostgreSQL's processes' CPU per wake is measured (the
baseline); then with ``log_statement_stats`` on, where PostgreSQL logs the CPU (user + system, from
getrusage) that each protocol message of each statement took. Each statement is named by the
``-- name:`` of the service query file it comes from. The table gives, per wake, the calls and CPU
of each statement, and the statements' sum beside the plain run's CPU of all of PostgreSQL (the rest
is connection handling, background processes and the bench's own polling, which is left out of the
table). The logging itself costs CPU; it is not in the per-statement figures, which are measured
inside each message.

Part 2, one round trip against several. The Room posts a message as BEGIN, ``post_check``,
``insert_message_with_wakes``, ``append_room_events``, COMMIT: five round trips. The same checks
and writes as one statement (a prototype written only here: the room row bumped once for the
message's seq and the event's cursor, the event's detail built before the statement) are run in
alternating rounds with the five, on the same database with the services stopped, by 1 and by 32
concurrent posters on a pool of connections. Per post: this process's CPU (the asyncpg client, on
uvloop as the services run) plus PostgreSQL's processes' CPU, and at 1 poster the wall time. The
ratio one/five is what folding a Room write into one statement would save, measured.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

import asyncpg
import uvloop

from bench import common
from bench.wakes import REPLIES_QUERY, ROOM_WAIT_SECONDS, cpu_ms_each, cpu_seconds, end_to_end, make_gateway_world
from quayutec.db import create_pool
from quayutec.sql import Queries
from quayutec.tls import GATEWAY
from quayutec.v1 import common_pb2

ROOT = Path(__file__).resolve().parent.parent
BENCH_POLLING, BENCH_CONTROL = "bench polling", "bench control"
SERVICES = ("claims", "room", "runtime", "gateway")
# The stats of one protocol message: "LOG:  EXECUTE MESSAGE STATISTICS" (or PARSE/BIND, or QUERY for a
# simple query), its DETAIL with "!\t0.000061 s user, 0.000011 s system, 0.000072 s elapsed", and its
# STATEMENT when log_min_error_statement lets it through.
_ENTRY = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \S+ \[(?P<pid>\d+)\] (?P<level>[A-Z]+):  (?P<text>.*)$")
_USAGE = re.compile(r"(?P<user>[\d.]+) s user, (?P<system>[\d.]+) s system, (?P<elapsed>[\d.]+) s elapsed")


def _normal(sql: str) -> str:
    return " ".join(sql.split()).rstrip(";").strip()


def statement_names() -> dict[str, str]:
    """Each service query's text (whitespace folded) -> "service.name"."""
    names: dict[str, str] = {}
    for service in ("room", "claims", "gateway"):
        folder = ROOT / "services" / service / "sql"
        for name, sql in Queries(folder / "queries.sql").items():
            names[_normal(sql)] = f"{service}.{name}"
        for extra in folder.glob("*.sql"):
            if extra.name not in ("queries.sql", "schema.sql"):
                text = "\n".join(line for line in extra.read_text().splitlines() if not line.lstrip().startswith("--"))
                names[_normal(text)] = f"{service}.{extra.stem}"
    names[_normal(REPLIES_QUERY)] = BENCH_POLLING
    return names


@dataclass
class StatementCost:
    calls: int = 0  # executions (a simple query or an Execute message)
    cpu_s: float = 0.0  # user + system of all of its messages (parse, bind, execute)


def parse_statement_stats(text: str, names: dict[str, str]) -> dict[str, StatementCost]:
    """Per statement name, from the server log lines written while log_statement_stats was on."""
    costs: dict[str, StatementCost] = defaultdict(StatementCost)
    # Per backend: the last stats entry (title, cpu) waiting for its STATEMENT line.
    pending: dict[str, tuple[str, float]] = {}
    current: dict[str, Any] | None = None

    def close(entry: dict[str, Any] | None) -> None:
        if entry is None:
            return
        pid, level, body = entry["pid"], entry["level"], "\n".join(entry["lines"])
        if level == "LOG" and body.endswith("STATISTICS"):
            pending[pid] = (body, 0.0)
        elif level == "DETAIL" and pid in pending:
            usage = _USAGE.search(body)
            if usage:
                title, _ = pending[pid]
                pending[pid] = (title, float(usage["user"]) + float(usage["system"]))
        elif level == "STATEMENT" and pid in pending:
            title, cpu = pending.pop(pid)
            sql = _normal(body)
            name = names.get(sql) or _simple_name(sql)
            cost = costs[name]
            cost.cpu_s += cpu
            if title.startswith(("EXECUTE", "QUERY")):
                cost.calls += 1

    for line in text.splitlines():
        match = _ENTRY.match(line)
        if match:
            close(current)
            current = {"pid": match["pid"], "level": match["level"], "lines": [match["text"]]}
        elif current is not None:
            current["lines"].append(line.lstrip("\t"))
    close(current)
    return dict(costs)


def _simple_name(sql: str) -> str:
    word = sql.split(" ", 1)[0].upper() if sql else ""
    if word in ("BEGIN", "COMMIT", "ROLLBACK") and len(sql) < 40:
        return word
    if sql.startswith(("ALTER SYSTEM", "SELECT pg_reload_conf()")):
        return BENCH_CONTROL
    return "other: " + sql[:60]


def service_of(name: str) -> str:
    if name in ("BEGIN", "COMMIT", "ROLLBACK"):
        return "BEGIN/COMMIT"
    return name.split(".", 1)[0] if "." in name else "other"


async def set_statement_stats(admin_url: str, on: bool) -> None:
    """Turn per-statement CPU logging on or off for every session (a reload reaches open sessions)."""
    conn = await asyncpg.connect(admin_url)
    try:
        if on:
            await conn.execute("ALTER SYSTEM SET log_statement_stats = on")
            await conn.execute("ALTER SYSTEM SET log_min_error_statement = 'log'")
        else:
            await conn.execute("ALTER SYSTEM RESET log_statement_stats")
            await conn.execute("ALTER SYSTEM RESET log_min_error_statement")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()
    await asyncio.sleep(0.5)  # the postmaster signals its backends; each rereads before its next command


@dataclass
class Level:
    concurrency: int
    wakes: int
    cpu_ms_per_wake: dict[str, float]  # each service process and all of PostgreSQL ("postgres"), plain run
    statements: dict[str, StatementCost] = field(default_factory=dict)


async def per_statement(opts: argparse.Namespace, admin_url: str, url: str) -> tuple[list[Level], dict[str, str]]:
    pgdata = common.embedded_pgdata(admin_url)
    if pgdata is None:
        raise common.BenchError("this bench reads the embedded PostgreSQL's log: unset DATABASE_URL")
    log = pgdata / "log"
    names = statement_names()
    levels: list[Level] = []
    with common.scratch_dir("qy-bench-statements-") as data_dir, common.standin_process() as standin_url:
        env = common.base_env(standin_url, data_dir)
        env.update(
            {
                "QUAYUTEC_GATEWAY_POST_RATE": "1000000",
                "QUAYUTEC_GATEWAY_POST_BURST": "1000000",
                "QUAYUTEC_RUNTIME_MAX_RUNS": str(2 * max(common.parse_concurrency(opts.concurrency)) + 16),
            }
        )
        pool = await create_pool(url, min_size=2, max_size=4)
        try:
            async with common.running_stack(url, SERVICES, env, data_dir / "logs") as stack:
                await common.wait_for_room(stack, ROOM_WAIT_SECONDS)
                async with common.room_callers(stack) as room, stack.channel("gateway", GATEWAY) as channel:
                    tag = uuid.uuid4().hex[:6]
                    with common.BatchWatcher(pool, REPLIES_QUERY, interval=0.002) as watcher:
                        for c in common.parse_concurrency(opts.concurrency):
                            world = await make_gateway_world(room, pool, channel, f"{tag}-{c}")
                            await end_to_end(world, watcher, opts.warmup, c)
                            before = cpu_seconds(stack, admin_url)
                            await end_to_end(world, watcher, opts.wakes, c)
                            plain = cpu_ms_each(before, cpu_seconds(stack, admin_url), opts.wakes)
                            await set_statement_stats(admin_url, True)
                            offset = log.stat().st_size
                            try:
                                await end_to_end(world, watcher, opts.wakes, c)
                            finally:
                                await set_statement_stats(admin_url, False)
                            with log.open("rb") as f:
                                f.seek(offset)
                                text = f.read().decode("utf-8", "replace")
                            level = Level(c, opts.wakes, plain, parse_statement_stats(text, names))
                            if not level.statements:
                                raise common.BenchError(
                                    f"no statement statistics in {log}: was log_statement_stats applied?"
                                )
                            levels.append(level)
                            print(f"  c={c}: {len(level.statements)} statements seen", file=sys.stderr)
        finally:
            await pool.close()
    return levels, names


def report_statements(levels: list[Level]) -> common.Figures:
    figures: common.Figures = {}
    for level in levels:
        n = level.wakes
        ours = {k: v for k, v in level.statements.items() if k not in (BENCH_POLLING, BENCH_CONTROL)}
        total_ms = sum(v.cpu_s for v in ours.values()) * 1000 / n
        calls = sum(v.calls for v in ours.values()) / n
        postgres = level.cpu_ms_per_wake["postgres"]
        everything = sum(level.cpu_ms_per_wake.values())
        print(
            f"\nCPU per wake at {level.concurrency} poster(s), plain run: "
            + ", ".join(f"{k} {v:.2f} ms" for k, v in level.cpu_ms_per_wake.items())
            + f"; all {everything:.2f} ms (PostgreSQL/all = {postgres / everything:.2f})."
            f"\nStatements' own CPU (log_statement_stats run): {total_ms:.2f} ms in {calls:.1f} statements per wake "
            f"(statements/PostgreSQL = {total_ms / postgres:.2f}, statements/all = {total_ms / everything:.2f})\n"
        )
        rows = sorted(ours.items(), key=lambda kv: -kv[1].cpu_s)
        common.print_table(
            ["statement", "calls per wake", "CPU us per call", "CPU us per wake", "share of statements"],
            [
                [
                    name,
                    round(cost.calls / n, 2),
                    cost.cpu_s * 1e6 / cost.calls if cost.calls else float("nan"),
                    cost.cpu_s * 1e6 / n,
                    f"{100 * cost.cpu_s * 1000 / n / total_ms:.1f}%" if total_ms else "-",
                ]
                for name, cost in rows
                if cost.cpu_s * 1e6 / n >= 1.0 or cost.calls / n >= 0.05
            ],
        )
        by_service: dict[str, float] = defaultdict(float)
        for name, cost in ours.items():
            by_service[service_of(name)] += cost.cpu_s * 1000 / n
        print("\nby caller: " + ", ".join(f"{s} {ms:.2f} ms" for s, ms in sorted(by_service.items())))
        polling = level.statements.get(BENCH_POLLING, StatementCost())
        print(
            f"left out: the bench's reply polling, {polling.calls / n:.1f} statements and "
            f"{polling.cpu_s * 1000 / n:.2f} ms per wake (in the plain run's PostgreSQL figure too)"
        )
        c = level.concurrency
        figures[f"statements c={c} CPU ms per wake"] = total_ms
        figures[f"statements c={c} per wake"] = calls
        for name, ms in level.cpu_ms_per_wake.items():
            figures[f"{name} c={c} CPU ms per wake"] = ms
        for wanted in ("BEGIN", "COMMIT"):
            cost = ours.get(wanted, StatementCost())
            figures[f"{wanted} c={c} CPU ms per wake"] = cost.cpu_s * 1000 / n
    return figures


# -- part 2: five round trips against one ------------------------------------------------------------------

# The prototype: post_check's checks, the message with its seq and the event with its cursor (the room row
# bumped once for both), in one statement. $1 room, $2 author company, $3 message id, $4 person, $5 body,
# $6 the event's serialized RoomEvent, $7 the dedupe key (NULL: none). No row when the room is unknown or
# the company is not a member.
FUSED_POST = """
WITH author_member AS (
    SELECT company_id FROM room_members WHERE room_id = $1 AND company_id = $2::uuid FOR SHARE
), earlier AS (
    SELECT m.message_id FROM messages AS m WHERE m.room_id = $1 AND m.dedupe_key = $7::text
), next AS (
    UPDATE rooms SET last_seq = last_seq + 1, last_event_seq = last_event_seq + 1
    WHERE room_id = $1 AND EXISTS (SELECT 1 FROM author_member) AND NOT EXISTS (SELECT 1 FROM earlier)
    RETURNING last_seq, last_event_seq
), message AS (
    INSERT INTO messages (message_id, room_id, seq, author_kind, author_company_id, author_person,
        author_agent_id, body, mention_agent_ids, run_id, dedupe_key)
    SELECT $3, $1, next.last_seq, 'person', $2::uuid, $4, NULL, $5, '{}'::uuid[], NULL, NULL FROM next
    RETURNING message_id, room_id, seq, author_kind, author_company_id, author_person, author_agent_id, body,
        mention_agent_ids, run_id, created_at
), event AS (
    INSERT INTO room_events (room_id, seq, kind, detail, audience_company_id)
    SELECT $1, next.last_event_seq, 'message_posted', $6, NULL FROM next, message
    RETURNING seq
)
SELECT message.*, (SELECT seq FROM event) AS event_seq FROM message
"""


def _event_detail(room_id: str, company_id: str, message_id: str, body: str, seq: int = 0) -> bytes:
    message = common_pb2.Message(message_id=message_id, room_id=room_id, seq=seq, body=body)
    message.author.company_id = company_id
    message.author.person = "bench"
    return common_pb2.RoomEvent(kind=common_pb2.ROOM_EVENT_KIND_MESSAGE_POSTED, message=message).SerializeToString()


async def post_five(conn: asyncpg.Connection, q: Queries, room_id: str, company_id: str, i: int) -> None:
    """What RoomStore._post_message sends for a person's post with no mention and no dedupe key."""
    message_id = uuid.uuid4()
    body = f"round trip note {i}"
    async with conn.transaction():
        check = await conn.fetchrow(q["post_check"], room_id, company_id, None, [], None)
        if not (check["room_found"] and check["member"]):
            raise common.BenchError("the bench's company is not a member of its room")
        row = await conn.fetchrow(
            q["insert_message_with_wakes"],
            room_id, message_id, "person", company_id, "bench", None, body, [], None, None, [], str(message_id), "",
            None,
        )  # fmt: skip
        detail = _event_detail(room_id, company_id, str(message_id), body, row["seq"])
        await conn.execute(q["append_room_events"], room_id, ["message_posted"], [detail], [None])


async def post_one(conn: asyncpg.Connection, room_id: str, company_id: str, i: int) -> None:
    message_id = str(uuid.uuid4())
    body = f"round trip note {i}"
    detail = _event_detail(room_id, company_id, message_id, body)
    row = await conn.fetchrow(FUSED_POST, room_id, company_id, message_id, "bench", body, detail, None)
    if row is None:
        raise common.BenchError("the fused post wrote nothing: the bench's company is not a member of its room")


async def _poster(
    pool: asyncpg.Pool, post: Callable[[asyncpg.Connection, int], Awaitable[None]], jobs: Iterator[int]
) -> None:
    """One closed-loop poster on its own connection, taking jobs until the shared iterator is done."""
    async with pool.acquire() as conn:
        for i in jobs:
            await post(conn, i)


@dataclass
class RoundTrips:
    variant: str
    concurrency: int
    cpu_ms: list[float] = field(default_factory=list)  # per post: this process + PostgreSQL, one per round
    wall_ms: list[float] = field(default_factory=list)  # per post, one per round


async def round_trips(opts: argparse.Namespace, admin_url: str, url: str) -> list[RoundTrips]:
    q = Queries(ROOT / "services" / "room" / "sql" / "queries.sql")
    conn = await asyncpg.connect(url)
    try:
        place = await conn.fetchrow("SELECT room_id::text, company_id::text FROM room_members LIMIT 1")
    finally:
        await conn.close()
    if place is None:
        raise common.BenchError("no room with a member: part 1 made none")
    room_id, company_id = place["room_id"], place["company_id"]
    variants: dict[str, Callable[[asyncpg.Connection, int], Awaitable[None]]] = {
        "5 round trips (as the Room)": lambda conn, i: post_five(conn, q, room_id, company_id, i),
        "1 statement (prototype)": lambda conn, i: post_one(conn, room_id, company_id, i),
    }
    results: list[RoundTrips] = []
    for c in common.parse_concurrency(opts.concurrency):
        pool = await create_pool(url, min_size=c, max_size=c)
        try:
            measured = {name: RoundTrips(name, c) for name in variants}
            for round_no in range(opts.rounds + 1):  # round 0 warms both up and is not counted
                order = list(variants.items())
                if round_no % 2:
                    order.reverse()
                for name, post in order:
                    jobs = iter(range(opts.posts))
                    cpu0, t0 = time.process_time(), time.perf_counter()
                    pg0 = common.postgres_cpu_seconds(admin_url) or 0.0
                    await asyncio.gather(*(_poster(pool, post, jobs) for _ in range(c)))
                    wall = time.perf_counter() - t0
                    cpu = time.process_time() - cpu0 + (common.postgres_cpu_seconds(admin_url) or 0.0) - pg0
                    if round_no:
                        measured[name].cpu_ms.append(cpu * 1000 / opts.posts)
                        measured[name].wall_ms.append(wall * 1000 / opts.posts)
            results += measured.values()
        finally:
            await pool.close()
        print(f"  round trips c={c} done", file=sys.stderr)
    return results


def report_round_trips(results: list[RoundTrips]) -> common.Figures:
    print(
        "\nA person's post (no mention): the Room's five round trips against the same work in one statement, "
        "alternating rounds;\nper post, median of the rounds (min-max); CPU = this client process + PostgreSQL\n"
    )
    rows = []
    figures: common.Figures = {}
    by_c: dict[int, dict[str, RoundTrips]] = defaultdict(dict)
    for r in results:
        by_c[r.concurrency][r.variant] = r
        rows.append(
            [
                r.variant,
                r.concurrency,
                f"{median(r.cpu_ms):.3f} ({min(r.cpu_ms):.3f}-{max(r.cpu_ms):.3f})",
                f"{median(r.wall_ms):.3f} ({min(r.wall_ms):.3f}-{max(r.wall_ms):.3f})",
            ]
        )
    common.print_table(["variant", "posters", "CPU ms per post", "wall ms per post"], rows)
    print()
    for c, pair in sorted(by_c.items()):
        five, one = pair["5 round trips (as the Room)"], pair["1 statement (prototype)"]
        ratios = [o / f for o, f in zip(one.cpu_ms, five.cpu_ms, strict=True)]
        walls = [o / f for o, f in zip(one.wall_ms, five.wall_ms, strict=True)]
        cpu_text = f"{median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        wall_text = f"{median(walls):.2f} ({min(walls):.2f}-{max(walls):.2f})"
        print(f"one/five at {c} poster(s): CPU {cpu_text}, wall {wall_text}, round by round")
        figures[f"post one/five c={c} CPU"] = median(ratios)
        figures[f"post one/five c={c} wall"] = median(walls)
        figures[f"post five c={c} CPU ms"] = median(five.cpu_ms)
        figures[f"post one c={c} CPU ms"] = median(one.cpu_ms)
    return figures


async def amain(opts: argparse.Namespace) -> common.Figures:
    started = time.monotonic()
    with common.postgres_server() as admin_url:
        url = await common.create_migrated_database(admin_url)
        try:
            levels, _ = await per_statement(opts, admin_url, url)
            figures = report_statements(levels)
            if opts.rounds > 0:
                figures |= report_round_trips(await round_trips(opts, admin_url, url))
        finally:
            await common.drop_database(admin_url, url)
    print(f"bench took {time.monotonic() - started:.0f} s")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--wakes", type=int, default=200, help="measured wakes per level and run (default 200)")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured wakes before each level (default 10)")
    parser.add_argument("--concurrency", default="1,32", help="comma-separated numbers of posters (default 1,32)")
    parser.add_argument("--posts", type=int, default=2000, help="posts per variant and round in part 2 (default 2000)")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds of part 2, 0 to skip it (default 4)")
    common.add_json_argument(parser)
    opts = parser.parse_args()
    for name in ("wakes", "posts"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if opts.rounds < 0:
        parser.error("--rounds must be 0 or more")
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())  # the client side as the services run it
    return common.run_main(amain, opts)


if __name__ == "__main__":
    sys.exit(main())
