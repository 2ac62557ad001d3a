"""The `quayutec` command: run everything locally, the demo, admin commands and a small client."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc

from quayutec.channels import channel_as
from quayutec.config import DATA_DIR_ENV, GATEWAY, ROOM, DatabaseConfig, service_addr
from quayutec.db import open_pool
from quayutec.migrate import apply_all
from quayutec.tls import ADMIN
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc
from services.client import API_KEY_ENV, GatewayClient, format_run

Handler = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


async def cmd_up(opts: argparse.Namespace) -> int:
    """Embedded PostgreSQL and all four services on this machine until Ctrl-C."""
    from services.stack import LocalStack

    extra: dict[str, str] = {}
    standin = None
    if opts.standin:
        from services.runtime.standin import StandinProvider

        standin = StandinProvider()
        url = standin.start()
        extra = {"QUAYUTEC_RUNTIME_ANTHROPIC_BASE_URL": url, "QUAYUTEC_RUNTIME_OPENAI_BASE_URL": url}
    stack = LocalStack.with_ports(ephemeral=False, extra_env=extra)
    print("starting PostgreSQL and applying migrations ...", flush=True)
    await stack.prepare_database()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        print("starting services ...", flush=True)
        await stack.start_all()
        for name in stack.ports:
            print(f"  {name:8s} {stack.addr(name)}", flush=True)
        if standin is not None:
            print(f"  standin  {standin.base_url} (stand-in model provider)", flush=True)
        print(f"logs in {stack.log_dir}; Ctrl-C stops everything", flush=True)
        await stop.wait()
        print("\nstopping ...", flush=True)
    finally:
        stack.stop_all()
        if standin is not None:
            standin.stop()
    print("stopped", flush=True)
    return 0


async def cmd_demo(opts: argparse.Namespace) -> int:
    from services.demo import run_demo

    return await run_demo()


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


async def _with_pool(action: Callable[[Any], Awaitable[int]]) -> int:
    pool = await open_pool(DatabaseConfig.from_env())
    try:
        return await action(pool)
    finally:
        await pool.close()


async def cmd_keys_create(opts: argparse.Namespace) -> int:
    from services.gateway.auth import create_api_key

    async def act(pool: Any) -> int:
        key_id, secret = await create_api_key(pool, opts.company, opts.label)
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
        for key in await list_api_keys(pool, opts.company):
            print(key)
        return 0

    return await _with_pool(act)


def _client(channel: grpc.aio.Channel) -> GatewayClient:
    key = os.environ.get(API_KEY_ENV, "").strip()
    if not key:
        raise SystemExit(f"set {API_KEY_ENV} to your company's API key (made with `quayutec keys create`)")
    return GatewayClient(channel, key)


async def cmd_post(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        posted = await _client(channel).PostMessage(
            gateway_pb2.PostMessageRequest(
                room_id=opts.room, person=opts.person, body=opts.body, mention_agent_ids=opts.mention or []
            )
        )
    print(f"message {posted.message.message_id} #{posted.message.seq}; wakes {list(posted.wake_ids)}")
    return 0


async def cmd_runs(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        runs = await _client(channel).ListRuns(
            gateway_pb2.ListRunsRequest(agent_id=opts.agent or "", page_size=opts.limit)
        )
    for run in runs.runs:
        print(format_run(run).splitlines()[0] + f"  trace {run.trace_id or '-'}")
    return 0


async def cmd_run(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        run = (await _client(channel).GetRun(gateway_pb2.GetRunRequest(run_id=opts.run_id))).run
    print(format_run(run))
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
        invited = await _client(channel).InviteCompany(
            gateway_pb2.InviteCompanyRequest(room_id=opts.room, company_id=opts.company)
        )
    print(
        f"invitation {invited.invitation.invitation_id}: company {opts.company} is invited to room {opts.room}; "
        "it becomes a member when it accepts (`quayutec invitation accept <id>`)"
    )
    return 0


async def cmd_room_leave(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        await _client(channel).LeaveRoom(gateway_pb2.LeaveRoomRequest(room_id=opts.room))
    print(f"your company left room {opts.room}; rejoining takes a new invitation")
    return 0


async def cmd_room_remove_member(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        await _client(channel).RemoveMember(gateway_pb2.RemoveMemberRequest(room_id=opts.room, company_id=opts.company))
    print(f"company {opts.company} removed from room {opts.room}")
    return 0


INVITATION_STATUSES = {
    "pending": common_pb2.INVITATION_STATUS_PENDING,
    "accepted": common_pb2.INVITATION_STATUS_ACCEPTED,
    "declined": common_pb2.INVITATION_STATUS_DECLINED,
}


async def cmd_invitations(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).ListInvitations(
            gateway_pb2.ListInvitationsRequest(status=INVITATION_STATUSES[opts.status], page_size=opts.limit)
        )
    for inv in got.invitations:
        print(
            f"invitation {inv.invitation_id}  room {inv.room_id} {inv.room_name!r}  "
            f"from {inv.invited_by_company_name} ({inv.invited_by_company_id})  {opts.status}"
        )
    return 0


async def cmd_invitation_accept(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).AcceptInvitation(
            gateway_pb2.AcceptInvitationRequest(invitation_id=opts.invitation_id)
        )
    print(f"accepted: your company is a member of room {got.invitation.room_id} {got.invitation.room_name!r}")
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


async def cmd_messages(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).ListMessages(
            gateway_pb2.ListMessagesRequest(room_id=opts.room, page_size=opts.limit, newest_first=True)
        )
    for m in reversed(got.messages):
        who = f"{m.author.person} ({m.author.company_id})" if m.author.person else f"agent {m.author.agent_id}"
        print(f"#{m.seq} {who}: {m.body}")
    return 0


RIGHTS = {
    "auto": common_pb2.ACTION_RIGHT_AUTO,
    "hold": common_pb2.ACTION_RIGHT_HOLD,
    "deny": common_pb2.ACTION_RIGHT_DENY,
}
RIGHT_FIELDS = ("remember", "create_task", "update_task", "close_task", "cross_company_task")


async def cmd_rights_set(opts: argparse.Namespace) -> int:
    chosen = {f: RIGHTS[getattr(opts, f)] for f in RIGHT_FIELDS if getattr(opts, f)}
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).SetAgentRights(
            gateway_pb2.SetAgentRightsRequest(agent_id=opts.agent or "", **chosen)
        )
    print(_format_rights(got.rights))
    return 0


async def cmd_rights_show(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).GetAgentRights(gateway_pb2.GetAgentRightsRequest(agent_id=opts.agent or ""))
    print("effective: " + _format_rights(got.effective))
    return 0


def _format_rights(rights: common_pb2.AgentRights) -> str:
    names = {v: k for k, v in RIGHTS.items()}
    return ", ".join(f"{f}={names.get(getattr(rights, f), 'default')}" for f in RIGHT_FIELDS)


async def cmd_approvals(opts: argparse.Namespace) -> int:
    async with grpc.aio.insecure_channel(service_addr(GATEWAY)) as channel:
        got = await _client(channel).ListApprovals(gateway_pb2.ListApprovalsRequest(page_size=opts.limit))
    for wp in got.waitpoints:
        print(f"token {wp.token}  run {wp.run_id}  agent {wp.agent_id}  expires {wp.expires_at.ToJsonString()}")
        for held in wp.held:
            decision = common_pb2.Decision.Name(held.decision).removeprefix("DECISION_").lower()
            kind = common_pb2.ActionKind.Name(held.kind).removeprefix("ACTION_KIND_").lower()
            print(f"  #{held.index} {kind} {held.arguments_json}: {decision}")
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quayutec", description="Quayutec rooms: run, demo and administer.")
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="embedded PostgreSQL and all four services here; Ctrl-C stops them")
    up.add_argument("--standin", action="store_true", help="point Runtime at a local stand-in model provider")
    up.set_defaults(handler=cmd_up)
    sub.add_parser("demo", help="the two-company demo, with a Runtime crash").set_defaults(handler=cmd_demo)
    sub.add_parser("migrate", help="apply schema migrations to DATABASE_URL").set_defaults(handler=cmd_migrate)

    company = sub.add_parser("company", help="companies (admin)").add_subparsers(dest="action", required=True)
    create = company.add_parser("create", help="create a company")
    create.add_argument("name")
    create.set_defaults(handler=cmd_company_create)

    keys = sub.add_parser("keys", help="API keys (admin)").add_subparsers(dest="action", required=True)
    kc = keys.add_parser("create", help="make an API key for a company")
    kc.add_argument("--company", required=True)
    kc.add_argument("--label", default="")
    kc.set_defaults(handler=cmd_keys_create)
    kr = keys.add_parser("revoke", help="revoke a key at once")
    kr.add_argument("key_id")
    kr.set_defaults(handler=cmd_keys_revoke)
    kl = keys.add_parser("list", help="list a company's keys")
    kl.add_argument("--company", required=True)
    kl.set_defaults(handler=cmd_keys_list)

    post = sub.add_parser("post", help=f"post a message as a person of your company (needs {API_KEY_ENV})")
    post.add_argument("--room", required=True)
    post.add_argument("--person", required=True)
    post.add_argument("--mention", action="append", help="an agent id to wake (repeatable)")
    post.add_argument("body")
    post.set_defaults(handler=cmd_post)
    runs = sub.add_parser("runs", help="your agents' runs, newest first, with trace ids")
    runs.add_argument("--agent")
    runs.add_argument("--limit", type=int, default=20)
    runs.set_defaults(handler=cmd_runs)
    run = sub.add_parser("run", help="one run's full ledger record")
    run.add_argument("run_id")
    run.set_defaults(handler=cmd_run)
    room = sub.add_parser("room", help="rooms (as your company)").add_subparsers(dest="action", required=True)
    rc = room.add_parser("create", help="create a room; your company is its first member")
    rc.add_argument("name")
    rc.set_defaults(handler=cmd_room_create)
    ri = room.add_parser("invite", help="invite another company; it becomes a member when it accepts")
    ri.add_argument("room")
    ri.add_argument("company")
    ri.set_defaults(handler=cmd_room_invite)
    rl = room.add_parser("leave", help="leave a room (its creator cannot); you lose access at once")
    rl.add_argument("room")
    rl.set_defaults(handler=cmd_room_leave)
    rr = room.add_parser("remove-member", help="remove a member company (the room's creator only)")
    rr.add_argument("room")
    rr.add_argument("company")
    rr.set_defaults(handler=cmd_room_remove_member)
    iv = sub.add_parser("invitations", help="invitations to your company (pending ones by default)")
    iv.add_argument("--status", choices=list(INVITATION_STATUSES), default="pending")
    iv.add_argument("--limit", type=int, default=50)
    iv.set_defaults(handler=cmd_invitations)
    invitation = sub.add_parser("invitation", help="answer an invitation to your company").add_subparsers(
        dest="action", required=True
    )
    ia = invitation.add_parser("accept", help="accept: your company becomes a member of the room")
    ia.add_argument("invitation_id")
    ia.set_defaults(handler=cmd_invitation_accept)
    idc = invitation.add_parser("decline", help="decline: your company does not join the room")
    idc.add_argument("invitation_id")
    idc.set_defaults(handler=cmd_invitation_decline)
    agent = sub.add_parser("agent", help="your agents").add_subparsers(dest="action", required=True)
    ar = agent.add_parser("register", help=f"register an always-on agent (provider key from {PROVIDER_KEY_ENV})")
    ar.add_argument("--name", required=True)
    ar.add_argument("--provider", required=True, choices=sorted(PROVIDERS))
    ar.add_argument("--model", required=True)
    ar.add_argument(
        "--base-url",
        help="your own model address: https to a public address unless the operator allow-lists it "
        "(one request per call, never retried)",
    )
    ar.add_argument("--system-prompt", default="")
    ar.set_defaults(handler=cmd_agent_register)
    ms = sub.add_parser("messages", help="a room's latest messages")
    ms.add_argument("--room", required=True)
    ms.add_argument("--limit", type=int, default=20)
    ms.set_defaults(handler=cmd_messages)
    rights = sub.add_parser("rights", help="your agents' rights (auto, hold, deny)").add_subparsers(
        dest="action", required=True
    )
    rs = rights.add_parser("set", help="set the default for all your agents, or --agent's own")
    rs.add_argument("--agent")
    for field in RIGHT_FIELDS:
        rs.add_argument(f"--{field.replace('_', '-')}", dest=field, choices=sorted(RIGHTS))
    rs.set_defaults(handler=cmd_rights_set)
    rg = rights.add_parser("show", help="effective rights of the default or --agent")
    rg.add_argument("--agent")
    rg.set_defaults(handler=cmd_rights_show)
    ap = sub.add_parser("approvals", help="held actions waiting for your decision")
    ap.add_argument("--limit", type=int, default=50)
    ap.set_defaults(handler=cmd_approvals)
    dc = sub.add_parser("decide", help="approve or deny one held action")
    dc.add_argument("token")
    dc.add_argument("index", type=int)
    dc.add_argument("decision", choices=["approve", "deny"])
    dc.add_argument("--person", required=True)
    dc.set_defaults(handler=cmd_decide)
    return p


def main(argv: list[str] | None = None) -> None:
    opts = parser().parse_args(argv)
    handler: Handler = opts.handler
    try:
        code: int = asyncio.run(handler(opts))
    except grpc.aio.AioRpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    raise SystemExit(code)


if __name__ == "__main__":
    main()
