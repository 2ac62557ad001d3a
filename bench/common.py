"""Shared pieces of the benches: a PostgreSQL server, scratch databases, the services as processes,
the stand-in model provider as a process, a world made through RoomService, a ledger watcher,
percentiles and a plain table, the figures every bench writes with ``--json PATH`` (read back by
``bench/compare.py``), and the cache outside the repository where benches keep what they install.

Every bench runs as a script from the checkout (``python bench/<name>.py``); nothing here is
imported by the services or by tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402
import grpc  # noqa: E402
import httpx  # noqa: E402
from cryptography.fernet import Fernet  # noqa: E402

from quayutec.config import ROOM, SERVICES  # noqa: E402
from quayutec.db import create_pool, embedded_ctl, embedded_pid, with_database  # noqa: E402

try:
    from quayutec.ledger import run_id_for
except ImportError:  # a baseline tree from before it moved there (bench/compare.py runs this bench on older trees)
    from services.runtime.run import run_id_for  # type: ignore[attr-defined]
from quayutec.migrate import migrate  # noqa: E402
from quayutec.tls import GATEWAY  # noqa: E402
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc, runtime_pb2  # noqa: E402
from services.stack import LocalStack, free_port  # noqa: E402

ENDED_STATUSES = ("succeeded", "failed", "timed_out")


class BenchError(RuntimeError):
    """A bench could not measure what it set out to; the message says why."""


# -- PostgreSQL ---------------------------------------------------------------------------------------


@contextmanager
def postgres_server() -> Iterator[str]:
    """The admin URL of ``DATABASE_URL``, or of an embedded PostgreSQL removed afterwards."""
    url = os.environ.get("DATABASE_URL", "").strip()
    if url:
        yield url
        return
    root = Path(tempfile.mkdtemp(prefix="qy-bench-", dir="/tmp"))
    root.chmod(0o755)  # as root, pgserver runs PostgreSQL as its own user
    url = ""
    try:
        url = embedded_ctl("start", root / "pg")
        _EMBEDDED_PGDATA[url] = root / "pg"
        yield url
    finally:
        _EMBEDDED_PGDATA.pop(url, None)
        try:
            embedded_ctl("stop", root / "pg")
        finally:
            shutil.rmtree(root, ignore_errors=True)


# The data folder of each embedded PostgreSQL a bench started, by its admin URL.
_EMBEDDED_PGDATA: dict[str, Path] = {}


def embedded_pgdata(admin_url: str) -> Path | None:
    """The data folder of the embedded PostgreSQL behind ``admin_url`` (its server log is ``log`` there);
    None for ``DATABASE_URL``'s server."""
    return _EMBEDDED_PGDATA.get(admin_url)


def postgres_cpu_seconds(admin_url: str) -> float | None:
    """User + system CPU seconds used so far by the embedded PostgreSQL behind ``admin_url`` (its
    postmaster, every live child and the children it has reaped); None for ``DATABASE_URL``'s server,
    whose processes may not be ours to see."""
    import psutil

    pgdata = _EMBEDDED_PGDATA.get(admin_url)
    pid = embedded_pid(pgdata) if pgdata is not None else None
    if pid is None:
        return None
    postmaster = psutil.Process(pid)
    times = postmaster.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in postmaster.children(recursive=True):
        try:
            child_times = child.cpu_times()
        except psutil.NoSuchProcess:  # ended meanwhile: counted in the reaped children's times
            continue
        total += child_times.user + child_times.system
    return float(total)


async def create_database(admin_url: str, prefix: str = "qy_bench") -> str:
    """A new empty database on the server of ``admin_url``; returns its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    return with_database(admin_url, name)


async def create_migrated_database(admin_url: str) -> str:
    """A new database with every component's schema applied."""
    url = await create_database(admin_url)
    pool = await create_pool(url, min_size=1, max_size=1)
    try:
        await migrate(pool)
    finally:
        await pool.close()
    return url


