"""What a fault test does on the bed: a company, a room and an agent; wakes posted through either
host's Gateway; the stand-in scripted on both hosts; and the outcome of every wake counted from the
database itself (Claims' table, the Room's ledger and the messages posted)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import grpc

from quayutec.channels import channel_as
from quayutec.config import ROOM
from quayutec.db import create_pool
from quayutec.tls import ADMIN
from quayutec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, room_pb2, room_pb2_grpc
from services.gateway.auth import create_api_key
from services.runtime.standin import asked
from tests.cluster.bed import SERVICE_HOSTS, Bed
from tests.harness.gateway import authed_gateway

RPC_SECONDS = 3.0
# A wake whose claim has no ledger row this long after the claim will never get one from its run:
# the run's active time (the bed's RUN_SECONDS) and its Room retries are over.
CLAIM_WITHOUT_ROW_FINAL_SECONDS = 30.0


@dataclass
class World:
    """One test's company, room and agent on the bed, with a Gateway stub per service host."""

    bed: Bed
    company_id: str
    room_id: str
    agent_id: str
    model: str
    gateways: dict[str, gateway_pb2_grpc.GatewayServiceStub]
    tag: str
    secret: str  # the company's API key (streams carry it themselves: the stubs' interceptor is unary only)
    posted: list[str] = field(default_factory=list)  # wake ids, in posting order
    bodies: dict[str, str] = field(default_factory=dict)  # wake id -> the message body that woke it
    acknowledged: set[str] = field(default_factory=set)  # message ids of every post a Gateway answered
    unavailable: int = 0  # UNAVAILABLE or DEADLINE_EXCEEDED answers to posts (each retried)

    def script_standins(self, *, times: int, delay_seconds: float, remember: bool = True) -> None:
        """Each host's stand-in answers this agent's next ``times`` requests after ``delay_seconds``,
        with a reply and (``remember``) one memory line: two writes each run must do once."""
        calls = [{"name": "remember", "arguments": {"text": "noted once", "private": False}}] if remember else []
        for host in SERVICE_HOSTS:
            standin_post(
                self.bed.standin_url(host),
                "/_standin/replies",
                {
                    "model": self.model,
                    "text": "Noted.",
                    "tool_calls": calls,
                    "delay_seconds": delay_seconds,
                    "times": times,
                },
            )

    async def post_message(
        self,
        body: str,
        *,
        key: str,
        mention: Sequence[str] = (),
        via: Sequence[str] = SERVICE_HOSTS,
        limit: float = 60.0,
    ) -> gateway_pb2.PostMessageResponse:
        """Post as a client does: one idempotency key, tried on each Gateway of ``via`` in turn until
        one answers (the message is posted once, whichever answered and however often it was sent)."""
        request = gateway_pb2.PostMessageRequest(
            room_id=self.room_id, person="Ada", body=body, mention_agent_ids=list(mention), idempotency_key=key
        )
        deadline = time.monotonic() + limit
        attempt = 0
        while True:
            host = via[attempt % len(via)]
            attempt += 1
            try:
                posted: gateway_pb2.PostMessageResponse = await self.gateways[host].PostMessage(
                    request, timeout=RPC_SECONDS
                )
                self.acknowledged.add(posted.message.message_id)
                return posted
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                self.unavailable += 1
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def post(self, i: int, *, via: Sequence[str] = SERVICE_HOSTS) -> str:
        """Post message ``i`` mentioning the agent; its wake id."""
        body = f"{self.tag} note {i}"
        posted = await self.post_message(body, key=f"{self.tag}-{i}", mention=[self.agent_id], via=via)
        wake_id = str(posted.wake_ids[0])
        if wake_id not in self.bodies:
            self.posted.append(wake_id)
            self.bodies[wake_id] = body
        return wake_id

    async def post_many(self, start: int, count: int, *, via: Sequence[str] = SERVICE_HOSTS) -> list[str]:
        return list(await asyncio.gather(*(self.post(i, via=via) for i in range(start, start + count))))

    def model_requests_by_host(self) -> dict[str, dict[str, int]]:
        """Requests each host's stand-in got for this agent, per waking message body (a stand-in that
        is down, killed with its host, answers nothing: its records went with it)."""
        found: dict[str, dict[str, int]] = {}
        for host in SERVICE_HOSTS:
            try:
                records = standin_get(self.bed.standin_url(host), f"/_standin/requests?model={self.model}")["requests"]
            except OSError:
                continue
            counts = found.setdefault(host, {})
            for record in records:
                if isinstance(record.get("body"), dict):
                    body = asked(record["body"])
                    counts[body] = counts.get(body, 0) + 1
        return found

    def model_requests(self) -> dict[str, int]:
        """Requests for this agent over every host's stand-in, per waking message body."""
        return merge_counts(*self.model_requests_by_host().values())


