"""The `quayutec` command: run everything locally, the demo, admin commands and a small client."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shutil
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from google.protobuf import json_format

from quayutec.channels import channel_as
from quayutec.config import DATA_DIR_ENV, GATEWAY, ROOM, ConfigError, DatabaseConfig, service_addr
from quayutec.db import open_pool
from quayutec.jaeger import ui_base_url
from quayutec.migrate import apply_all
from quayutec.tls import ADMIN, CA_FOLDER, IDENTITIES, MtlsConfig, ensure_dev_pki, identity_dir
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc
from services.client import (
    API_KEY_ENV,
    NOT_TRACED,
    STATUS_NAMES,
    STEP_NAMES,
    CommandError,
    GatewayClient,
    format_run,
    known_companies,
    own_rooms,
    resolve_company,
    resolve_mentions,
    resolve_own_agent,
    resolve_room,
    room_name,
    room_names,
    run_traces,
)

Handler = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


async def cmd_up(opts: argparse.Namespace) -> int:
    """Embedded PostgreSQL and all four services on this machine until Ctrl-C. The stack owns its
    data folder while it runs: a second stack on the same folder is refused, naming this one."""
    from quayutec.datadir import own
    from services.stack import LocalStack

    data_dir = DatabaseConfig.from_env().data_dir
    folder = own(data_dir, again=f"{program()} up --base-port 61051")
    try:
        stack = LocalStack.with_ports(ephemeral=False, base_port=opts.base_port, data_dir=data_dir)
        stack.folder = folder
        folder.record(stack.owner("quayutec up"))
        return await _run_up(stack, opts.standin)
    finally:
        folder.release()


async def _run_up(stack: Any, with_standin: bool) -> int:
    from quayutec.db import embedded_pgdata, embedded_pid

    standin = None
    if with_standin:
        from services.runtime.standin import StandinProvider

        standin = StandinProvider()
        url = standin.start()
        stack.extra_env = {"QUAYUTEC_RUNTIME_ANTHROPIC_BASE_URL": url, "QUAYUTEC_RUNTIME_OPENAI_BASE_URL": url}
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    config = stack.database_config()
    left = embedded_pid(embedded_pgdata(config.data_dir)) if config.url is None else None
    try:
        if left is not None:
            print(
                f"an embedded PostgreSQL (pid {left}) was left running in {config.data_dir} by a stack that "
                "ended; this one takes it over and stops it with the rest",
                flush=True,
            )
        print("starting PostgreSQL and applying migrations ...", flush=True)
        await stack.prepare_database()
        print("starting services ...", flush=True)
        await stack.start_all()
        await stack.start_console()
        for name in stack.ports:
            print(f"  {name:8s} {stack.addr(name)}", flush=True)
        print(f"  console  {stack.console_url} (sign in with a company's API key: see below)", flush=True)
        if standin is not None:
            print(
                f"  standin  {standin.base_url} (stand-in model provider; scripting its answers: README, "
                '"See an approval yourself", and docs/local.md)',
                flush=True,
            )
        print(f"logs in {stack.log_dir}; Ctrl-C stops everything", flush=True)
        print("in another terminal, point the commands at this stack with:", flush=True)
        print(stack.exports(), flush=True)
        print(_first_steps(same_database=config.url is not None), flush=True)
        await stop.wait()
        _say_while_stopping("\nstopping ...")
    finally:
        stack.stop_all()
        if standin is not None:
            standin.stop()
        if stack.started_pgdata is not None:
            _say_while_stopping("stopping the embedded PostgreSQL of this stack ...")
            await asyncio.to_thread(stack.stop_database)
    _say_while_stopping("stopped")
    return 0


def _say_while_stopping(text: str) -> None:
    """A line of the stop, which goes on whether or not anyone still reads: with `quayutec up | tee log`,
    Ctrl-C ends tee too, and a print that failed there must not skip stopping PostgreSQL."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _first_steps(*, same_database: bool) -> str:
    """What `up` suggests doing next, each line a command that works as printed (with the exports)."""
    me = program()
    where = " (with the same DATABASE_URL as this terminal)" if same_database else ""
    steps = [
        (f"{me} company create Acme", "prints: company <company-id> Acme"),
        (f"{me} keys create --company Acme", "a name or id; prints the key, once"),
        ("export QUAYUTEC_API_KEY=<the key>", "then the client commands, and the console's sign-in"),
        (f"{me} company list", "every company and its id"),
    ]
    width = max(len(command) for command, _ in steps)
    lines = [f"  {command.ljust(width)}  # {note}" for command, note in steps]
    return "\n".join([f"then make a company and an API key for it{where}, and act as that company:", *lines])


def program() -> str:
    """This command as a person can type it: ``quayutec`` when that is the one on PATH, else its path."""
    here = Path(sys.executable).parent / "quayutec"
    found = shutil.which("quayutec")
    if not here.exists() or (found is not None and Path(found).resolve() == here.resolve()):
        return "quayutec"
    return str(here)  # whole: another terminal may be in another folder


async def cmd_db_status(opts: argparse.Namespace) -> int:
    """Where the embedded PostgreSQL lives, whether it runs and who uses the folder."""
    from quayutec.datadir import holder
    from quayutec.db import embedded_pgdata, embedded_pid

    config = DatabaseConfig.from_env()
    if config.url:
        print("DATABASE_URL is set: the services use that PostgreSQL, not an embedded one")
    pgdata = embedded_pgdata(config.data_dir)
    pid = embedded_pid(pgdata)
    state = f"running (pid {pid})" if pid is not None else "not running"
    print(f"embedded PostgreSQL in {pgdata}: {state}")
    print(f"the data folder is in use by {holder(config.data_dir)}")
    return 0


async def cmd_db_stop(opts: argparse.Namespace) -> int:
    """Stop an embedded PostgreSQL left running in the data folder."""
    from quayutec.datadir import own
    from quayutec.db import embedded_ctl, embedded_pgdata, embedded_pid

    data_dir = DatabaseConfig.from_env().data_dir
    pgdata = embedded_pgdata(data_dir)
    pid = embedded_pid(pgdata)
    if pid is None:
        print(f"no embedded PostgreSQL running in {pgdata}")
        return 0
    # Only a server nobody runs on: one a stack or services of their own use stops with them.
    with own(data_dir, again=None):
        await asyncio.to_thread(embedded_ctl, "stop", pgdata)
    print(f"stopped the embedded PostgreSQL in {pgdata} (pid {pid})")
    return 0


