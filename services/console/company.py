"""The company's own pages: its agents, their rights, its API keys, its invitations."""

from __future__ import annotations

import asyncio
from typing import Any

from google.protobuf.field_mask_pb2 import FieldMask
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from quayutec.v1 import common_pb2, gateway_pb2
from services.client import GatewayClient
from services.console.rooms import answer_invitation
from services.console.session import CALL_SECONDS, Session, check_confirm_key, form_of
from services.console.web import PAGE, FormError, Refusal, field, no_store, page, typed

# Agents shown per page: each costs two Gateway calls (its rights, its last runs).
AGENTS_PAGE = 20
LAST_RUNS = 3
RIGHTS = (
    ("remember", "Write to memory"),
    ("create_task", "Send a task"),
    ("update_task", "Add a note to a task"),
    ("close_task", "Close a task"),
    ("cross_company_task", "Send a task to another company's agent"),
)
# The rights as the agents page names them, briefly.
SHORT_RIGHTS = (
    ("remember", "remember"),
    ("create_task", "send task"),
    ("update_task", "note"),
    ("close_task", "close"),
    ("cross_company_task", "cross-company"),
)
RIGHT_NAMES = {v: "" if not v else k.removeprefix("ACTION_RIGHT_").lower() for k, v in common_pb2.ActionRight.items()}
RIGHT_VALUES = {name: value for value, name in RIGHT_NAMES.items()}
PROVIDERS = {
    common_pb2.PROVIDER_UNSPECIFIED: "unknown provider",
    common_pb2.PROVIDER_ANTHROPIC: "Anthropic",
    common_pb2.PROVIDER_OPENAI: "OpenAI",
    common_pb2.PROVIDER_OPENAI_COMPATIBLE: "OpenAI-compatible",
}
INVITATION_STATUS = {v: k.removeprefix("INVITATION_STATUS_").lower() for k, v in common_pb2.InvitationStatus.items()}


def _effective(rights: common_pb2.AgentRights) -> dict[str, str]:
    return {f: RIGHT_NAMES[getattr(rights, f)] for f, _ in RIGHTS}


async def _manage_agent(s: Session, form: Any) -> str:
    """Rename or retire the form's agent (its own company only: the Room's rule `own-agent`)."""
    agent_id = field(form, "agent_id", "The agent", limit=64)
    if form.get("action") == "retire":
        got = await s.call("RetireAgent", gateway_pb2.RetireAgentRequest(agent_id=agent_id))
        return f"{got.agent.name} is retired: it wakes no more; its runs and messages stay."
    name = field(form, "name", "The new name", limit=200)
    got = await s.call("RenameAgent", gateway_pb2.RenameAgentRequest(agent_id=agent_id, name=name))
    return f"Renamed to {got.agent.name}."


async def agents(request: Request) -> Response:
    s = Session(request)
    notice = error = ""
    if request.method == "POST":
        with Refusal() as refused:
            notice = await _manage_agent(s, await form_of(request))
        error = refused.text
    token = request.query_params.get("page", "")[:500]
    listed = await s.call("ListAgents", gateway_pb2.ListAgentsRequest(page_size=AGENTS_PAGE, page_token=token))

    async def row(a: common_pb2.Agent) -> dict[str, Any]:
        rights, runs = await asyncio.gather(
            s.call("GetAgentRights", gateway_pb2.GetAgentRightsRequest(agent_id=a.agent_id)),
            s.call("ListRuns", gateway_pb2.ListRunsRequest(agent_id=a.agent_id, page_size=LAST_RUNS)),
        )
        return {"agent": a, "rights": _effective(rights.effective), "runs": runs.runs}

    rows = await asyncio.gather(*(row(a) for a in listed.agents))
    context = {
        "title": "Agents",
        "rows": rows,
        "providers": PROVIDERS,
        "right_labels": SHORT_RIGHTS,
        "next_page": listed.next_page_token,
        "notice": notice,
        "error": error,
    }
    return page(request, "agents.html", context, 400 if error else 200)


async def rights(request: Request) -> Response:
    s = Session(request)
    agent_id = request.query_params.get("agent", "")[:64]
    notice = error = ""
    if request.method == "POST":
        form = await form_of(request)
        with Refusal() as refused:
            agent_id = field(form, "agent_id", "The agent", required=False, limit=64)
            notice = await _save_rights(s, agent_id, form)
        error = refused.text
    got, listed = await asyncio.gather(
        s.call("GetAgentRights", gateway_pb2.GetAgentRightsRequest(agent_id=agent_id)),
        s.call("ListAgents", gateway_pb2.ListAgentsRequest(page_size=500)),
    )
    stored = got.agent if agent_id else got.company_default
    rows = []
    for name, label in RIGHTS:
        own = RIGHT_NAMES[getattr(stored, name)]
        default = RIGHT_NAMES[getattr(got.company_default, name)]
        if agent_id:
            inherited, source = default or "auto", "the company default" if default else "the built-in default"
        else:
            inherited, source = "auto", "the built-in default"
        effective = RIGHT_NAMES[getattr(got.effective, name)] if agent_id else own or "auto"
        rows.append(
            {
                "field": name,
                "label": label,
                "stored": own,
                "inherited": inherited,
                "source": source,
                "effective": effective,
            }
        )
    agent_name = next((a.name for a in listed.agents if a.agent_id == agent_id), "")
    title = f"Rights of {agent_name}" if agent_id else "Rights: the company default"
    context = {"title": title, "rows": rows, "agents": listed.agents, "agent_id": agent_id, "notice": notice}
    return page(request, "rights.html", context | {"error": error}, 400 if error else 200)