async def drop_database(admin_url: str, url: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {urlsplit(url).path.lstrip('/')} WITH (FORCE)")
    finally:
        await conn.close()


# -- processes ------------------------------------------------------------------------------------------


@contextmanager
def standin_process() -> Iterator[str]:
    """The stand-in model provider in its own process (answers at once); yields its base URL."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.runtime.standin", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise BenchError(f"the stand-in provider exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/_standin/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise BenchError("the stand-in provider did not answer its health check in 20 s")
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A tmp folder for service logs and keys; kept (and named) when profiling, else removed."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        if _profiled():
            print(f"service logs and profiles kept in {path / 'logs'}", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


def base_env(standin_url: str, data_dir: Path) -> dict[str, str]:
    """Settings every bench gives the services: the stand-in as provider, one shared encryption key."""
    return {
        "QUAYUTEC_DATA_DIR": str(data_dir),
        "QUAYUTEC_ENCRYPTION_KEY": Fernet.generate_key().decode(),
        "QUAYUTEC_RUNTIME_ANTHROPIC_BASE_URL": standin_url,
        "QUAYUTEC_RUNTIME_OPENAI_BASE_URL": standin_url,
        "QUAYUTEC_LOG_LEVEL": "WARNING",
    }


class ProfiledStack(LocalStack):
    """A LocalStack whose services named in ``QY_BENCH_PROFILE`` (e.g. ``runtime,room``) run under
    cProfile, writing ``<log_dir>/<name>.prof`` when they stop."""

    def start(self, name: str) -> None:
        if name not in _profiled():
            super().start(name)
            return
        self.release_ports(name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / f"{name}.log").open("ab")
        prof = self.log_dir / f"{name}.prof"
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", f"services.{name}"],
            cwd=ROOT,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        print(f"profiling {name} into {prof}", file=sys.stderr)


def _profiled() -> set[str]:
    return {n.strip() for n in os.environ.get("QY_BENCH_PROFILE", "").split(",") if n.strip()}


@asynccontextmanager
async def running_stack(
    database_url: str,
    names: Sequence[str],
    extra_env: Mapping[str, str],
    log_dir: Path,
    *,
    dial: Callable[[str, int], str] | None = None,
) -> AsyncIterator[LocalStack]:
    """The named services as child processes on ``database_url`` (already migrated). ``dial(name,
    port)``: the address the others (and this process) dial service ``name`` listening on ``port`` at,
    e.g. a proxy's; by default the port itself."""
    ports = {s.name: free_port() for s in SERVICES}
    addrs = {name: dial(name, port) for name, port in ports.items()} if dial is not None else {}
    stack = ProfiledStack(ports=ports, extra_env=dict(extra_env), addrs=addrs)
    stack.database_url = database_url
    stack.log_dir = log_dir
    specs = [s for s in SERVICES if s.name in names]
    try:
        await stack.start_services(names)
        yield stack
    except BaseException:
        for spec in specs:
            log = log_dir / f"{spec.name}.log"
            if log.exists():
                tail = log.read_text(errors="replace")[-2000:]
                print(f"--- {spec.name} log (tail) ---\n{tail}", file=sys.stderr)
        raise
    finally:
        stack.stop_all()


@asynccontextmanager
async def room_callers(stack: LocalStack) -> AsyncIterator[Any]:
    """RoomService of ``stack``, each RPC made as an identity allowed to (admin, Gateway or Runtime)."""
    room, channels = stack.callers(ROOM, room_pb2_grpc.RoomServiceStub)
    try:
        yield room
    finally:
        for channel in channels:
            await channel.close()


async def wait_for_room(stack: LocalStack, limit: float) -> None:
    """Poll until the Room service answers a smoke call (it may still be being finished)."""
    addr = stack.addr("room")
    deadline = time.monotonic() + limit
    async with stack.channel("room", GATEWAY) as channel:
        stub = room_pb2_grpc.RoomServiceStub(channel)
        while True:
            try:
                await stub.CountPendingWakes(room_pb2.RoomServiceCountPendingWakesRequest(), timeout=2)
                return
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > deadline:
                    raise BenchError(f"Room at {addr} does not answer: {exc.code().name}: {exc.details()}") from exc
            await asyncio.sleep(0.2)


# -- a world through RoomService --------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    company_id: str
    room_id: str
    agent_id: str


async def make_room_world(room: Any, tag: str, *, model: str = "bench-model") -> World:
    """A company, its room and one agent on the stand-in, made through RoomService directly."""
    company = (await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name=f"bench-{tag}"))).company
    made = await room.CreateRoom(room_pb2.RoomServiceCreateRoomRequest(company_id=company.company_id, name=tag))
    agent = (
        await room.RegisterAgent(
            room_pb2.RoomServiceRegisterAgentRequest(
                company_id=company.company_id,
                name=f"agent-{tag}",
                provider=common_pb2.PROVIDER_ANTHROPIC,
                model=model,
                provider_key="sk-bench-not-a-real-key",
                system_prompt="You answer briefly.",
            )
        )
    ).agent
    return World(company.company_id, made.room.room_id, agent.agent_id)


