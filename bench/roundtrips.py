"""Round trips in sequence on one wake's path: p50 post→reply with a delay on every internal hop, and
the round trips each wake makes, counted on the wire, per upstream.

``python bench/roundtrips.py [--wakes 20] [--warmup 5] [--delays 0,2,4] [--idle 2] [--json PATH]``

All four services run as processes on one PostgreSQL (``DATABASE_URL``'s server or an embedded one),
the stand-in model answering at once. Between them sits a delay proxy in this process (its own thread
and event loop, loopback only): one in front of PostgreSQL and one in front of each internal service
(Room, Claims, Runtime), the services pointed at them by their ordinary addresses
(``QUAYUTEC_<SVC>_ADDR``, ``DATABASE_URL``); the client's own calls to the Gateway go direct. Each
proxy forwards bytes both ways, each chunk ``d`` ms after it arrived (one way, order kept), and counts
per connection the *request bursts*: a chunk from the client after the server last spoke. A request and
its answer are one round trip, so request bursts are round trips (as the test bed's wire counts them,
``tests/cluster/wire.py``; HTTP/2 pings and window updates that cross on their own count too).

Wakes go one at a time: post a message mentioning the agent through the Gateway, wait for the agent's
reply on a WatchRoom stream. Per delay step: the idle rate of request bursts first (``--idle`` s,
nothing posted: the delivery poll, heartbeats), then the wakes; round trips per wake = (busy bursts -
idle rate x busy time) / wakes. The round trips *in sequence* on the path are the slope of p50 over the
round-trip time: p50 grows by one round-trip time (2·d) per round trip the wake waits on, whatever
the upstream; the least-squares slope over the steps is the figure, and each step's own
(p50(d) - p50(0)) / 2d is shown beside it.

The Gateway's watch coalescing is off by default here (``--watch-coalesce-ms 0``): with it on, a room
read less than a second before is read ``COALESCE_MS`` after its notification, and with wakes one at a
time the reply then waits on the post's delayed read (p50 about 100 ms at d = 0, whatever the path),
which hides the round trips at small delays.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from bench.common import (
    BenchError,
    Figures,
    add_json_argument,
    base_env,
    create_migrated_database,
    drop_database,
    percentile,
    postgres_server,
    print_table,
    queue_standin_replies,
    room_callers,
    run_main,
    running_stack,
    scratch_dir,
    standin_process,
    wait_for_room,
)
from bench.wakes import make_gateway_world
from quayutec.db import create_pool
from quayutec.tls import GATEWAY
from quayutec.v1 import common_pb2, gateway_pb2

UPSTREAMS = ("PostgreSQL", "Room", "Claims", "Runtime")
PROXIED_SERVICES = {"room": "Room", "claims": "Claims", "runtime": "Runtime"}
REPLY_LIMIT_SECONDS = 30.0
ROOM_WAIT_SECONDS = 600.0
CHUNK = 65536


@dataclass
class Bursts:
    """What crossed one upstream's proxy since the last reset: request bursts (client spoke after the
    server, or first) and answer bursts (the other way round)."""

    requests: int = 0
    answers: int = 0


class _Direction:
    """One direction of one proxied connection: chunks written in order, each ``delay`` s after it was read."""

    def __init__(self, loop: asyncio.AbstractEventLoop, writer: asyncio.StreamWriter) -> None:
        self._loop = loop
        self._writer = writer
        self._queue: deque[tuple[float, bytes]] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def send(self, data: bytes, delay: float) -> None:
        """Write ``data`` after ``delay`` s; ``b""``: close after what is queued (the other side's EOF)."""
        if delay <= 0 and not self._queue:
            self._write(data)
            return
        self._queue.append((self._loop.time() + delay, data))
        if self._timer is None:
            self._timer = self._loop.call_at(self._queue[0][0], self._flush)

    def _flush(self) -> None:
        self._timer = None
        now = self._loop.time()
        while self._queue and self._queue[0][0] <= now:
            self._write(self._queue.popleft()[1])
        if self._queue:
            self._timer = self._loop.call_at(self._queue[0][0], self._flush)

    def _write(self, data: bytes) -> None:
        if data:
            self._writer.write(data)
        else:
            self._writer.close()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._writer.close()


class DelayProxies:
    """TCP proxies on loopback in a thread of their own: ``open(name, host, port)`` (or a Unix socket
    path as ``host``) returns the address that reaches that upstream through a new proxy. One delay
    for all (``set_delay``); bursts counted per name (``take_counts``)."""

    def __init__(self) -> None:
        self.delay_seconds = 0.0
        self._counts: dict[str, Bursts] = {}
        self._servers: list[asyncio.Server] = []
        self._conns: set[asyncio.Task[None]] = set()
        self._next_conn = 0
        # When set (``--timeline``): every chunk as (monotonic s, upstream, connection, side, size, first bytes).
        self.timeline: list[tuple[float, str, int, str, int, bytes]] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxies", daemon=True)
        self._thread.start()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def open(self, name: str, host: str, port: int) -> str:
        return str(self._call(self._open(name, host, port)))

    def set_delay(self, ms: float) -> None:
        self.delay_seconds = ms / 1000.0

    def take_counts(self) -> dict[str, Bursts]:
        """The bursts per upstream since the last call, and a fresh count from now on."""
        return dict(self._call(self._take()))

    def close(self) -> None:
        try:
            self._call(self._close())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    async def _take(self) -> dict[str, Bursts]:
        taken = self._counts
        self._counts = {name: Bursts() for name in taken}
        return taken

    async def _open(self, name: str, host: str, port: int) -> str:
        self._counts.setdefault(name, Bursts())

        async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            if host.startswith("/"):
                return await asyncio.open_unix_connection(host)
            return await asyncio.open_connection(host, port)

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._conns.add(task)
            try:
                await self._pipe(name, reader, writer, await connect())
            except OSError:
                writer.close()
            finally:
                self._conns.discard(task)

        server = await asyncio.start_server(on_client, "127.0.0.1", 0)
        self._servers.append(server)
        return f"127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def _pipe(
        self,
        name: str,
        client_reader: asyncio.StreamReader,
        client_writer: asyncio.StreamWriter,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        loop = asyncio.get_running_loop()
        self._next_conn += 1
        conn = self._next_conn
        server_reader, server_writer = upstream
        to_server = _Direction(loop, server_writer)
        to_client = _Direction(loop, client_writer)
        last: list[str] = [""]  # who sent data last on this connection: "client" or "server"

        async def pump(reader: asyncio.StreamReader, out: _Direction, side: str) -> None:
            while data := await reader.read(CHUNK):
                if last[0] != side:
                    last[0] = side
                    bursts = self._counts[name]
                    if side == "client":
                        bursts.requests += 1
                    else:
                        bursts.answers += 1
                if self.timeline is not None:
                    self.timeline.append((time.monotonic(), name, conn, side, len(data), data[:12]))
                out.send(data, self.delay_seconds)
            out.send(b"", self.delay_seconds)

        try:
            await asyncio.gather(
                pump(client_reader, to_server, "client"),
                pump(server_reader, to_client, "server"),
                return_exceptions=True,
            )
        finally:
            to_server.close()
            to_client.close()

    async def _close(self) -> None:
        for server in self._servers:
            server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)