async def cmd_config(opts: argparse.Namespace) -> int:
    """Every setting, its default, the value in effect here and who reads it (secrets hidden)."""
    from quayutec.settings import for_service, in_effect, ordered

    chosen = for_service(opts.service) if opts.service else ordered()
    rows = []
    for s in chosen:
        value, is_set = in_effect(s, os.environ)
        rows.append(
            {
                "name": s.name,
                "value": value,
                "from": "environment" if is_set else "default",
                "read_by": ",".join(s.services),
                "meaning": s.meaning,
            }
        )
    _print_rows(rows, opts.json, empty="no settings")
    return 0


async def cmd_demo(opts: argparse.Namespace) -> int:
    from services.demo import run_demo

    return await run_demo(then_stop=opts.then_stop)


async def cmd_pki_init(opts: argparse.Namespace) -> int:
    """The development PKI of QUAYUTEC_DATA_DIR (made if missing): the CA's folder, read by admin
    tooling only, and one folder per identity, each all that identity's process reads."""
    config = MtlsConfig.from_env()
    if config.from_files:
        print("error: QUAYUTEC_MTLS_CA/CERT/KEY are set: this process uses those files, not a development PKI")
        return 2
    ensure_dev_pki(config.pki_dir)
    print(f"development PKI in {config.pki_dir}")
    print(f"  {identity_dir(config.pki_dir, CA_FOLDER)}/  ca.crt ca.key   (the CA: admin tooling only)")
    for name in IDENTITIES:
        print(f"  {identity_dir(config.pki_dir, name)}/  ca.crt tls.crt tls.key")
    return 0


async def cmd_migrate(opts: argparse.Namespace) -> int:
    await apply_all()
    return 0


async def cmd_company_create(opts: argparse.Namespace) -> int:
    # The admin identity: its certificate from QUAYUTEC_MTLS_* or the data folder's development PKI.
    addr = service_addr(ROOM)
    async with channel_as(addr, identity=ADMIN, server=ROOM.name) as channel:
        room = room_pb2_grpc.RoomServiceStub(channel)
        try:
            company = (await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name=opts.name))).company
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            print(
                f"error: cannot reach the Room at {addr} over mutual TLS ({exc.details()}). Is it running, "
                f"and does this command use its CA: the same {DATA_DIR_ENV} as the services, or "
                "QUAYUTEC_MTLS_CA/CERT/KEY files of the admin identity?",
                file=sys.stderr,
            )
            return 2
    print(f"company {company.company_id} {company.name}")
    return 0


class AdminError(CommandError):
    """An admin command cannot go on; the message says what to fix."""


async def _with_pool(action: Callable[[Any], Awaitable[int]]) -> int:
    """Run an admin action on the services' database. With no DATABASE_URL that is the embedded
    PostgreSQL of QUAYUTEC_DATA_DIR, which must be running: a wrong folder must not start a new one."""
    from quayutec.db import embedded_pgdata, embedded_pid

    config = DatabaseConfig.from_env()
    if config.url is None and embedded_pid(embedded_pgdata(config.data_dir)) is None:
        raise AdminError(
            f"no PostgreSQL is running in {config.data_dir}: start the stack (`quayutec up`), or set "
            "QUAYUTEC_DATA_DIR to the folder `quayutec up` printed, or DATABASE_URL to your database"
        )
    pool = await open_pool(config)
    try:
        return await action(pool)
    finally:
        await pool.close()


async def cmd_keys_create(opts: argparse.Namespace) -> int:
    from services.gateway.auth import create_api_key

    async def act(pool: Any) -> int:
        company_id = await _company_id(pool, opts.company)
        key_id, secret = await create_api_key(pool, company_id, opts.label)
        print(f"key {key_id}\n{secret}\n(shown once; store it now — only its hash is kept)")
        return 0

    return await _with_pool(act)


async def cmd_keys_revoke(opts: argparse.Namespace) -> int:
    from services.gateway.auth import revoke_api_key

    async def act(pool: Any) -> int:
        if await revoke_api_key(pool, opts.key_id):
            print(f"key {opts.key_id} revoked; it stops working at once")
            return 0
        print(f"no key {opts.key_id}", file=sys.stderr)
        return 1

    return await _with_pool(act)


async def cmd_keys_list(opts: argparse.Namespace) -> int:
    from services.gateway.auth import list_api_keys

    async def act(pool: Any) -> int:
        keys = await list_api_keys(pool, await _company_id(pool, opts.company), sessions=opts.sessions)
        rows = [
            {
                "key_id": k.key_id,
                "label": k.label,
                "created_at": k.created_at.isoformat(timespec="seconds"),
                "revoked_at": k.revoked_at.isoformat(timespec="seconds") if k.revoked_at else None,
                **(
                    {
                        "session_of": k.parent_key_id or None,
                        "expires_at": k.expires_at.isoformat(timespec="seconds") if k.expires_at else None,
                    }
                    if opts.sessions
                    else {}
                ),
            }
            for k in keys
        ]
        _print_rows(rows, opts.json, empty="no keys")
        return 0

    return await _with_pool(act)


async def cmd_company_list(opts: argparse.Namespace) -> int:
    async def act(pool: Any) -> int:
        try:
            found = await pool.fetch(
                "SELECT company_id, name, created_at FROM companies ORDER BY created_at, name LIMIT $1", opts.limit
            )
        except asyncpg.UndefinedTableError:
            raise AdminError(NO_SCHEMA) from None
        rows = [
            {"company_id": str(c["company_id"]), "name": c["name"], "created_at": _when(c["created_at"])} for c in found
        ]
        _print_rows(rows, opts.json, empty="no companies yet: `quayutec company create <name>` makes one")
        return 0

    return await _with_pool(act)


def _when(at: Any) -> str:
    """A time as the list commands print it: ISO 8601 to the second (a datetime or a protobuf Timestamp)."""
    if hasattr(at, "ToDatetime"):
        at = at.ToDatetime(tzinfo=datetime.UTC)
    return str(at.isoformat(timespec="seconds"))


NO_SCHEMA = "this database has no Quayutec schema: is it the one your services use? (`quayutec migrate` creates it)"


async def _company_id(pool: Any, company: str) -> str:
    """The id of the company an admin command acts on, given by id or by name (regardless of case): it
    must exist in this database, or the error says what is wrong."""
    try:
        company_id = uuid.UUID(company)
    except ValueError:
        company_id = None
    try:
        if company_id is not None:
            found = await pool.fetch("SELECT company_id, name FROM companies WHERE company_id = $1", company_id)
        else:
            found = await pool.fetch(
                "SELECT company_id, name FROM companies WHERE lower(name) = lower($1) ORDER BY name", company.strip()
            )
    except asyncpg.UndefinedTableError:
        raise AdminError(NO_SCHEMA) from None
    if len(found) == 1:
        return str(found[0]["company_id"])
    if found:
        listed = "; ".join(f"{r['name']} ({r['company_id']})" for r in found)
        raise AdminError(f"{len(found)} companies are named {company!r} but for case: {listed}; give one by its id")
    what = f"company {company}" if company_id is not None else f"company named {company!r}"
    raise AdminError(
        f"no {what} in this database: check it (`company list` lists them) and that "
        "QUAYUTEC_DATA_DIR or DATABASE_URL is the one your services use"
    )