@dataclass(frozen=True)
class PostedWake:
    wake_id: str
    message_id: str


async def post_mention(client: Any, room_id: str, agent_id: str, i: int, *, deadline: float) -> tuple[str, datetime]:
    """Post message ``i`` mentioning ``agent_id`` through the Gateway (``client``: a GatewayClient); the run id
    its one wake will have and the message's created_at; ``deadline``: the call's, in seconds."""
    posted = await client.PostMessage(
        gateway_pb2.PostMessageRequest(
            room_id=room_id,
            person="bench",
            body=f"@bench-agent what is the plan for item {i}?",
            mention_agent_ids=[agent_id],
        ),
        timeout=deadline,
    )
    if len(posted.wake_ids) != 1:
        raise BenchError(f"a post mentioning one agent answered {len(posted.wake_ids)} wakes")
    return run_id_for(agent_id, posted.wake_ids[0]), posted.message.created_at.ToDatetime(tzinfo=UTC)


async def post_wakes(room: Any, world: World, count: int, *, parallel: int = 16) -> list[PostedWake]:
    """``count`` messages mentioning the world's agent, posted through RoomService; their wakes."""
    author = common_pb2.Author(kind=common_pb2.AUTHOR_KIND_PERSON, company_id=world.company_id, person="bench")
    out: list[PostedWake] = []
    sem = asyncio.Semaphore(parallel)

    async def one(i: int) -> None:
        async with sem:
            posted = await room.PostMessage(
                room_pb2.RoomServicePostMessageRequest(
                    room_id=world.room_id,
                    author=author,
                    body=f"@agent please answer question {i} about the launch plan",
                    mention_agent_ids=[world.agent_id],
                ),
                timeout=30,
            )
        if len(posted.wakes) != 1:
            raise BenchError(f"a message mentioning one agent recorded {len(posted.wakes)} wakes")
        out.append(PostedWake(posted.wakes[0].wake_id, posted.message.message_id))

    await asyncio.gather(*(one(i) for i in range(count)))
    return out


# -- watching the database ------------------------------------------------------------------------------


class BatchWatcher:
    """Resolves waiters when a row for their key appears, polling one query for all keys in batches."""

    def __init__(self, pool: asyncpg.Pool, query: str, *, interval: float = 0.001) -> None:
        self._pool = pool
        self._query = query  # $1 = text[] of keys; returns rows whose first column is the key
        self._interval = interval
        self._waiting: dict[str, asyncio.Future[asyncpg.Record]] = {}
        self._task: asyncio.Task[None] | None = None
        self.polls = 0

    def __enter__(self) -> BatchWatcher:
        self._task = asyncio.create_task(self._loop())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    def wait(self, key: str) -> asyncio.Future[asyncpg.Record]:
        fut = self._waiting.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._waiting[key] = fut
        return fut

    async def _loop(self) -> None:
        try:
            while True:
                if self._waiting:
                    rows = await self._pool.fetch(self._query, list(self._waiting))
                    self.polls += 1
                    for row in rows:
                        fut = self._waiting.pop(row[0], None)
                        if fut is not None and not fut.done():
                            fut.set_result(row)
                await asyncio.sleep(self._interval)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # surface a broken watcher to every waiter instead of hanging
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(exc)
            raise


ENDED_RUNS_QUERY = (
    "SELECT run_id, status, started_at, ended_at, model_attempts FROM runs "
    "WHERE run_id = ANY($1::text[]) AND ended_at IS NOT NULL"
)


def model_ms(model_attempts_json: str) -> float:
    """Total duration_ms of a ledger row's model attempts (whole milliseconds, as the ledger keeps them)."""
    return float(sum(int(a.get("duration_ms", 0)) for a in json.loads(model_attempts_json)))


