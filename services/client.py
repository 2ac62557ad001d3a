"""A Gateway client for the CLI and the demo: every call carries the company's API key."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from quayutec.jaeger import trace_ids, trace_page
from quayutec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

API_KEY_ENV = "QUAYUTEC_API_KEY"


class CommandError(Exception):
    """A command cannot go on; the message says what to fix."""


class GatewayClient:
    """``client.PostMessage(request)`` and so on, authenticated as one company."""

    def __init__(self, channel: grpc.aio.Channel, api_key: str) -> None:
        self._stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._stub, name)

        def call(request: Any, **kwargs: Any) -> Any:
            return method(request, metadata=self._metadata, **kwargs)

        return call


NOT_TRACED = "(not traced)"
STATUS_NAMES = {v: k.removeprefix("RUN_STATUS_").lower() for k, v in common_pb2.RunStatus.items()}
STEP_NAMES = {v: k.removeprefix("RUN_STEP_").lower() for k, v in common_pb2.RunStep.items()}
OUTCOME_NAMES = {v: k.removeprefix("ACTION_OUTCOME_").lower() for k, v in common_pb2.ActionOutcome.items()}
ACTION_NAMES = {v: k.removeprefix("ACTION_KIND_").lower() for k, v in common_pb2.ActionKind.items()}


WAKE_NAMES = {
    common_pb2.WAKE_KIND_MESSAGE: "a message",
    common_pb2.WAKE_KIND_TASK: "a task",
    common_pb2.WAKE_KIND_DECISION: "a decision on a held action",
}
TASK_STATUS_NAMES = {v: k.removeprefix("TASK_STATUS_").lower() for k, v in common_pb2.TaskStatus.items()}


def format_run(run: common_pb2.Run, jaeger_url: str = "", *, agent: str = "", room: str = "") -> str:
    """A run's ledger row as a person reads it: its traces (each with its Jaeger page when
    ``jaeger_url``, the UI's base address, is given), what was posted, written, not written, each
    request. ``agent`` and ``room`` are their names when the caller knows them (else the ids are shown)."""
    woken_by = WAKE_NAMES.get(run.wake_kind, "")
    lines = [
        f"run {run.run_id}  status={STATUS_NAMES[run.status]}  last step={STEP_NAMES[run.step]}",
        f"  agent {agent or run.agent_id}"
        + (f"  room {room or run.room_id}" if room or run.room_id else "")
        + (f"  woken by {woken_by}" if woken_by else "")
        + f"  active {run.active_ms} ms",
        *format_traces(run, jaeger_url),
        f"  posted: {'a reply' if run.posted_message_id else 'nothing'}",
    ]
    for action in run.actions:
        detail = f" ({action.detail})" if action.detail else ""
        if action.rule:
            detail += f" [rule {action.rule}]"
        lines.append(f"  action #{action.index} {ACTION_NAMES[action.kind]}: {OUTCOME_NAMES[action.outcome]}{detail}")
    for attempt in run.model_attempts:
        wait = f", waited {attempt.wait_seconds:g} s" if attempt.wait_seconds else ""
        lines.append(f"  model request {attempt.number}: {attempt.status_code} {attempt.error_class}{wait}")
    if run.error:
        lines.append(f"  error: {run.error}")
    return "\n".join(lines)


def run_traces(run: common_pb2.Run, jaeger_url: str = "") -> list[dict[str, str | None]]:
    """Each trace of the run, its first first, then one per continuation: its id and its Jaeger
    page (None without ``jaeger_url``)."""
    return [
        {"trace_id": trace_id, "link": trace_page(jaeger_url, trace_id) or None}
        for trace_id in trace_ids(run.trace_id, run.trace_ids)
    ]


def format_traces(run: common_pb2.Run, jaeger_url: str = "") -> list[str]:
    traces = run_traces(run, jaeger_url)
    if not traces:
        return [f"  trace {NOT_TRACED}"]
    lines = []
    for number, trace in enumerate(traces):
        label = "trace" if number == 0 else f"trace of continuation {number}"
        link = f"  {trace['link']}" if trace["link"] else ""
        lines.append(f"  {label} {trace['trace_id']}{link}")
    return lines


async def resolve_mentions(client: GatewayClient, room_id: str, mentions: Sequence[str]) -> list[str]:
    """Agent ids for ``--mention`` values: an id is taken as it is; a name is looked up among the
    agents in the room (every member company's), and must name exactly one of them."""
    names = [m for m in mentions if not _is_uuid(m)]
    if not names:
        return list(mentions)
    agents = await _room_agents(client, room_id)
    room = await room_name(client, room_id)
    resolved = []
    for mention in mentions:
        if _is_uuid(mention):
            resolved.append(mention)
            continue
        matches = [a for a in agents if a.name.casefold() == mention.strip().casefold()]
        if len(matches) == 1:
            resolved.append(matches[0].agent_id)
            continue
        listed = _agent_choices(matches or agents)
        if matches:
            raise CommandError(
                f"{len(matches)} agents in room {room!r} are named {mention!r}: {listed}; mention one by its id"
            )
        raise CommandError(
            f"no agent named {mention!r} in room {room!r}; "
            + (f"the agents there: {listed}" if agents else "no company in it has an agent yet")
        )
    return resolved


async def _room_agents(client: GatewayClient, room_id: str) -> list[common_pb2.Agent]:
    """Every agent in the room, all pages."""
    agents: list[common_pb2.Agent] = []
    token = ""
    while True:
        page = await client.ListAgents(gateway_pb2.ListAgentsRequest(room_id=room_id, page_size=500, page_token=token))
        agents.extend(page.agents)
        token = page.next_page_token
        if not token:
            return agents


def _agent_choices(agents: Sequence[common_pb2.Agent]) -> str:
    return "; ".join(f"{a.name} ({a.company_name or a.company_id}'s agent {a.agent_id})" for a in agents)


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


async def resolve_room(client: GatewayClient, room: str) -> str:
    """The room id for a ``--room`` value: an id is taken as it is; a name is looked up among the rooms
    of the caller's company, and must name exactly one of them."""
    if _is_uuid(room):
        return room
    rooms = await own_rooms(client)
    matches = [r for r in rooms if r.name.casefold() == room.strip().casefold()]
    if len(matches) == 1:
        return str(matches[0].room_id)
    if matches:
        listed = "; ".join(f"{r.name} (room {r.room_id})" for r in matches)
        raise CommandError(f"{len(matches)} of your rooms are named {room!r}: {listed}; give one by its id")
    names = ", ".join(sorted(r.name for r in rooms)[:20])
    raise CommandError(
        f"your company is in no room named {room!r}; " + (f"its rooms: {names}" if rooms else "it is in no room yet")
    )


async def resolve_own_agent(client: GatewayClient, agent: str) -> str:
    """The agent id for an ``--agent`` value: an id as it is, or the name of one of the company's agents."""
    if _is_uuid(agent):
        return agent
    own: gateway_pb2.ListAgentsResponse = await client.ListAgents(gateway_pb2.ListAgentsRequest(page_size=500))
    matches = [a for a in own.agents if a.name.casefold() == agent.strip().casefold()]
    if len(matches) == 1:
        return str(matches[0].agent_id)
    if matches:
        raise CommandError(f"{len(matches)} of your agents are named {agent!r}: {_agent_choices(matches)}; use its id")
    names = ", ".join(sorted(a.name for a in own.agents)[:20])
    raise CommandError(
        f"your company has no agent named {agent!r}; "
        + (f"its agents: {names}" if own.agents else "`quayutec agent register` adds one")
    )


async def room_names(client: GatewayClient, room_id: str) -> tuple[dict[str, str], dict[str, str]]:
    """Company names (id -> name) of the room's members, and agent names (id -> name) of its agents."""
    members = await client.ListMembers(gateway_pb2.ListMembersRequest(room_id=room_id, page_size=500))
    companies = {m.company_id: m.company_name for m in members.members}
    agents = {a.agent_id: a.name for a in await _room_agents(client, room_id)}
    return companies, agents


async def own_rooms(client: GatewayClient) -> list[common_pb2.Room]:
    rooms: list[common_pb2.Room] = []
    token = ""
    while True:
        page = await client.ListRooms(gateway_pb2.ListRoomsRequest(page_size=500, page_token=token))
        rooms.extend(page.rooms)
        token = page.next_page_token
        if not token:
            return rooms


async def known_companies(client: GatewayClient, room_id: str = "") -> dict[str, str]:
    """Company names (id -> name) the caller can see: the members of ``room_id`` alone when given, else
    the members of each of its rooms and the companies of every invitation it sent or received."""
    if room_id:
        members = await client.ListMembers(gateway_pb2.ListMembersRequest(room_id=room_id, page_size=500))
        return {m.company_id: m.company_name for m in members.members}
    known: dict[str, str] = {}
    for room in await own_rooms(client):
        members = await client.ListMembers(gateway_pb2.ListMembersRequest(room_id=room.room_id, page_size=500))
        known |= {m.company_id: m.company_name for m in members.members}
    for status in (
        common_pb2.INVITATION_STATUS_PENDING,
        common_pb2.INVITATION_STATUS_ACCEPTED,
        common_pb2.INVITATION_STATUS_DECLINED,
        common_pb2.INVITATION_STATUS_WITHDRAWN,
    ):
        for sent in (False, True):
            got = await client.ListInvitations(
                gateway_pb2.ListInvitationsRequest(status=status, sent=sent, page_size=500)
            )
            for inv in got.invitations:
                known[inv.company_id] = inv.company_name
                known[inv.invited_by_company_id] = inv.invited_by_company_name
    return known


async def resolve_company(client: GatewayClient, company: str, *, member_of: str = "") -> tuple[str, str]:
    """The (id, name) of a company given by name or id: a name is looked up among the members of
    ``member_of`` when given, else among the companies the caller knows (see ``known_companies``)."""
    if _is_uuid(company):
        known = await known_companies(client, member_of) if member_of else {}
        return company, known.get(company, f"company {company}")
    known = await known_companies(client, member_of)
    matches = [(i, n) for i, n in known.items() if n.casefold() == company.strip().casefold()]
    if len(matches) == 1:
        return matches[0]
    where = "a member of that room" if member_of else "known to your company (a member of one of its rooms, or invited)"
    if matches:
        listed = "; ".join(f"{n} (company {i})" for i, n in matches)
        raise CommandError(f"{len(matches)} companies {where} are named {company!r}: {listed}; give one by its id")
    raise CommandError(
        f"no company named {company!r} is {where}; give its id instead (the other company's admin sees it "
        "in `quayutec company list`)"
    )


async def room_name(client: GatewayClient, room_id: str) -> str:
    """The room's name, or ``room <id>`` when the caller's company cannot see it."""
    return next((r.name for r in await own_rooms(client) if r.room_id == room_id), f"room {room_id}")