def _print_rows(rows: Sequence[Mapping[str, Any]], as_json: bool, *, empty: str) -> None:
    """A list command's output: an aligned table with a header, or JSON (one array) with ``--json``. An
    absent value is None: null in JSON, an empty cell in the table."""
    if as_json:
        print(json.dumps(list(rows), indent=2))
        return
    if not rows:
        print(f"({empty})")
        return
    columns = list(rows[0])
    cells = [["" if row[c] is None else str(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())


def _client(channel: grpc.aio.Channel) -> GatewayClient:
    key = os.environ.get(API_KEY_ENV, "").strip()
    if not key:
        raise SystemExit(f"set {API_KEY_ENV} to your company's API key (made with `quayutec keys create`)")
    return GatewayClient(channel, key)


async def cmd_post(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        room_id = await resolve_room(client, opts.room)
        mentions = await resolve_mentions(client, room_id, opts.mention or [])
        posted = await client.PostMessage(
            gateway_pb2.PostMessageRequest(
                room_id=room_id, person=opts.person, body=opts.body, mention_agent_ids=mentions
            )
        )
    woke = len(posted.wake_ids)
    wakes = f"woke {woke} agent{'s' if woke != 1 else ''}" + (f": wakes {', '.join(posted.wake_ids)}" if woke else "")
    print(f"message {posted.message.message_id} #{posted.message.seq}; {wakes}")
    return 0


async def cmd_room_list(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        got = await client.ListRooms(gateway_pb2.ListRoomsRequest(page_size=opts.limit))
        companies: dict[str, str] = {}
        for r in got.rooms:
            if r.created_by_company_id not in companies:
                companies |= await known_companies(client, r.room_id)
    rows = [
        {
            "room_id": r.room_id,
            "name": r.name,
            "created_by": companies.get(r.created_by_company_id, r.created_by_company_id),
            "created_at": _when(r.created_at),
        }
        | ({"created_by_company_id": r.created_by_company_id} if opts.json else {})
        for r in got.rooms
    ]
    _print_rows(rows, opts.json, empty="no rooms: `quayutec room create <name>` makes one, or accept an invitation")
    return 0


async def cmd_agent_list(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        room_id = await resolve_room(client, opts.room) if opts.room else ""
        me = (await client.WhoAmI(gateway_pb2.WhoAmIRequest())).company.company_id if room_id else ""
        got = await client.ListAgents(gateway_pb2.ListAgentsRequest(room_id=room_id, page_size=opts.limit))
    provider_names = {v: k for k, v in PROVIDERS.items()}
    rows = [
        {
            "agent_id": a.agent_id,
            "name": a.name,
            "company": (a.company_name or a.company_id) + (" (yours)" if a.company_id == me else ""),
            "provider": provider_names.get(a.provider, ""),
            "model": a.model,
        }
        | ({"company_id": a.company_id} if opts.json else {})
        for a in got.agents
    ]
    _print_rows(rows, opts.json, empty="no agents" + (" in this room" if opts.room else ": `agent register` adds one"))
    return 0


async def cmd_runs(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        agent_id = await resolve_own_agent(client, opts.agent) if opts.agent else ""
        runs = await client.ListRuns(gateway_pb2.ListRunsRequest(agent_id=agent_id, page_size=opts.limit))
        agents = {
            a.agent_id: a.name for a in (await client.ListAgents(gateway_pb2.ListAgentsRequest(page_size=500))).agents
        }
        rooms = {r.room_id: r.name for r in await own_rooms(client)}
    rows = [
        {
            "run_id": run.run_id,
            "agent": agents.get(run.agent_id, run.agent_id),
            "room": rooms.get(run.room_id, run.room_id),
            "started": _when(run.started_at) if run.HasField("started_at") else None,
            "status": STATUS_NAMES[run.status],
            "last_step": STEP_NAMES[run.step],
            # --json carries data: null when the run has no trace; the table says so in words.
            "trace": run.trace_id or (None if opts.json else NOT_TRACED),
        }
        | ({"agent_id": run.agent_id, "room_id": run.room_id} if opts.json else {})
        for run in runs.runs
    ]
    _print_rows(rows, opts.json, empty="no runs")
    return 0


async def cmd_run(opts: argparse.Namespace) -> int:
    """One run's ledger record, each of its traces with its Jaeger page when QUAYUTEC_CONSOLE_JAEGER_URL
    (the UI's base address) is set; refused before any call when that setting is not an http(s) URL."""
    jaeger_url = ui_base_url(os.environ)
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        run = (await client.GetRun(gateway_pb2.GetRunRequest(run_id=opts.run_id))).run
        if opts.json:
            record = json_format.MessageToDict(run, preserving_proto_field_name=True)
            print(json.dumps({**record, "traces": run_traces(run, jaeger_url)}, indent=2))
            return 0
        agents = {
            a.agent_id: a.name for a in (await client.ListAgents(gateway_pb2.ListAgentsRequest(page_size=500))).agents
        }
        rooms = {r.room_id: r.name for r in await own_rooms(client)}
    print(format_run(run, jaeger_url, agent=agents.get(run.agent_id, ""), room=rooms.get(run.room_id, "")))
    return 0


PROVIDER_KEY_ENV = "QUAYUTEC_PROVIDER_KEY"
PROVIDERS = {
    "anthropic": common_pb2.PROVIDER_ANTHROPIC,
    "openai": common_pb2.PROVIDER_OPENAI,
    "openai_compatible": common_pb2.PROVIDER_OPENAI_COMPATIBLE,
}


async def cmd_room_create(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        room = (await _client(channel).CreateRoom(gateway_pb2.CreateRoomRequest(name=opts.name))).room
    print(f"room {room.room_id} {room.name}")
    return 0


async def cmd_room_invite(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        room_id = await resolve_room(client, opts.room)
        company_id, _ = await resolve_company(client, opts.company)
        invited = (
            await client.InviteCompany(gateway_pb2.InviteCompanyRequest(room_id=room_id, company_id=company_id))
        ).invitation
    print(
        f"invitation {invited.invitation_id}: {invited.company_name} is invited to room {invited.room_name!r}; "
        "it becomes a member when it accepts (`quayutec invitation accept <id>`)"
    )
    return 0


async def cmd_room_leave(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        room_id = await resolve_room(client, opts.room)
        name = await room_name(client, room_id)
        await client.LeaveRoom(gateway_pb2.LeaveRoomRequest(room_id=room_id))
    print(f"your company left room {name!r}; rejoining takes a new invitation")
    return 0


async def cmd_room_remove_member(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        room_id = await resolve_room(client, opts.room)
        name = await room_name(client, room_id)
        company_id, company = await resolve_company(client, opts.company, member_of=room_id)
        await client.RemoveMember(gateway_pb2.RemoveMemberRequest(room_id=room_id, company_id=company_id))
    print(f"{company} removed from room {name!r}")
    return 0


async def cmd_room_rename(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        room_id = await resolve_room(client, opts.room)
        old = await room_name(client, room_id)
        room = (await client.RenameRoom(gateway_pb2.RenameRoomRequest(room_id=room_id, name=opts.name))).room
    print(f"room {old!r} is now named {room.name!r}")
    return 0


async def cmd_room_archive(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        room_id = await resolve_room(client, opts.room)
        room = (await client.ArchiveRoom(gateway_pb2.ArchiveRoomRequest(room_id=room_id))).room
    print(
        f"room {room.name!r} is archived: read-only from now on (its history stays readable; "
        "its pending invitations were withdrawn)"
    )
    return 0


INVITATION_STATUSES = {
    "pending": common_pb2.INVITATION_STATUS_PENDING,
    "accepted": common_pb2.INVITATION_STATUS_ACCEPTED,
    "declined": common_pb2.INVITATION_STATUS_DECLINED,
    "withdrawn": common_pb2.INVITATION_STATUS_WITHDRAWN,
}


async def cmd_invitations(opts: argparse.Namespace) -> int:
    status = INVITATION_STATUSES[opts.status]
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        if opts.room:
            client = _client(channel)
            got = await client.ListRoomInvitations(
                gateway_pb2.ListRoomInvitationsRequest(
                    room_id=await resolve_room(client, opts.room), status=status, page_size=opts.limit
                )
            )
        else:
            got = await _client(channel).ListInvitations(
                gateway_pb2.ListInvitationsRequest(status=status, page_size=opts.limit)
            )
    rows = [
        {
            "invitation_id": inv.invitation_id,
            "room_id": inv.room_id,
            "room": inv.room_name,
            "from": f"{inv.invited_by_company_name} ({inv.invited_by_company_id})",
            **({"to": f"{inv.company_name} ({inv.company_id})"} if opts.room else {}),
            "status": opts.status,
        }
        for inv in got.invitations
    ]
    _print_rows(rows, opts.json, empty=f"no {opts.status} invitations")
    return 0


async def cmd_invitation_withdraw(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).WithdrawInvitation(
            gateway_pb2.WithdrawInvitationRequest(invitation_id=opts.invitation_id)
        )
    inv = got.invitation
    print(f"withdrawn: invitation {inv.invitation_id} of {inv.company_name} to room {inv.room_name!r}")
    return 0


async def cmd_invitation_accept(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).AcceptInvitation(
            gateway_pb2.AcceptInvitationRequest(invitation_id=opts.invitation_id)
        )
    print(f"accepted: your company is a member of room {got.invitation.room_name!r}")
    return 0


async def cmd_invitation_decline(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).DeclineInvitation(
            gateway_pb2.DeclineInvitationRequest(invitation_id=opts.invitation_id)
        )
    print(f"declined: invitation {got.invitation.invitation_id} to room {got.invitation.room_name!r}")
    return 0


async def cmd_agent_register(opts: argparse.Namespace) -> int:
    key = os.environ.get(PROVIDER_KEY_ENV, "").strip()
    if not key:
        raise SystemExit(f"set {PROVIDER_KEY_ENV} to the agent's provider key (kept out of the command line)")
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        agent = (
            await _client(channel).RegisterAgent(
                gateway_pb2.RegisterAgentRequest(
                    name=opts.name,
                    provider=PROVIDERS[opts.provider],
                    model=opts.model,
                    base_url=opts.base_url or "",
                    provider_key=key,
                    system_prompt=opts.system_prompt,
                )
            )
        ).agent
    print(f"agent {agent.agent_id} {agent.name} ({opts.provider} {agent.model})")
    return 0


async def cmd_agent_rename(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        agent_id = await resolve_own_agent(client, opts.agent)
        agent = (await client.RenameAgent(gateway_pb2.RenameAgentRequest(agent_id=agent_id, name=opts.name))).agent
    print(f"agent {opts.agent!r} is now named {agent.name!r}")
    return 0


async def cmd_agent_retire(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        agent_id = await resolve_own_agent(client, opts.agent)
        agent = (await client.RetireAgent(gateway_pb2.RetireAgentRequest(agent_id=agent_id))).agent
    print(
        f"agent {agent.name!r} is retired: it wakes no more (its runs and messages stay); its name stays "
        "taken until you rename it"
    )
    return 0


CLIENT_SECRET_ENV = "QUAYUTEC_SIGNIN_CLIENT_SECRET"


def _format_provider(provider: gateway_pb2.SignInProvider) -> str:
    domains = ", ".join(provider.email_domains) or "any (the provider decides)"
    api_keys = "on (development)" if provider.allow_api_key_sign_in else "off"
    return (
        f"issuer {provider.issuer}\nclient id {provider.client_id}\nemail domains {domains}\nAPI-key sign-in {api_keys}"
    )


async def cmd_signin_set(opts: argparse.Namespace) -> int:
    secret = os.environ.get(CLIENT_SECRET_ENV, "").strip()
    if not secret:
        raise SystemExit(
            f"set {CLIENT_SECRET_ENV} to the console's client secret at the provider (kept off the command line)"
        )
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).SetSignInProvider(
            gateway_pb2.SetSignInProviderRequest(
                issuer=opts.issuer,
                client_id=opts.client_id,
                client_secret=secret,
                email_domains=opts.domain or [],
                allow_api_key_sign_in=opts.allow_api_key_sign_in,
            )
        )
    print(_format_provider(got.provider))
    return 0


async def cmd_signin_show(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).GetSignInProvider(gateway_pb2.GetSignInProviderRequest())
    print(_format_provider(got.provider) if got.found else "no sign-in provider: people sign in with an API key")
    return 0


async def cmd_signin_remove(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).RemoveSignInProvider(gateway_pb2.RemoveSignInProviderRequest())
    print("removed; its sign-ins are ended" if got.removed else "there was no sign-in provider")
    return 0


def _author_name(author: common_pb2.Author, companies: dict[str, str], agents: dict[str, str]) -> str:
    """ "Ana (Acme, verified)", "Bob (Acme, as stated)" or "planner (Globex's agent)"."""
    company = companies.get(author.company_id, author.company_id)
    if author.agent_id:
        return f"{agents.get(author.agent_id, 'agent ' + author.agent_id)} ({company}'s agent)"
    return f"{author.person} ({company}, {'verified' if author.verified_by else 'as stated'})"


async def cmd_messages(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        room_id = await resolve_room(client, opts.room)
        got = await client.ListMessages(
            gateway_pb2.ListMessagesRequest(room_id=room_id, page_size=opts.limit, newest_first=True)
        )
        companies, agents = await room_names(client, room_id)
    rows = [
        {"seq": m.seq, "author": _author_name(m.author, companies, agents), "body": m.body}
        | ({"author_company_id": m.author.company_id, "author_agent_id": m.author.agent_id} if opts.json else {})
        for m in reversed(got.messages)
    ]
    _print_rows(rows, opts.json, empty="no messages")
    return 0


EVENT_NAMES = {v: k.removeprefix("ROOM_EVENT_KIND_").lower() for k, v in common_pb2.RoomEventKind.items()}
STATUS_OF_TASK = {v: k.removeprefix("TASK_STATUS_").lower() for k, v in common_pb2.TaskStatus.items()}
# Ends of a watch that resuming from the last cursor cures (`quayutec watch` resumes by itself).
WATCH_RESUMABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
WATCH_RESUME_PAUSE_SECONDS = 1.0


class EventNames:
    """Names of the rooms, companies and agents that `watch` prints; a room's are looked up again when
    one of its events names an id not seen yet (a company that joined, an agent registered since)."""

    def __init__(self, client: GatewayClient) -> None:
        self._client = client
        self.rooms: dict[str, str] = {}
        self.companies: dict[str, str] = {}
        self.agents: dict[str, str] = {}
        self._sought: set[str] = set()  # ids looked up once already: a company gone from the room stays an id

    async def cover(self, event: common_pb2.RoomEvent) -> None:
        """Makes sure the event's ids have names, if the caller may still see them."""
        unknown = {i for i in _event_ids(event) if i and i not in self.companies and i not in self.agents}
        unknown -= self._sought
        if unknown or (event.room_id not in self.rooms and event.room_id not in self._sought):
            await self.load(event.room_id)
            self._sought |= unknown | {event.room_id}

    async def load(self, room_id: str) -> None:
        try:
            if room_id not in self.rooms:
                listed = await self._client.ListRooms(gateway_pb2.ListRoomsRequest(page_size=500))
                self.rooms |= {r.room_id: r.name for r in listed.rooms}
            companies, agents = await room_names(self._client, room_id)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # the company left the room: its ids stay ids
                raise
            return
        self.companies |= companies
        self.agents |= agents

    def company(self, company_id: str) -> str:
        return self.companies.get(company_id, f"company {company_id}")

    def agent(self, agent_id: str) -> str:
        return self.agents.get(agent_id, f"agent {agent_id}")

    def room(self, room_id: str) -> str:
        return self.rooms.get(room_id, f"room {room_id}")


def _event_ids(event: common_pb2.RoomEvent) -> list[str]:
    if event.HasField("message"):
        return [event.message.author.company_id, event.message.author.agent_id]
    if event.HasField("task"):
        return [event.task.to_agent_id, getattr(event.task, "from").company_id, getattr(event.task, "from").agent_id]
    if event.HasField("member"):
        return [event.member.company_id]
    if event.HasField("run"):
        return [event.run.agent_id]
    if event.HasField("approval"):
        return [event.approval.agent_id]
    return []


def format_event(event: common_pb2.RoomEvent, names: EventNames) -> str:
    """One line per room event: its cursor, kind and what changed, naming companies and agents."""
    what = ""
    if event.HasField("message"):
        m = event.message
        who = (
            f"{names.agent(m.author.agent_id)} ({names.company(m.author.company_id)}'s agent)"
            if m.author.agent_id
            else f"{m.author.person} ({names.company(m.author.company_id)})"
        )
        what = f"#{m.seq} {who}: {m.body}"
    elif event.HasField("task"):
        t = event.task
        what = f"{t.title!r} -> {names.agent(t.to_agent_id)} ({STATUS_OF_TASK.get(t.status, str(t.status))})"
    elif event.HasField("memory"):
        scope = "company only" if event.memory.visibility == common_pb2.MEMORY_VISIBILITY_COMPANY else "room"
        what = f"({scope}) {event.memory.text}"
    elif event.HasField("file"):
        what = f"{event.file.name} ({event.file.size_bytes} bytes)"
    elif event.HasField("member"):
        what = event.member.company_name or names.company(event.member.company_id)
    elif event.HasField("run"):
        what = f"a run of {names.agent(event.run.agent_id)}: {STATUS_NAMES[event.run.status]}"
    elif event.HasField("approval"):
        a = event.approval
        what = f"{len(a.held)} held action(s) of {names.agent(a.agent_id)} ({a.token})"
    return f"[{event.cursor}] {EVENT_NAMES.get(event.kind, str(event.kind))} {what}".rstrip()


def _event_json(event: common_pb2.RoomEvent) -> str:
    return json_format.MessageToJson(event, indent=None, preserving_proto_field_name=True)


async def cmd_watch(opts: argparse.Namespace) -> int:
    """Prints the room's events (or, with --all, every room's) as they happen, like `tail -f`; resumes by
    itself after a drop. Lines name rooms, companies and agents; --json prints each event whole, ids and all."""
    if opts.all:
        if opts.after is not None:
            print("--after goes with --room; `watch --all` starts from now", file=sys.stderr)
            return 2
        return await _watch_all(opts.json)
    after: int | None = opts.after
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        room_id = await resolve_room(client, opts.room)
        names = EventNames(client)
        while True:
            request = gateway_pb2.WatchRoomRequest(room_id=room_id)
            if after is not None:
                request.after = after
            try:
                async for item in client.WatchRoom(request):
                    for event in item.events:
                        if opts.json:
                            print(_event_json(event), flush=True)
                        else:
                            await names.cover(event)
                            print(format_event(event, names), flush=True)
                        after = event.cursor
                    if item.HasField("heartbeat"):
                        after = item.heartbeat.cursor
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in WATCH_RESUMABLE:
                    raise
                print(f"watch ended ({exc.code().name}: {exc.details()}); resuming after {after}", file=sys.stderr)
                await asyncio.sleep(WATCH_RESUME_PAUSE_SECONDS)


async def _watch_all(as_json: bool) -> int:
    """Every room of the company in one WatchRooms stream: one line per event, prefixed by its room."""
    cursors: dict[str, int] = {}
    resuming = False  # after the first heartbeat: rooms joined meanwhile are followed from their joining
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        names = EventNames(client)
        while True:
            request = gateway_pb2.WatchRoomsRequest(
                after=[gateway_pb2.RoomCursor(room_id=r, cursor=c) for r, c in cursors.items()],
                unnamed_from_joining=resuming,
            )
            try:
                async for item in client.WatchRooms(request):
                    for event in item.events:
                        if as_json:
                            print(_event_json(event), flush=True)
                        else:
                            await names.cover(event)
                            print(f"{names.room(event.room_id)}: {format_event(event, names)}", flush=True)
                        cursors[event.room_id] = event.cursor
                    if item.HasField("heartbeat"):
                        cursors = {r.room_id: r.cursor for r in item.heartbeat.rooms}
                        resuming = True
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in WATCH_RESUMABLE:
                    raise
                print(f"watch ended ({exc.code().name}: {exc.details()}); resuming", file=sys.stderr)
                await asyncio.sleep(WATCH_RESUME_PAUSE_SECONDS)


RIGHTS = {
    "auto": common_pb2.ACTION_RIGHT_AUTO,
    "hold": common_pb2.ACTION_RIGHT_HOLD,
    "deny": common_pb2.ACTION_RIGHT_DENY,
    # Not set here: the agent inherits the company default, the default the built-in auto.
    "inherit": common_pb2.ACTION_RIGHT_UNSPECIFIED,
}
RIGHT_FIELDS = ("remember", "create_task", "update_task", "close_task", "cross_company_task")


async def cmd_rights_set(opts: argparse.Namespace) -> int:
    chosen = {f: RIGHTS[getattr(opts, f)] for f in RIGHT_FIELDS if getattr(opts, f)}
    if not chosen:
        raise SystemExit("name at least one right to set, e.g. --create-task hold (see --help)")
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        request = gateway_pb2.SetAgentRightsRequest(
            agent_id=await resolve_own_agent(client, opts.agent) if opts.agent else ""
        )
        for field, right in chosen.items():
            setattr(request, field, right)
        request.update_mask.paths.extend(chosen)  # only these change; the others stay as they are
        got = await client.SetAgentRights(request)
    print(_format_rights(got.rights))
    return 0


async def cmd_rights_show(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        agent_id = await resolve_own_agent(client, opts.agent) if opts.agent else ""
        got = await client.GetAgentRights(gateway_pb2.GetAgentRightsRequest(agent_id=agent_id))
    own = got.agent if opts.agent else got.company_default
    for field in RIGHT_FIELDS:
        print(f"{field}={_right_name(getattr(got.effective, field))} ({_right_source(got, own, field)})")
    return 0


def _right_name(right: common_pb2.ActionRight.ValueType) -> str:
    return next((name for name, value in RIGHTS.items() if value == right), "inherit")


def _right_source(got: gateway_pb2.GetAgentRightsResponse, own: common_pb2.AgentRights, field: str) -> str:
    """Where an effective right comes from: set here, inherited from the company default, or built in."""
    if getattr(own, field):
        return "set here"
    if getattr(got.company_default, field):
        return "inherited from the company default"
    return "built-in default"


def _format_rights(rights: common_pb2.AgentRights) -> str:
    return ", ".join(f"{f}={_right_name(getattr(rights, f))}" for f in RIGHT_FIELDS)


async def cmd_approvals(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        client = _client(channel)
        got = await client.ListApprovals(gateway_pb2.ListApprovalsRequest(page_size=opts.limit))
        agents = {
            a.agent_id: a.name for a in (await client.ListAgents(gateway_pb2.ListAgentsRequest(page_size=500))).agents
        }
        rooms = {r.room_id: r.name for r in (await client.ListRooms(gateway_pb2.ListRoomsRequest(page_size=500))).rooms}
    rows = [
        {
            "token": wp.token,
            "index": held.index,
            "action": common_pb2.ActionKind.Name(held.kind).removeprefix("ACTION_KIND_").lower(),
            "decision": common_pb2.Decision.Name(held.decision).removeprefix("DECISION_").lower(),
            "agent": agents.get(wp.agent_id, wp.agent_id),
            "room": rooms.get(wp.room_id, wp.room_id),
            "run_id": wp.run_id,
            "expires": wp.expires_at.ToJsonString(),
            "arguments": held.arguments_json,
        }
        | ({"agent_id": wp.agent_id, "room_id": wp.room_id} if opts.json else {})
        for wp in got.waitpoints
        for held in wp.held
    ]
    _print_rows(rows, opts.json, empty="no held actions")
    return 0


async def cmd_decide(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).DecideApproval(
            gateway_pb2.DecideApprovalRequest(
                token=opts.token, index=opts.index, person=opts.person, approve=opts.decision == "approve"
            )
        )
    state = "the run continues" if got.completed else ("already decided" if got.already_decided else "recorded")
    print(f"{opts.decision} #{opts.index}: {state}")
    return 0


ROOM_ID = "a room's name or id (as `room create` prints)"
COMPANY_ID = "a company's name or id (as `company create` prints)"
COMPANY = "a company's name (one your company shares a room or an invitation with) or id"
AS_JSON = "print JSON (an array of objects) instead of a table"


def _limit(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--limit", type=int, default=default, metavar="N", help=f"list at most N (default {default})")


def _json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help=AS_JSON)


def version() -> str:
    """This checkout's version, as installed (pyproject.toml's), or "unknown" when not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("quayutec-rooms")
    except PackageNotFoundError:
        return "unknown (not installed: `make demo` or `pip install -e .` installs it)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="quayutec",
        description="Quayutec rooms: run the stack or the demo on this machine, administer companies and their "
        "keys, and act as a company through the Gateway.",
        epilog=f"Client commands authenticate with {API_KEY_ENV}; admin commands use the services' database "
        "(DATABASE_URL, or the embedded PostgreSQL of QUAYUTEC_DATA_DIR). `quayutec config` lists every setting.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = sub.add_parser("up", help="run the embedded PostgreSQL, the four services and the console here until Ctrl-C")
    up.add_argument(
        "--standin",
        action="store_true",
        help="point Runtime at a local stand-in model provider (its scripted answers: docs/local.md)",
    )
    up.add_argument(
        "--base-port",
        type=int,
        metavar="PORT",
        help="Gateway on PORT, Room, Claims and Runtime on the next three, the console on PORT+4, the Gateway's "
        "console port on PORT+5 (default: each QUAYUTEC_<SVC>_LISTEN or _ADDR when set, else 50051-50054, the "
        "console on 8080 and the Gateway's console port on 50055)",
    )
    up.set_defaults(handler=cmd_up)
    db = sub.add_parser("db", help="the embedded PostgreSQL in the data folder").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    db.add_parser("status", help="say whether it runs, and where").set_defaults(handler=cmd_db_status)
    db.add_parser("stop", help="stop one left running (Ctrl-C on `up` stops the one `up` started)").set_defaults(
        handler=cmd_db_stop
    )
    cf = sub.add_parser("config", help="list every setting: its default, the value in effect here, who reads it")
    cf.add_argument(
        "--service",
        choices=["gateway", "room", "claims", "runtime", "console", "cli", "jaeger"],
        help="only the settings this one reads",
    )
    _json(cf)
    cf.set_defaults(handler=cmd_config)
    dm = sub.add_parser(
        "demo",
        help="run the two-company demo (a Runtime crash, then an approval); the stack then stays up for the "
        "console until Ctrl-C",
    )
    dm.add_argument(
        "--then-stop",
        action="store_true",
        help="stop the stack as soon as the demo is done (also when CI=true is in the environment)",
    )
    dm.set_defaults(handler=cmd_demo)
    sub.add_parser("migrate", help="apply schema migrations to DATABASE_URL").set_defaults(handler=cmd_migrate)
    pki = sub.add_parser("pki", help="the development certificates of the data folder (admin)").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    pki.add_parser(
        "init", help="make the development CA and each identity's certificate where missing, and say where they are"
    ).set_defaults(handler=cmd_pki_init)

    company = sub.add_parser("company", help="companies (admin)").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    create = company.add_parser("create", help="create a company")
    create.add_argument("name", help="the company's name (unique)")
    create.set_defaults(handler=cmd_company_create)
    cl = company.add_parser("list", help="list every company and its id, oldest first")
    _limit(cl, 100)
    _json(cl)
    cl.set_defaults(handler=cmd_company_list)

    keys = sub.add_parser("keys", help="API keys (admin)").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    kc = keys.add_parser("create", help="make an API key for a company (the key is printed once)")
    kc.add_argument("--company", required=True, help=COMPANY_ID)
    kc.add_argument("--label", default="", help="a note to tell keys apart (e.g. ci)")
    kc.set_defaults(handler=cmd_keys_create)
    kr = keys.add_parser("revoke", help="revoke a key at once (its open streams and session keys end too)")
    kr.add_argument("key_id", help="the key's id (as `keys create` or `keys list` print)")
    kr.set_defaults(handler=cmd_keys_revoke)
    kl = keys.add_parser("list", help="list a company's keys, revoked ones included")
    kl.add_argument("--company", required=True, help=COMPANY_ID)
    kl.add_argument("--sessions", action="store_true", help="also the session keys (console sign-ins) its keys made")
    _json(kl)
    kl.set_defaults(handler=cmd_keys_list)

    post = sub.add_parser("post", help=f"post a message as a person of your company (needs {API_KEY_ENV})")
    post.add_argument("--room", required=True, help=ROOM_ID)
    post.add_argument("--person", required=True, help="who in your company writes it (e.g. ana)")
    post.add_argument(
        "--mention",
        action="append",
        metavar="AGENT",
        help="an agent to wake, by id or by its name in the room (repeatable; `agent list --room` shows them)",
    )
    post.add_argument("body", help="the message text")
    post.set_defaults(handler=cmd_post)
    runs = sub.add_parser("runs", help="list your agents' runs, newest first, with their trace ids")
    runs.add_argument("--agent", metavar="AGENT", help="only this agent's runs (its name or id)")
    _limit(runs, 20)
    _json(runs)
    runs.set_defaults(handler=cmd_runs)
    run = sub.add_parser(
        "run",
        help="show one run's full ledger record, with its traces' Jaeger pages when QUAYUTEC_CONSOLE_JAEGER_URL is set",
    )
    run.add_argument("run_id", help="a run id (as `runs` prints)")
    run.add_argument(
        "--json", action="store_true", help="print the record as one JSON object, with 'traces': each id and its link"
    )
    run.set_defaults(handler=cmd_run)
    room = sub.add_parser("room", help="rooms (as your company)").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    rc = room.add_parser("create", help="create a room; your company is its first member")
    rc.add_argument("name", help="the room's name")
    rc.set_defaults(handler=cmd_room_create)
    ri = room.add_parser("invite", help="invite another company; it becomes a member when it accepts")
    ri.add_argument("room", help=ROOM_ID)
    ri.add_argument("company", help="the company to invite: " + COMPANY)
    ri.set_defaults(handler=cmd_room_invite)
    rl = room.add_parser("leave", help="leave a room (its creator cannot); you lose access at once")
    rl.add_argument("room", help=ROOM_ID)
    rl.set_defaults(handler=cmd_room_leave)
    rr = room.add_parser("remove-member", help="remove a member company (the room's creator only)")
    rr.add_argument("room", help=ROOM_ID)
    rr.add_argument("company", help="the member company's name or id")
    rr.set_defaults(handler=cmd_room_remove_member)
    rn = room.add_parser("rename", help="rename a room (the room's creator only)")
    rn.add_argument("room", help=ROOM_ID)
    rn.add_argument("name", help="its new name (unique among the rooms your company created)")
    rn.set_defaults(handler=cmd_room_rename)
    ra = room.add_parser("archive", help="archive a room (its creator only): read-only from then on, history kept")
    ra.add_argument("room", help=ROOM_ID)
    ra.set_defaults(handler=cmd_room_archive)
    rls = room.add_parser("list", help="list the rooms your company is a member of")
    _limit(rls, 50)
    _json(rls)
    rls.set_defaults(handler=cmd_room_list)
    iv = sub.add_parser("invitations", help="list the invitations to your company (pending ones by default)")
    iv.add_argument("--status", choices=list(INVITATION_STATUSES), default="pending", help="which ones to list")
    iv.add_argument(
        "--room",
        default="",
        metavar="ROOM",
        help="instead, the invitations into this room (its name or id) that your company made",
    )
    _limit(iv, 50)
    _json(iv)
    iv.set_defaults(handler=cmd_invitations)
    invitation = sub.add_parser(
        "invitation", help="answer an invitation to your company, or withdraw one"
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    ia = invitation.add_parser("accept", help="accept it: your company becomes a member of the room")
    ia.add_argument("invitation_id", help="the invitation's id (as `invitations` prints)")
    ia.set_defaults(handler=cmd_invitation_accept)
    idc = invitation.add_parser("decline", help="decline it: your company stays out of the room")
    idc.add_argument("invitation_id", help="the invitation's id (as `invitations` prints)")
    idc.set_defaults(handler=cmd_invitation_decline)
    iw = invitation.add_parser(
        "withdraw", help="withdraw a pending invitation (as the room's creator or the one who sent it)"
    )
    iw.add_argument("invitation_id", help="the invitation's id (as `invitations --room` prints)")
    iw.set_defaults(handler=cmd_invitation_withdraw)
    agent = sub.add_parser("agent", help="your agents").add_subparsers(dest="action", required=True, metavar="ACTION")
    ar = agent.add_parser("register", help=f"register an always-on agent (provider key from {PROVIDER_KEY_ENV})")
    ar.add_argument("--name", required=True, help="the agent's name, as people mention it")
    ar.add_argument("--provider", required=True, choices=sorted(PROVIDERS), help="which API its model speaks")
    ar.add_argument("--model", required=True, help="the provider's model name")
    ar.add_argument(
        "--base-url",
        metavar="URL",
        help="your own model address: https to a public address unless the operator allow-lists it "
        "(one request per call, never retried)",
    )
    ar.add_argument("--system-prompt", default="", metavar="TEXT", help="the agent's standing instructions")
    ar.set_defaults(handler=cmd_agent_register)
    an = agent.add_parser("rename", help="rename one of your agents")
    an.add_argument("agent", metavar="AGENT", help="the agent: its name or id")
    an.add_argument("name", help="its new name (unique within your company)")
    an.set_defaults(handler=cmd_agent_rename)
    at = agent.add_parser("retire", help="retire one of your agents: it wakes no more; its record stays")
    at.add_argument("agent", metavar="AGENT", help="the agent: its name or id")
    at.set_defaults(handler=cmd_agent_retire)
    al = agent.add_parser("list", help="list your company's agents, or with --room every agent in that room")
    al.add_argument("--room", metavar="ROOM", help="the agents in this room (its name or id), of every member company")
    _limit(al, 50)
    _json(al)
    al.set_defaults(handler=cmd_agent_list)
    ms = sub.add_parser("messages", help="show a room's latest messages, oldest of them first")
    ms.add_argument("--room", required=True, help=ROOM_ID)
    _limit(ms, 20)
    _json(ms)
    ms.set_defaults(handler=cmd_messages)
    wt = sub.add_parser("watch", help="print a room's events, or every room's, as they happen (like tail -f)")
    which = wt.add_mutually_exclusive_group(required=True)
    which.add_argument("--room", metavar="ROOM", help="the room to follow, by name or id (you must be a member)")
    which.add_argument(
        "--all", action="store_true", help="every room of your company, in one stream (rooms joined while watching too)"
    )
    wt.add_argument(
        "--after",
        type=int,
        metavar="CURSOR",
        help="with --room: start after this cursor (0: from the oldest kept); default: from now",
    )
    wt.add_argument("--json", action="store_true", help="print each event as one line of JSON, with its ids")
    wt.set_defaults(handler=cmd_watch)
    rights = sub.add_parser("rights", help="your agents' rights (auto, hold, deny)").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    rs = rights.add_parser(
        "set",
        help="set rights, of the default for all your agents or of one (--agent); only the rights named change",
    )
    rs.add_argument(
        "--agent", metavar="AGENT", help="set this agent's own rights (its name or id) instead of the default"
    )
    for field in RIGHT_FIELDS:
        rs.add_argument(
            f"--{field.replace('_', '-')}",
            dest=field,
            choices=sorted(RIGHTS),
            help=f"what the {field} action does (unchanged when not given; inherit: take the default's again)",
        )
    rs.set_defaults(handler=cmd_rights_set)
    rg = rights.add_parser(
        "show", help="show the effective rights of the default or of --agent, and where each comes from"
    )
    rg.add_argument("--agent", metavar="AGENT", help="this agent's effective rights (its name or id)")
    rg.set_defaults(handler=cmd_rights_show)
    si = sub.add_parser(
        "sign-in", help="the OpenID Connect provider your people sign in to the console with"
    ).add_subparsers(dest="action", required=True, metavar="ACTION")
    ss = si.add_parser(
        "set",
        help=f"register or replace it (the client secret is read from {CLIENT_SECRET_ENV}); "
        "API-key sign-in is turned off unless --allow-api-key-sign-in",
    )
    ss.add_argument("--issuer", required=True, metavar="URL", help="the issuer URL exactly as its ID tokens name it")
    ss.add_argument("--client-id", required=True, metavar="ID", help="the console's client id at the provider")
    ss.add_argument(
        "--domain", action="append", help="an email domain whose people may sign in (repeatable; with none, any domain)"
    )
    ss.add_argument(
        "--allow-api-key-sign-in", action="store_true", help="keep the console's API-key sign-in on (development)"
    )
    ss.set_defaults(handler=cmd_signin_set)
    si.add_parser("show", help="show the provider now set (never its secret)").set_defaults(handler=cmd_signin_show)
    si.add_parser("remove", help="remove it: its sign-ins end, and API-key sign-in is on again").set_defaults(
        handler=cmd_signin_remove
    )
    ap = sub.add_parser("approvals", help="list the held actions waiting for your company's decision")
    _limit(ap, 50)
    _json(ap)
    ap.set_defaults(handler=cmd_approvals)
    dc = sub.add_parser("decide", help="approve or deny one held action")
    dc.add_argument("token", help="the waitpoint token (as `approvals` prints)")
    dc.add_argument("index", type=int, help="the held action's index (as `approvals` prints)")
    dc.add_argument("decision", choices=["approve", "deny"], help="your decision")
    dc.add_argument("--person", required=True, help="who in your company decides (recorded)")
    dc.set_defaults(handler=cmd_decide)
    return p


def main(argv: list[str] | None = None) -> None:
    try:
        try:
            code = _run(argv)
        finally:
            sys.stdout.flush()  # here, not at exit, where a closed pipe could only be reported
    except BrokenPipeError:
        code = _reader_went_away()
    raise SystemExit(code)


def _run(argv: list[str] | None) -> int:
    opts = parser().parse_args(argv)
    handler: Handler = opts.handler
    try:
        code: int = asyncio.run(handler(opts))
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            print(
                f"error: the Gateway at {service_addr(GATEWAY)} cannot be reached ({exc.details()}); is the stack "
                "running (`quayutec up`), and is QUAYUTEC_GATEWAY_ADDR right?",
                file=sys.stderr,
            )
        else:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        code = 2
    except (CommandError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    return code


def _reader_went_away() -> int:
    """Whoever read our output stopped (``quayutec config | head``): end quietly, as other tools
    do. Standard output now goes nowhere, so the flush at exit raises nothing either."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141  # what a shell reports for a command ended by SIGPIPE


if __name__ == "__main__":
    main()