# -- figures --------------------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``; NaN when empty."""
    data = sorted(values)
    if not data:
        return float("nan")
    rank = max(1, min(len(data), int(-(-q * len(data) // 100))))
    return data[rank - 1]


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain left/right-aligned text table (text left, numbers right)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [bool(rows) and all(isinstance(r[i], (int, float)) for r in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric, strict=True))

    print(line(list(headers)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print(line(r))


def _cell(value: object) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        return f"{value:.1f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def run_main(amain: Callable[[Any], Coroutine[Any, Any, Figures | None]], opts: Any) -> int:
    """Run ``amain(opts)`` on the asyncio loop (as the services do); a BenchError prints one clear line, exit 1.
    With ``--json PATH`` (``add_json_argument``) the figures ``amain`` returns are written there."""
    try:
        figures = asyncio.run(amain(opts))
    except BenchError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    path = getattr(opts, "json", None)
    if path:
        write_figures(path, figures or {})
    return 0


# -- figures as JSON ------------------------------------------------------------------------------------

# A bench's named figures: "<what> <unit>" -> value (NaN when it could not be measured).
Figures = dict[str, float]


def level_figures(name: str, rate_unit: str, rate: float, latencies_ms: Mapping[str, Sequence[float]]) -> Figures:
    """``"<name> <rate_unit>"`` and, per latency list, ``"<name> <what> p50 ms"`` and its p99."""
    figures = {f"{name} {rate_unit}": rate}
    for what, values in latencies_ms.items():
        for q in (50, 99):
            figures[" ".join(p for p in (name, what, f"p{q} ms") if p)] = percentile(values, q)
    return figures


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the figures as one JSON object to PATH ('-': print it as stdout's last line)",
    )


def write_figures(path: str, figures: Mapping[str, float]) -> None:
    """``{"figures": {name: value}}`` as one line of strict JSON (NaN as null) to ``path`` or stdout."""
    clean = {name: (None if value != value else float(value)) for name, value in figures.items()}
    text = json.dumps({"figures": clean}, allow_nan=False, sort_keys=True)
    if path == "-":
        print(text, flush=True)
    else:
        Path(path).write_text(text + "\n")


def read_figures(text: str) -> dict[str, float | None]:
    """The figures of ``write_figures``'s output (its last non-empty line, so a whole stdout also parses)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise BenchError("no figures: the output is empty")
    try:
        data = json.loads(lines[-1])
    except json.JSONDecodeError as exc:
        raise BenchError(f"no figures: the last line is not JSON ({exc})") from exc
    figures = data.get("figures") if isinstance(data, dict) else None
    if not isinstance(figures, dict) or not all(isinstance(v, (int, float)) or v is None for v in figures.values()):
        raise BenchError('no figures: expected {"figures": {name: number or null}}')
    return {str(k): (None if v is None else float(v)) for k, v in figures.items()}


def bench_cache_dir() -> Path:
    """Where the benches keep what they install or build outside the repo: ``QY_BENCH_CACHE`` or
    ``~/.cache/quayutec-bench``."""
    raw = os.environ.get("QY_BENCH_CACHE", "").strip()
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "quayutec-bench"


# -- the stand-in's control API and a process's resources ------------------------------------------------


def queue_standin_replies(
    standin_url: str, text: str, tool_calls: Sequence[Mapping[str, Any]], *, model: str, times: int
) -> None:
    """Queue ``times`` copies of one reply (with its tool calls) for ``model`` on a stand-in process."""
    body = {"text": text, "tool_calls": list(tool_calls), "model": model, "times": times}
    answer = httpx.post(f"{standin_url}/_standin/replies", json=body, timeout=10)
    if answer.status_code != 200:
        raise BenchError(f"the stand-in refused the scripted replies: {answer.status_code} {answer.text}")


@dataclass(frozen=True)
class ProcessSample:
    """What one process holds at a moment: resident memory, open fds, inet sockets, threads."""

    rss_bytes: int
    fds: int
    sockets: int
    threads: int

    @classmethod
    def of(cls, pid: int) -> ProcessSample:
        import psutil

        proc = psutil.Process(pid)
        return cls(proc.memory_info().rss, proc.num_fds(), len(proc.net_connections(kind="inet")), proc.num_threads())


async def start_accepted(runtime: Any, request: runtime_pb2.StartRunRequest) -> tuple[str, int]:
    """StartRun, retried while Runtime is full; the run id and the number of refusals."""
    refused = 0
    while True:
        try:
            answer = await runtime.StartRun(request, timeout=30)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            refused += 1
            await asyncio.sleep(min(0.05, 0.002 * refused))
            continue
        if answer.result != runtime_pb2.START_RUN_RESULT_ACCEPTED:
            raise BenchError(f"StartRun answered {runtime_pb2.StartRunResult.Name(answer.result)} for a fresh wake")
        return str(answer.run_id), refused


def parse_concurrency(raw: str) -> list[int]:
    """``--concurrency 1,32`` as a list of positive integers (BenchError otherwise)."""
    try:
        levels = [int(c) for c in raw.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise BenchError("--concurrency needs positive integers, e.g. 1,32")
    return levels