def proxied_database_url(url: str, proxies: DelayProxies) -> str:
    """``url`` reached through a new proxy named PostgreSQL (its one host: TCP or a Unix socket folder)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    socket_dir = query.pop("host", "")
    port = parts.port or int(query.pop("port", "5432"))
    if socket_dir.startswith("/"):
        addr = proxies.open("PostgreSQL", f"{socket_dir}/.s.PGSQL.{port}", 0)
    elif parts.hostname and "," not in parts.netloc:
        addr = proxies.open("PostgreSQL", parts.hostname, port)
    else:
        raise BenchError(f"the bench proxies one PostgreSQL host, by TCP or a Unix socket; got {url!r}")
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@{addr}" if userinfo else addr
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query), parts.fragment))


@dataclass
class Step:
    delay_ms: float
    latencies_ms: list[float] = field(default_factory=list)
    round_trips: dict[str, float] = field(default_factory=dict)  # per wake, by upstream

    @property
    def p50(self) -> float:
        return percentile(self.latencies_ms, 50)


class Replies:
    """The agent's messages arriving on one WatchRoom stream, as this client sees them (monotonic times)."""

    def __init__(self, client: Any, room_id: str) -> None:
        self.queue: asyncio.Queue[float] = asyncio.Queue()
        self._call = client.WatchRoom(gateway_pb2.WatchRoomRequest(room_id=room_id))
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for item in self._call:
            for event in item.events:
                if event.HasField("message") and event.message.author.kind == common_pb2.AUTHOR_KIND_AGENT:
                    self.queue.put_nowait(time.monotonic())

    def close(self) -> None:
        self._call.cancel()
        self._task.cancel()