async def _save_rights(s: Session, agent_id: str, form: Any) -> str:
    """SetAgentRights with only the rights this form changed (the field mask): a colleague who changed
    another right meanwhile keeps it."""
    changed: dict[str, str] = {}
    for name, _ in RIGHTS:
        now, was = str(form.get(name) or ""), str(form.get(f"was_{name}") or "")
        if now not in RIGHT_VALUES or was not in RIGHT_VALUES:
            raise FormError(f"{name} must be inherit, auto, hold or deny.")
        if now != was:
            changed[name] = now
    if not changed:
        return "Nothing changed."
    request = gateway_pb2.SetAgentRightsRequest(agent_id=agent_id, update_mask=FieldMask(paths=sorted(changed)))
    for name, value in changed.items():
        setattr(request, name, RIGHT_VALUES[value])
    await s.call("SetAgentRights", request)
    said = ", ".join(f"{n.replace('_', ' ')}: {v or 'inherit'}" for n, v in changed.items())
    return f"Saved {said}."


async def keys(request: Request) -> Response:
    s = Session(request)
    sessions = request.query_params.get("sessions") == "1"
    token = request.query_params.get("page", "")[:500]
    notice = error = ""
    made = None
    kept: dict[str, str] = {}
    if request.method == "POST":
        form = await form_of(request)
        with Refusal() as refused:
            if revoke := field(form, "revoke", "The key", required=False, limit=64):
                got = await s.call("RevokeApiKey", gateway_pb2.RevokeApiKeyRequest(key_id=revoke))
                if got.key.current:  # this sign-in's own key: the sign-in has ended with it
                    s.request.session.clear()
                    return RedirectResponse("/signin", 303)
                notice = f"Revoked the key {got.key.label or got.key.key_id[:8]}: it stops working everywhere at once."
            else:
                kept = typed(form, "label")
                made = await _make_key(s, field(form, "label", "The label", required=False, limit=200), form)
                notice = "Made a new key."
                kept = {}
        error = refused.text
    listed = await s.call(
        "ListApiKeys", gateway_pb2.ListApiKeysRequest(include_sessions=sessions, page_size=PAGE, page_token=token)
    )
    context = {
        "title": "API keys",
        "keys": listed.keys,
        "sessions": sessions,
        "next_page": listed.next_page_token,
        "made": made,
        "kept": kept,
        "notice": notice,
        "error": error,
    }
    return no_store(page(request, "keys.html", context, 400 if error else 200))


async def _make_key(s: Session, label: str, form: Any) -> gateway_pb2.CreateApiKeyResponse:
    """A new company key, made with the company key typed to confirm (a session key may not make one);
    the typed key is used for this call only."""
    confirm = field(form, "confirm_key", "Your company's API key", limit=512)
    await check_confirm_key(s, confirm)
    made: gateway_pb2.CreateApiKeyResponse = await GatewayClient(s.request.app.state.channel, confirm).CreateApiKey(
        gateway_pb2.CreateApiKeyRequest(label=label), timeout=CALL_SECONDS
    )
    return made


async def invitations(request: Request) -> Response:
    s = Session(request)
    notice = error = ""
    kept: dict[str, str] = {}
    if request.method == "POST":
        form = await form_of(request)
        with Refusal() as refused:
            if form.get("answer") == "invite":
                kept = typed(form, "room_id", "company_id")
                got = await s.call(
                    "InviteCompany",
                    gateway_pb2.InviteCompanyRequest(
                        room_id=field(form, "room_id", "The room", limit=64),
                        company_id=field(form, "company_id", "The company's id", limit=64),
                    ),
                )
                notice = f"Invited {got.invitation.company_name} into {got.invitation.room_name}."
                kept = {}
            else:
                notice = await answer_invitation(s, form)
        error = refused.text

    def listing(status: common_pb2.InvitationStatus.ValueType, *, sent: bool = False) -> Any:
        return s.call("ListInvitations", gateway_pb2.ListInvitationsRequest(status=status, sent=sent, page_size=PAGE))

    pending, accepted, declined = (
        common_pb2.INVITATION_STATUS_PENDING,
        common_pb2.INVITATION_STATUS_ACCEPTED,
        common_pb2.INVITATION_STATUS_DECLINED,
    )
    received, got_accepted, got_declined, sent_pending, sent_accepted, sent_declined, rooms = await asyncio.gather(
        listing(pending),
        listing(accepted),
        listing(declined),
        listing(pending, sent=True),
        listing(accepted, sent=True),
        listing(declined, sent=True),
        s.call("ListRooms", gateway_pb2.ListRoomsRequest(page_size=500)),
    )

    def newest(*pages: Any) -> list[common_pb2.Invitation]:
        found = [i for p in pages for i in p.invitations]
        return sorted(found, key=lambda i: i.responded_at.seconds or i.created_at.seconds, reverse=True)

    context = {
        "title": "Invitations",
        "received": received.invitations,
        "answered": newest(got_accepted, got_declined),
        "sent": newest(sent_pending, sent_accepted, sent_declined),
        "rooms": rooms.rooms,
        "invitation_status": INVITATION_STATUS,
        "kept": kept,
        "notice": notice,
        "error": error,
    }
    return page(request, "invitations.html", context, 400 if error else 200)