def merge_counts(*counts: dict[str, int]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for one in counts:
        for key, n in one.items():
            merged[key] = merged.get(key, 0) + n
    return merged


def standin_post(base_url: str, path: str, data: dict[str, Any]) -> None:
    request = urllib.request.Request(
        base_url + path, data=json.dumps(data).encode(), headers={"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        answer.read()


def standin_get(base_url: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(base_url + path, timeout=5) as answer:
        got: dict[str, Any] = json.loads(answer.read())
        return got


@asynccontextmanager
async def world_on(bed: Bed, name: str) -> AsyncIterator[World]:
    """A fresh company (with an API key), room and agent (its own model name, so scripted replies are
    its own) on the bed; Gateway stubs to both service hosts."""
    tag = f"{name}-{uuid.uuid4().hex[:6]}"
    async with channel_as(bed.spread_addr(ROOM), identity=ADMIN, server=ROOM.name, mtls=bed.client_mtls()) as ch:
        company = await room_pb2_grpc.RoomServiceStub(ch).CreateCompany(
            room_pb2.RoomServiceCreateCompanyRequest(name=f"company {tag}"), timeout=10
        )
    company_id = company.company.company_id
    pool = await create_pool(bed.counting_url, min_size=1, max_size=1)
    try:
        _, secret = await create_api_key(pool, company_id, f"bed {tag}")
    finally:
        await pool.close()
    async with AsyncExitStack() as stack:
        gateways = {
            host: await stack.enter_async_context(authed_gateway(bed.gateway_addr(host), secret))
            for host in SERVICE_HOSTS
        }
        first = gateways[SERVICE_HOSTS[0]]
        room = await first.CreateRoom(gateway_pb2.CreateRoomRequest(name=tag), timeout=10)
        model = f"bed-{tag}"
        agent = await first.RegisterAgent(
            gateway_pb2.RegisterAgentRequest(
                name="planner", provider=common_pb2.PROVIDER_ANTHROPIC, model=model, provider_key="sk-bed"
            ),
            timeout=10,
        )
        yield World(
            bed=bed,
            company_id=company_id,
            room_id=room.room.room_id,
            agent_id=agent.agent.agent_id,
            model=model,
            gateways=gateways,
            tag=tag,
            secret=secret,
        )


@asynccontextmanager
async def agent_replies(world: World, host: str, limit: float = 10.0) -> AsyncIterator[asyncio.Queue[float]]:
    """A WatchRoom stream through ``host``'s Gateway, open (its first heartbeat received: it is live)
    before this returns: the queue gets the arrival time of each of the agent's messages."""
    queue: asyncio.Queue[float] = asyncio.Queue()
    live = asyncio.Event()
    call = world.gateways[host].WatchRoom(
        gateway_pb2.WatchRoomRequest(room_id=world.room_id),
        metadata=(("authorization", f"Bearer {world.secret}"),),
    )

    async def read() -> None:
        async for item in call:
            live.set()
            for event in item.events:
                if event.HasField("message") and event.message.author.kind == common_pb2.AUTHOR_KIND_AGENT:
                    queue.put_nowait(time.monotonic())

    reader = asyncio.create_task(read())
    try:
        done, _ = await asyncio.wait(
            {reader, asyncio.ensure_future(live.wait())}, timeout=limit, return_when=asyncio.FIRST_COMPLETED
        )
        if reader in done:
            reader.result()  # raises what ended the stream
        if not live.is_set():
            raise TimeoutError(f"the WatchRoom stream through host {host} sent nothing in {limit} s")
        yield queue
    finally:
        call.cancel()
        reader.cancel()


@dataclass(frozen=True)
class Outcome:
    """Every wake of a test, by what became of it (counted from the database)."""

    wakes: int
    once: int  # the run succeeded with exactly one reply and one memory line
    twice: int  # a run with more than one reply or memory line, or a wake asked of the model twice
    not_done: dict[str, int]  # ended in the ledger without acting (or partly), by reason
    claims_without_row: int  # claimed, and no ledger row ever written
    never_claimed: int  # no claim at all
    open_runs: int  # a ledger row not ended yet
    last_ended_at: float | None  # epoch seconds of the last run's end
    leases: int  # deliveries leased in all (more than the wakes: some were delivered again)
    posts_missing: int = 0  # posts a Gateway acknowledged that the database no longer has

    @property
    def lost(self) -> int:
        return self.claims_without_row + self.never_claimed

    @property
    def not_done_total(self) -> int:
        return sum(self.not_done.values())

    def line(self, name: str) -> str:
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(self.not_done.items())) or "none"
        return (
            f"{name}: wakes {self.wakes}: once {self.once}, twice {self.twice}, recorded not done "
            f"{self.not_done_total} ({reasons}), lost {self.lost} (claims without a ledger row "
            f"{self.claims_without_row}, never claimed {self.never_claimed}), runs still open {self.open_runs}, "
            f"acknowledged posts missing {self.posts_missing}; deliveries leased {self.leases}"
        )


async def count_outcome(world: World, model_requests: dict[str, int] | None = None) -> Outcome:
    conn = await asyncpg.connect(world.bed.counting_url)
    try:
        wakes = world.posted
        claims = {
            r["wake_id"]: r["claimed_at"]
            for r in await conn.fetch(
                "SELECT wake_id, claimed_at FROM agent_run_locks WHERE agent_id = $1 AND wake_id = ANY($2::text[])",
                world.agent_id,
                wakes,
            )
        }
        runs = {
            r["wake_id"]: r
            for r in await conn.fetch(
                "SELECT run_id, wake_id, status, error, actions, ended_at FROM runs "
                "WHERE agent_id = $1 AND wake_id = ANY($2::text[])",
                uuid.UUID(world.agent_id),
                wakes,
            )
        }
        run_ids = [r["run_id"] for r in runs.values()]
        replies = dict(
            await conn.fetch(
                "SELECT run_id, count(*) FROM messages WHERE run_id = ANY($1::text[]) AND author_kind = 'agent' "
                "GROUP BY run_id",
                run_ids,
            )
        )
        memory = dict(
            await conn.fetch(
                "SELECT run_id, count(*) FROM memory_lines WHERE run_id = ANY($1::text[]) GROUP BY run_id", run_ids
            )
        )
        leases = await conn.fetchval(
            "SELECT coalesce(sum(delivery_attempts), 0) FROM wake_outbox WHERE wake_id = ANY($1::uuid[])", wakes
        )
        acknowledged = sorted(world.acknowledged)
        present = await conn.fetchval("SELECT count(*) FROM messages WHERE message_id = ANY($1::uuid[])", acknowledged)
    finally:
        await conn.close()
    requested = model_requests or {}
    once = twice = without_row = never = still_open = 0
    not_done: dict[str, int] = {}
    ended: list[float] = []
    for wake in wakes:
        run = runs.get(wake)
        if run is None:
            if wake in claims:
                without_row += 1
            else:
                never += 1
            continue
        if run["ended_at"] is not None:
            ended.append(run["ended_at"].timestamp())
        n_replies, n_memory = replies.get(run["run_id"], 0), memory.get(run["run_id"], 0)
        if n_replies > 1 or n_memory > 1 or requested.get(world.bodies[wake], 0) > 1:
            twice += 1
        elif run["ended_at"] is None:
            still_open += 1
        elif run["status"] == "succeeded" and (n_replies, n_memory) == (1, 1):
            once += 1
        else:
            reason = _reason(run["status"], run["error"], n_replies, n_memory)
            not_done[reason] = not_done.get(reason, 0) + 1
    return Outcome(
        wakes=len(wakes),
        once=once,
        twice=twice,
        not_done=not_done,
        claims_without_row=without_row,
        never_claimed=never,
        open_runs=still_open,
        last_ended_at=max(ended) if ended else None,
        leases=int(leases),
        posts_missing=len(acknowledged) - int(present),
    )


def _reason(status: str, error: str, replies: int, memory: int) -> str:
    """A short reason for a run that did not act: its status and the first words of its error."""
    words = " ".join(error.split()[:3]).rstrip(":;,") if error else "no error recorded"
    done = "reply posted" if replies else "nothing posted"
    return f"{status} [{words}; {done}{', memory written' if memory else ''}]"


async def claims_final(world: World) -> bool:
    """True when every posted wake is in a final state: its run ended, or claimed without a row for
    longer than a run can live (that row will never come from its run), never unclaimed-and-pending."""
    conn = await asyncpg.connect(world.bed.counting_url)
    try:
        row = await conn.fetchrow(
            """
            SELECT
              count(*) FILTER (WHERE r.ended_at IS NOT NULL) AS ended,
              count(*) FILTER (WHERE r.run_id IS NULL AND l.wake_id IS NOT NULL
                               AND l.claimed_at < now() - make_interval(secs => $3)) AS stale_claims
            FROM unnest($2::text[]) AS w(wake_id)
            LEFT JOIN agent_run_locks l ON l.agent_id = $1 AND l.wake_id = w.wake_id
            LEFT JOIN runs r ON r.agent_id = $1::uuid AND r.wake_id = w.wake_id
            """,
            world.agent_id,
            world.posted,
            CLAIM_WITHOUT_ROW_FINAL_SECONDS,
        )
    finally:
        await conn.close()
    assert row is not None
    return int(row["ended"]) + int(row["stale_claims"]) == len(world.posted)


async def wait_until(check: Callable[[], Awaitable[bool]], *, limit: float, every: float = 0.25) -> float:
    """Poll ``check`` until it holds; the seconds it took (bounded: fails after ``limit``)."""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > limit:
            raise AssertionError(f"not reached within {limit:g} s")
        await asyncio.sleep(every)
    return time.monotonic() - started


async def wait_settled(world: World, *, limit: float) -> float:
    """Until every wake of ``world`` is final (see ``claims_final``); the seconds it took."""

    async def settled() -> bool:
        try:
            return await claims_final(world)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            return False

    return await wait_until(settled, limit=limit)