async def one_wake(world: Any, replies: Replies, i: int) -> float:
    """Post message ``i`` mentioning the agent, wait for its reply; the ms between, as the client sees them."""
    posted_at = time.monotonic()
    posted = await world.client.PostMessage(
        gateway_pb2.PostMessageRequest(
            room_id=world.room_id, person="bench", body=f"@bench-agent item {i}?", mention_agent_ids=[world.agent_id]
        ),
        timeout=REPLY_LIMIT_SECONDS,
    )
    if len(posted.wake_ids) != 1:
        raise BenchError(f"a post mentioning one agent answered {len(posted.wake_ids)} wakes")
    try:
        replied_at = await asyncio.wait_for(replies.queue.get(), timeout=REPLY_LIMIT_SECONDS)
    except TimeoutError as exc:
        raise BenchError(f"no reply on the watch stream within {REPLY_LIMIT_SECONDS:g} s") from exc
    return (replied_at - posted_at) * 1000


async def measure(
    proxies: DelayProxies, world: Any, replies: Replies, delay_ms: float, opts: argparse.Namespace, start: int
) -> Step:
    proxies.set_delay(delay_ms)
    for i in range(opts.warmup):  # the new delay on every connection, and no wake of the last step in flight
        await one_wake(world, replies, start + i)
    proxies.take_counts()
    idle_started = time.monotonic()
    await asyncio.sleep(opts.idle)
    idle = proxies.take_counts()
    idle_seconds = time.monotonic() - idle_started
    step = Step(delay_ms)
    busy_started = time.monotonic()
    for i in range(opts.wakes):
        step.latencies_ms.append(await one_wake(world, replies, start + opts.warmup + i))
    busy = proxies.take_counts()
    scale = (time.monotonic() - busy_started) / idle_seconds
    for name in UPSTREAMS:
        extra = busy[name].requests - idle[name].requests * scale
        step.round_trips[name] = max(0.0, extra / opts.wakes)
    print(f"  {delay_ms:g} ms one way: p50 {step.p50:.1f} ms", file=sys.stderr)
    return step


async def print_timeline(proxies: DelayProxies, world: Any, replies: Replies, i: int) -> None:
    """One more wake at the last delay, every chunk on the wire printed by time since the post (to stderr)."""
    proxies.timeline = []
    posted_at = time.monotonic()
    took = await one_wake(world, replies, i)
    await asyncio.sleep(0.2)  # what the wake still does after the reply (the settle, the ledger's end)
    timeline, proxies.timeline = proxies.timeline, None
    print(
        f"\none wake's chunks (reply after {took:.1f} ms); ms since the post, upstream, connection, side:",
        file=sys.stderr,
    )
    for at, name, conn, side, size, head in timeline:
        print(f"  {(at - posted_at) * 1000:8.1f}  {name:<10} #{conn:<3} {side:<6} {size:6d} {head!r}", file=sys.stderr)


def slope(steps: Sequence[Step]) -> float:
    """Least-squares slope of p50 (ms) over the round-trip time 2·d (ms): round trips in sequence."""
    xs = [2 * s.delay_ms for s in steps]
    ys = [s.p50 for s in steps]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


async def amain(opts: argparse.Namespace) -> Figures:
    delays = [float(d) for d in opts.delays.split(",") if d.strip()]
    if len(delays) < 2 or delays[0] != 0 or min(delays) < 0:
        raise BenchError("--delays needs 0 first and at least one positive delay, e.g. 0,2,4")
    started = time.monotonic()
    proxies = DelayProxies()
    steps: list[Step] = []
    try:
        with (
            scratch_dir("qy-bench-rt-") as data_dir,
            standin_process() as standin_url,
            postgres_server() as admin_url,
        ):
            url = await create_migrated_database(admin_url)
            env = base_env(standin_url, data_dir)
            env.update({"QUAYUTEC_GATEWAY_POST_RATE": "1000000", "QUAYUTEC_GATEWAY_POST_BURST": "1000000"})
            if opts.watch_coalesce_ms >= 0:
                env["QUAYUTEC_GATEWAY_WATCH_COALESCE_MS"] = str(opts.watch_coalesce_ms)
            pool = await create_pool(url, min_size=1, max_size=2)
            try:
                names = ("claims", "room", "runtime", "gateway")

                def dial(name: str, port: int) -> str:
                    if name in PROXIED_SERVICES:
                        return proxies.open(PROXIED_SERVICES[name], "127.0.0.1", port)
                    return f"127.0.0.1:{port}"

                proxied_url = proxied_database_url(url, proxies)
                if opts.actions:  # every reply declares one action: the run records its decision before the reply
                    remember = {
                        "name": "remember",
                        "arguments": {"text": "the launch moves to Friday", "private": False},
                    }
                    total = (len(delays) * (opts.warmup + opts.wakes) + 1) * 2
                    queue_standin_replies(standin_url, "Noted.", [remember], model="bench-model", times=total)
                async with running_stack(proxied_url, names, env, data_dir / "logs", dial=dial) as stack:
                    await wait_for_room(stack, ROOM_WAIT_SECONDS)
                    async with room_callers(stack) as room, stack.channel("gateway", GATEWAY) as channel:
                        world = await make_gateway_world(room, pool, channel, uuid.uuid4().hex[:6])
                        replies = Replies(world.client, world.room_id)
                        try:
                            await asyncio.sleep(0.5)  # the stream is open before the first post
                            per_step = opts.warmup + opts.wakes
                            for n, delay in enumerate(delays):
                                steps.append(await measure(proxies, world, replies, delay, opts, n * per_step))
                            if opts.timeline:
                                await print_timeline(proxies, world, replies, len(delays) * per_step)
                        finally:
                            replies.close()
            finally:
                await pool.close()
                await drop_database(admin_url, url)
    finally:
        proxies.close()
    return report(steps, time.monotonic() - started)


def report(steps: Sequence[Step], seconds: float) -> Figures:
    base = steps[0]
    print(
        "\nOne wake at a time, post -> reply on a WatchRoom stream; every hop to PostgreSQL, Room, Claims and"
        "\nRuntime through a delay proxy (d ms each way). Round trips per wake counted on the wire (request"
        "\nbursts, idle rate subtracted); in sequence: p50's growth per ms of round-trip time (2d).\n"
    )
    print_table(
        ["d ms one way", "wakes", "p50 ms", "p90 ms", *UPSTREAMS, "total", "in sequence"],
        [
            [
                s.delay_ms,
                len(s.latencies_ms),
                s.p50,
                percentile(s.latencies_ms, 90),
                *(s.round_trips[n] for n in UPSTREAMS),
                sum(s.round_trips.values()),
                (s.p50 - base.p50) / (2 * s.delay_ms) if s.delay_ms else float("nan"),
            ]
            for s in steps
        ],
    )
    in_sequence = slope(steps)
    print(f"\nround trips in sequence per wake (slope of p50 over 2d): {in_sequence:.1f}")
    print(f"bench took {seconds:.0f} s")
    figures: Figures = {"round trips in sequence per wake": in_sequence}
    for name in UPSTREAMS:
        figures[f"round trips per wake {name}"] = statistics.fmean(s.round_trips[name] for s in steps)
    figures["round trips per wake total"] = sum(figures[f"round trips per wake {n}"] for n in UPSTREAMS)
    for s in steps:
        figures[f"wake d={s.delay_ms:g} p50 ms"] = s.p50
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--wakes", type=int, default=20, help="measured wakes per delay step (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured wakes before each step (default 3)")
    parser.add_argument("--delays", default="0,2,4", help="one-way delays in ms, 0 first (default 0,2,4)")
    parser.add_argument("--idle", type=float, default=2.0, help="seconds of idle counting per step (default 2)")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="then one more wake, each chunk on the wire by time (stderr)",
    )
    parser.add_argument(
        "--actions",
        action="store_true",
        help="every reply declares one action (remember): the run records ACTIONS_DECIDED before its reply",
    )
    parser.add_argument(
        "--watch-coalesce-ms",
        type=float,
        default=0.0,
        help="the Gateway's QUAYUTEC_GATEWAY_WATCH_COALESCE_MS (default 0: a reply is read at once, so p50 follows"
        " the path; -1: the Gateway's own default)",
    )
    add_json_argument(parser)
    return run_main(amain, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
