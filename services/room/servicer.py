"""gRPC adapter of RoomService: validate the request, call the store, answer with protos."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from datetime import UTC
from typing import Any, TypeAlias

import grpc

from quayutec.egress import EgressPolicy, EgressRefused, ResolutionFailed, Resolver, system_resolver
from quayutec.errors import InvalidArgument, ServiceError, Unavailable
from quayutec.ratelog import RateLimitedLog
from quayutec.telemetry import annotate
from quayutec.v1 import common_pb2, room_pb2, room_pb2_grpc
from services.room import convert
from services.room import validate as v
from services.room.passages import split_passages
from services.room.rules import agent_fields_seen
from services.room.store import HeldSpec, RoomStore, RunFilters, RunRecord, WakeToSettle

Ctx: TypeAlias = grpc.aio.ServicerContext
_registration_log = logging.getLogger("quayutec.room.registration")

_PROVIDERS = {
    common_pb2.PROVIDER_ANTHROPIC: "anthropic",
    common_pb2.PROVIDER_OPENAI: "openai",
    common_pb2.PROVIDER_OPENAI_COMPATIBLE: "openai_compatible",
}
_CLOSING = {common_pb2.TASK_STATUS_DONE: "done", common_pb2.TASK_STATUS_CANCELLED: "cancelled"}
_TASK_FILTER = {common_pb2.TASK_STATUS_OPEN: "open", **_CLOSING}
_VISIBILITY = {common_pb2.MEMORY_VISIBILITY_ROOM: "room", common_pb2.MEMORY_VISIBILITY_COMPANY: "company"}
_RIGHTS = {
    common_pb2.ACTION_RIGHT_AUTO: "auto",
    common_pb2.ACTION_RIGHT_HOLD: "hold",
    common_pb2.ACTION_RIGHT_DENY: "deny",
}
_ACTION_KINDS = {
    common_pb2.ACTION_KIND_REMEMBER: "remember",
    common_pb2.ACTION_KIND_CREATE_TASK: "create_task",
    common_pb2.ACTION_KIND_UPDATE_TASK: "update_task",
    common_pb2.ACTION_KIND_CLOSE_TASK: "close_task",
}
_WAITPOINT_STATUS = {
    common_pb2.WAITPOINT_STATUS_PENDING: "pending",
    common_pb2.WAITPOINT_STATUS_COMPLETED: "completed",
    common_pb2.WAITPOINT_STATUS_EXPIRED: "expired",
}
_INVITATION_STATUS = {
    common_pb2.INVITATION_STATUS_PENDING: "pending",
    common_pb2.INVITATION_STATUS_ACCEPTED: "accepted",
    common_pb2.INVITATION_STATUS_DECLINED: "declined",
    common_pb2.INVITATION_STATUS_WITHDRAWN: "withdrawn",
}
_PARKED_STATUS = (common_pb2.RUN_STATUS_UNSPECIFIED, common_pb2.RUN_STATUS_PARKED)
_PARKED_STEP = (common_pb2.RUN_STEP_UNSPECIFIED, common_pb2.RUN_STEP_PARKED)
# Most wakes one SettleWakes call settles (as many as one LeaseWakes call leases).
MAX_SETTLE_WAKES = 500


def _wake_to_settle(
    item: room_pb2.RoomServiceSettleWakeRequest | room_pb2.WakeToSettle, prefix: str = ""
) -> WakeToSettle:
    """One settlement (a SettleWake request, or an item of SettleWakes whose fields are named under
    ``prefix``), checked: DELIVERED, or RETRY with its delay in range and its error cut to size."""
    wake_id = v.required_id(item.wake_id, f"{prefix}wake_id")
    owner = v.text(item.lease_owner, f"{prefix}lease_owner", v.MAX_KEY_BYTES)
    if item.settlement == room_pb2.WAKE_SETTLEMENT_DELIVERED:
        return WakeToSettle(wake_id, owner, delivered=True)
    if item.settlement == room_pb2.WAKE_SETTLEMENT_RETRY:
        retry_after_ms = v.in_range(item.retry_after_ms, f"{prefix}retry_after_ms", 0, v.MAX_RETRY_AFTER_MS)
        last_error = item.last_error.replace("\x00", "")[: v.MAX_LAST_ERROR_CHARS]
        return WakeToSettle(wake_id, owner, False, retry_after_ms, last_error)
    raise InvalidArgument(f"{prefix}settlement must be WAKE_SETTLEMENT_DELIVERED or WAKE_SETTLEMENT_RETRY")


def _resume(scope: str, rows: Sequence[Any], key: str, page_token: str) -> str:
    """An oldest-first page's resume_page_token: after its last row, or where it started when empty."""
    if rows:
        return v.encode_page_token(scope, int(rows[-1][key]))
    return page_token


def _agent_as_seen(agent: common_pb2.Agent, reader: str) -> common_pb2.Agent:
    """``agent`` as company ``reader`` may see it in a room they share (the rule `room-agents`)."""
    fields = agent_fields_seen(reader, agent.company_id)
    if fields is None:
        return agent
    seen = common_pb2.Agent()
    for name in fields:
        if name == "created_at":
            seen.created_at.CopyFrom(agent.created_at)
        elif name == "retired_at":
            if agent.HasField("retired_at"):
                seen.retired_at.CopyFrom(agent.retired_at)
        else:
            setattr(seen, name, getattr(agent, name))
    return seen


def _run_filters(request: room_pb2.RoomServiceListRunsRequest) -> tuple[RunFilters, str]:
    """ListRuns' filters, and the page-token scope that ties a token to them."""
    status = None
    if request.status:
        if request.status not in common_pb2.RunStatus.values():
            raise InvalidArgument(f"status {request.status} is not a RunStatus")
        status = convert.enum_to_text(common_pb2.RunStatus, request.status, convert.RUN_STATUS_PREFIX)
    after = request.started_after.ToDatetime(UTC) if request.HasField("started_after") else None
    before = request.started_before.ToDatetime(UTC) if request.HasField("started_before") else None
    if after is not None and before is not None and before <= after:
        raise InvalidArgument("started_before must be later than started_after")
    filters = RunFilters(v.optional_id(request.room_id, "room_id"), status, after, before)
    if filters == RunFilters():
        return filters, "runs"
    named = "|".join(str(x) for x in (filters.room_id, status, after, before))
    return filters, "runs-" + hashlib.sha256(named.encode()).hexdigest()[:16]


class RoomServicer(room_pb2_grpc.RoomServiceServicer):
    """Every RoomService RPC over a ``RoomStore``; error codes come from quayutec.errors."""

    def __init__(
        self,
        store: RoomStore,
        egress: EgressPolicy | None = None,
        resolver: Resolver | None = None,
        *,
        event_retention_hours: float = 168.0,
    ) -> None:
        self._store = store
        self._egress = egress or EgressPolicy()
        self._resolver = resolver or system_resolver
        self._event_retention_hours = event_retention_hours
        # One line per refused registration, no traceback; anyone with a key can cause them, so bounded.
        self._refusals = RateLimitedLog(_registration_log)

    # -- companies, rooms, members --------------------------------------------------------------------------

    async def CreateCompany(
        self, request: room_pb2.RoomServiceCreateCompanyRequest, context: Ctx
    ) -> room_pb2.RoomServiceCreateCompanyResponse:
        row = await self._store.create_company(v.text(request.name, "name", v.MAX_NAME_BYTES))
        return room_pb2.RoomServiceCreateCompanyResponse(company=convert.company(row))

    async def GetCompany(
        self, request: room_pb2.RoomServiceGetCompanyRequest, context: Ctx
    ) -> room_pb2.RoomServiceGetCompanyResponse:
        row = await self._store.get_company(v.required_id(request.company_id, "company_id"))
        return room_pb2.RoomServiceGetCompanyResponse(company=convert.company(row))

    async def CreateRoom(
        self, request: room_pb2.RoomServiceCreateRoomRequest, context: Ctx
    ) -> room_pb2.RoomServiceCreateRoomResponse:
        company_id = v.required_id(request.company_id, "company_id")
        row = await self._store.create_room(
            company_id,
            v.text(request.name, "name", v.MAX_NAME_BYTES).strip(),
            v.dedupe_key(request.dedupe_key),
        )
        return room_pb2.RoomServiceCreateRoomResponse(room=convert.room(row))

    async def RenameRoom(
        self, request: room_pb2.RoomServiceRenameRoomRequest, context: Ctx
    ) -> room_pb2.RoomServiceRenameRoomResponse:
        room_id = v.required_id(request.room_id, "room_id")
        company_id = v.required_id(request.company_id, "company_id")
        name = v.text(request.name, "name", v.MAX_NAME_BYTES).strip()
        row = await self._store.rename_room(room_id, company_id, name)
        return room_pb2.RoomServiceRenameRoomResponse(room=convert.room(row))

    async def ArchiveRoom(
        self, request: room_pb2.RoomServiceArchiveRoomRequest, context: Ctx
    ) -> room_pb2.RoomServiceArchiveRoomResponse:
        room_id = v.required_id(request.room_id, "room_id")
        row = await self._store.archive_room(room_id, v.required_id(request.company_id, "company_id"))
        return room_pb2.RoomServiceArchiveRoomResponse(room=convert.room(row))

    async def GetRoom(
        self, request: room_pb2.RoomServiceGetRoomRequest, context: Ctx
    ) -> room_pb2.RoomServiceGetRoomResponse:
        room_id = v.required_id(request.room_id, "room_id")
        member = v.optional_id(request.member_company_id, "member_company_id")
        return room_pb2.RoomServiceGetRoomResponse(room=convert.room(await self._store.get_room(room_id, member)))

    async def ListRooms(
        self, request: room_pb2.RoomServiceListRoomsRequest, context: Ctx
    ) -> room_pb2.RoomServiceListRoomsResponse:
        company_id = v.required_id(request.company_id, "company_id")
        page = await self._store.list_rooms(
            company_id, v.decode_page_token(request.page_token, "rooms"), v.page_size(request.page_size)
        )
        return room_pb2.RoomServiceListRoomsResponse(
            rooms=[convert.room(r) for r in page.rows],
            next_page_token=v.encode_page_token("rooms", page.next_key),
            resume_page_token=_resume("rooms", page.rows, "pos", request.page_token),
        )

    async def CreateInvitation(
        self, request: room_pb2.RoomServiceCreateInvitationRequest, context: Ctx
    ) -> room_pb2.RoomServiceCreateInvitationResponse:
        room_id = v.required_id(request.room_id, "room_id")
        company_id = v.required_id(request.company_id, "company_id")
        inviter = v.required_id(request.invited_by_company_id, "invited_by_company_id")
        key = v.dedupe_key(request.dedupe_key)
        row = await self._store.create_invitation(room_id, company_id, inviter, key)
        return room_pb2.RoomServiceCreateInvitationResponse(invitation=convert.invitation(row))

    async def ListInvitations(
        self, request: room_pb2.RoomServiceListInvitationsRequest, context: Ctx
    ) -> room_pb2.RoomServiceListInvitationsResponse:
        company_id = v.required_id(request.company_id, "company_id")
        status = _INVITATION_STATUS.get(request.status or common_pb2.INVITATION_STATUS_PENDING)
        if status is None:
            raise InvalidArgument(f"status {request.status} is not an InvitationStatus")
        scope = f"invitations-{'sent-' if request.sent else ''}{status}"
        page = await self._store.list_invitations(
            company_id,
            status,
            v.decode_page_token(request.page_token, scope),
            v.page_size(request.page_size),
            sent=request.sent,
        )
        return room_pb2.RoomServiceListInvitationsResponse(
            invitations=[convert.invitation(r) for r in page.rows],
            next_page_token=v.encode_page_token(scope, page.next_key),
            resume_page_token=_resume(scope, page.rows, "pos", request.page_token),
        )

    async def AcceptInvitation(
        self, request: room_pb2.RoomServiceAcceptInvitationRequest, context: Ctx
    ) -> room_pb2.RoomServiceAcceptInvitationResponse:
        invitation_id = v.required_id(request.invitation_id, "invitation_id")
        invitation, member = await self._store.accept_invitation(
            invitation_id, v.required_id(request.company_id, "company_id")
        )
        return room_pb2.RoomServiceAcceptInvitationResponse(
            invitation=convert.invitation(invitation), member=convert.member(member)
        )

    async def DeclineInvitation(
        self, request: room_pb2.RoomServiceDeclineInvitationRequest, context: Ctx
    ) -> room_pb2.RoomServiceDeclineInvitationResponse:
        invitation_id = v.required_id(request.invitation_id, "invitation_id")
        row = await self._store.decline_invitation(invitation_id, v.required_id(request.company_id, "company_id"))
        return room_pb2.RoomServiceDeclineInvitationResponse(invitation=convert.invitation(row))

    async def ListRoomInvitations(
        self, request: room_pb2.RoomServiceListRoomInvitationsRequest, context: Ctx
    ) -> room_pb2.RoomServiceListRoomInvitationsResponse:
        room_id = v.required_id(request.room_id, "room_id")
        status = _INVITATION_STATUS.get(request.status or common_pb2.INVITATION_STATUS_PENDING)
        if status is None:
            raise InvalidArgument(f"status {request.status} is not an InvitationStatus")
        scope = f"room-invitations-{status}"
        page = await self._store.list_room_invitations(
            room_id,
            v.required_id(request.company_id, "company_id"),
            status,
            v.decode_page_token(request.page_token, scope),
            v.page_size(request.page_size),
        )
        return room_pb2.RoomServiceListRoomInvitationsResponse(
            invitations=[convert.invitation(r) for r in page.rows],
            next_page_token=v.encode_page_token(scope, page.next_key),
        )

    async def WithdrawInvitation(
        self, request: room_pb2.RoomServiceWithdrawInvitationRequest, context: Ctx
    ) -> room_pb2.RoomServiceWithdrawInvitationResponse:
        invitation_id = v.required_id(request.invitation_id, "invitation_id")
        row = await self._store.withdraw_invitation(invitation_id, v.required_id(request.company_id, "company_id"))
        return room_pb2.RoomServiceWithdrawInvitationResponse(invitation=convert.invitation(row))

    async def LeaveRoom(
        self, request: room_pb2.RoomServiceLeaveRoomRequest, context: Ctx
    ) -> room_pb2.RoomServiceLeaveRoomResponse:
        room_id = v.required_id(request.room_id, "room_id")
        expired = await self._store.leave_room(room_id, v.required_id(request.company_id, "company_id"))
        return room_pb2.RoomServiceLeaveRoomResponse(expired_waitpoints=expired)

    async def RemoveMember(
        self, request: room_pb2.RoomServiceRemoveMemberRequest, context: Ctx
    ) -> room_pb2.RoomServiceRemoveMemberResponse:
        room_id = v.required_id(request.room_id, "room_id")
        company_id = v.required_id(request.company_id, "company_id")
        remover = v.required_id(request.removed_by_company_id, "removed_by_company_id")
        expired = await self._store.remove_member(room_id, company_id, remover)
        return room_pb2.RoomServiceRemoveMemberResponse(expired_waitpoints=expired)

    async def ListMembers(
        self, request: room_pb2.RoomServiceListMembersRequest, context: Ctx
    ) -> room_pb2.RoomServiceListMembersResponse:
        room_id = v.required_id(request.room_id, "room_id")
        page = await self._store.list_members(
            room_id, v.decode_page_token(request.page_token, "members"), v.page_size(request.page_size)
        )
        return room_pb2.RoomServiceListMembersResponse(
            members=[convert.member(r) for r in page.rows],
            next_page_token=v.encode_page_token("members", page.next_key),
            resume_page_token=_resume("members", page.rows, "pos", request.page_token),
        )

    # -- agents ---------------------------------------------------------------------------------------------

    async def RegisterAgent(
        self, request: room_pb2.RoomServiceRegisterAgentRequest, context: Ctx
    ) -> room_pb2.RoomServiceRegisterAgentResponse:
        company_id = v.required_id(request.company_id, "company_id")
        provider = _PROVIDERS.get(request.provider)
        if provider is None:
            raise InvalidArgument("provider must be PROVIDER_ANTHROPIC, PROVIDER_OPENAI or PROVIDER_OPENAI_COMPATIBLE")
        base_url = v.base_url(request.base_url)
        if request.provider == common_pb2.PROVIDER_OPENAI_COMPATIBLE and base_url is None:
            raise InvalidArgument("base_url is required for PROVIDER_OPENAI_COMPATIBLE")
        if base_url is not None:
            refused = await self._egress_refusal(base_url)
            if refused is not None:
                error, cause = refused
                self._refusals.warning(
                    "RegisterAgent refused for company %s: %s (%s)", company_id, error.message, cause
                )
                await context.abort(error.code, error.message)
        row = await self._store.register_agent(
            company_id=company_id,
            name=v.text(request.name, "name", v.MAX_NAME_BYTES).strip(),
            provider=provider,
            model=v.text(request.model, "model", v.MAX_NAME_BYTES),
            base_url=base_url,
            provider_key=v.text(request.provider_key, "provider_key", v.MAX_PROVIDER_KEY_BYTES, required=False) or None,
            system_prompt=v.text(request.system_prompt, "system_prompt", v.MAX_BODY_BYTES, required=False),
            dedupe_key=v.dedupe_key(request.dedupe_key),
        )
        return room_pb2.RoomServiceRegisterAgentResponse(agent=convert.agent(row))

    async def RenameAgent(
        self, request: room_pb2.RoomServiceRenameAgentRequest, context: Ctx
    ) -> room_pb2.RoomServiceRenameAgentResponse:
        agent_id = v.required_id(request.agent_id, "agent_id")
        company_id = v.required_id(request.company_id, "company_id")
        name = v.text(request.name, "name", v.MAX_NAME_BYTES).strip()
        row = await self._store.rename_agent(agent_id, company_id, name)
        return room_pb2.RoomServiceRenameAgentResponse(agent=convert.agent(row))

    async def RetireAgent(
        self, request: room_pb2.RoomServiceRetireAgentRequest, context: Ctx
    ) -> room_pb2.RoomServiceRetireAgentResponse:
        agent_id = v.required_id(request.agent_id, "agent_id")
        row = await self._store.retire_agent(agent_id, v.required_id(request.company_id, "company_id"))
        return room_pb2.RoomServiceRetireAgentResponse(agent=convert.agent(row))

    async def _egress_refusal(self, base_url: str) -> tuple[ServiceError, str] | None:
        """The Runtime's egress rules, applied now so a refused address is refused at registration
        (the Runtime checks again on the address it dials): None when admitted, else the error the
        caller gets (it never says what a name resolves to) and the precise cause, for our log."""
        try:
            await self._egress.check_url(base_url, self._resolver)
        except EgressRefused as exc:
            return InvalidArgument(f"base_url refused ({exc.rule}): {exc.message}"), exc.cause
        except ResolutionFailed as exc:
            if exc.temporary:
                return Unavailable(f"base_url: {exc}; try again later"), "resolution failed, temporarily"
            return InvalidArgument(f"base_url: {exc}; name a host that resolves"), "does not resolve"
        return None

    async def GetAgent(
        self, request: room_pb2.RoomServiceGetAgentRequest, context: Ctx
    ) -> room_pb2.RoomServiceGetAgentResponse:
        row = await self._store.get_agent(v.required_id(request.agent_id, "agent_id"))
        agent = convert.agent(row)
        if request.reader_company_id:
            agent = _agent_as_seen(agent, v.required_id(request.reader_company_id, "reader_company_id"))
        return room_pb2.RoomServiceGetAgentResponse(agent=agent)

    async def ListAgents(
        self, request: room_pb2.RoomServiceListAgentsRequest, context: Ctx
    ) -> room_pb2.RoomServiceListAgentsResponse:
        if not request.company_id and not request.room_id:
            raise InvalidArgument("give company_id (a company's agents), room_id (the agents in a room) or both")
        after, limit = v.decode_page_token(request.page_token, "agents"), v.page_size(request.page_size)
        reader = v.optional_id(request.reader_company_id, "reader_company_id")
        if request.room_id:
            room_id = v.required_id(request.room_id, "room_id")
            company_id = v.required_id(request.company_id, "company_id") if request.company_id else None
            page = await self._store.list_room_agents(room_id, company_id, after, limit, reader)
        else:
            page = await self._store.list_agents(v.required_id(request.company_id, "company_id"), after, limit)
        agents = [convert.agent(r) for r in page.rows]
        if reader is not None:
            agents = [_agent_as_seen(a, reader) for a in agents]
        return room_pb2.RoomServiceListAgentsResponse(
            agents=agents,
            next_page_token=v.encode_page_token("agents", page.next_key),
            resume_page_token=_resume("agents", page.rows, "pos", request.page_token),
        )

    async def GetAgentCredentials(
        self, request: room_pb2.RoomServiceGetAgentCredentialsRequest, context: Ctx
    ) -> room_pb2.RoomServiceGetAgentCredentialsResponse:
        row, key = await self._store.get_agent_credentials(v.required_id(request.agent_id, "agent_id"))
        return room_pb2.RoomServiceGetAgentCredentialsResponse(agent=convert.agent(row), provider_key=key)

    # -- messages -------------------------------------------------------------------------------------------

    async def PostMessage(
        self, request: room_pb2.RoomServicePostMessageRequest, context: Ctx
    ) -> room_pb2.RoomServicePostMessageResponse:
        room_id = v.required_id(request.room_id, "room_id")
        author = v.author(request.author)
        body = v.text(request.body, "body", v.MAX_BODY_BYTES)
        if len(request.mention_agent_ids) > v.MAX_MENTIONS:
            raise InvalidArgument(
                f"at most {v.MAX_MENTIONS} mentions are allowed, got {len(request.mention_agent_ids)}"
            )
        mentions = list(dict.fromkeys(v.required_id(a, "mention_agent_ids") for a in request.mention_agent_ids))
        lease_owner = v.text(request.lease_owner, "lease_owner", v.MAX_KEY_BYTES) if request.lease_owner else None
        lease_seconds = v.in_range(request.lease_seconds, "lease_seconds", 1, 3600) if lease_owner else 0
        posted = await self._store.post_message(
            room_id=room_id,
            author=author,
            body=body,
            mention_agent_ids=mentions,
            run_id=v.optional_key(request.run_id, "run_id"),
            dedupe_key=v.dedupe_key(request.dedupe_key),
            run=RunRecord(_checked_run(request.run)) if request.HasField("run") else None,
            lease_owner=lease_owner,
            lease_seconds=lease_seconds,
        )
        response = room_pb2.RoomServicePostMessageResponse(
            message=convert.message(posted.row),
            wakes=[convert.wake(w) for w in posted.wakes],
            deduplicated=posted.deduplicated,
            # The new wakes are the caller's to deliver; a repeat's are whoever's they were.
            leased=lease_owner is not None and not posted.deduplicated and bool(posted.wakes),
        )
        _annotate_post(response.message.message_id, room_id, response.wakes, request.run_id)
        return response

    async def GetMessage(
        self, request: room_pb2.RoomServiceGetMessageRequest, context: Ctx
    ) -> room_pb2.RoomServiceGetMessageResponse:
        row = await self._store.get_message(
            v.required_id(request.room_id, "room_id"), v.required_id(request.message_id, "message_id")
        )
        return room_pb2.RoomServiceGetMessageResponse(message=convert.message(row))

    async def ListMessages(
        self, request: room_pb2.RoomServiceListMessagesRequest, context: Ctx
    ) -> room_pb2.RoomServiceListMessagesResponse:
        room_id = v.required_id(request.room_id, "room_id")
        scope = "messages-newest" if request.newest_first else "messages-oldest"
        page = await self._store.list_messages(
            room_id,
            v.decode_page_token(request.page_token, scope),
            v.page_size(request.page_size),
            newest_first=request.newest_first,
        )
        return room_pb2.RoomServiceListMessagesResponse(
            messages=[convert.message(r) for r in page.rows],
            next_page_token=v.encode_page_token(scope, page.next_key),
            resume_page_token="" if request.newest_first else _resume(scope, page.rows, "seq", request.page_token),
        )

    # -- tasks ----------------------------------------------------------------------------------------------

    async def CreateTask(
        self, request: room_pb2.RoomServiceCreateTaskRequest, context: Ctx
    ) -> room_pb2.RoomServiceCreateTaskResponse:
        room_id = v.required_id(request.room_id, "room_id")
        posted = await self._store.create_task(
            room_id=room_id,
            author=v.author(getattr(request, "from"), "from"),
            to_agent_id=v.required_id(request.to_agent_id, "to_agent_id"),
            title=v.text(request.title, "title", v.MAX_TITLE_BYTES),
            body=v.text(request.body, "body", v.MAX_BODY_BYTES, required=False),
            run_id=v.optional_key(request.run_id, "run_id"),
            dedupe_key=v.dedupe_key(request.dedupe_key),
            run=_run_record(request),
        )
        response = room_pb2.RoomServiceCreateTaskResponse(
            task=convert.task(posted.row),
            wakes=[convert.wake(w) for w in posted.wakes],
            deduplicated=posted.deduplicated,
        )
        annotate(room_id=room_id, wake_ids=[w.wake_id for w in response.wakes], run_id=request.run_id)
        return response

    async def UpdateTask(
        self, request: room_pb2.RoomServiceUpdateTaskRequest, context: Ctx
    ) -> room_pb2.RoomServiceUpdateTaskResponse:
        task_id = v.required_id(request.task_id, "task_id")
        room_id = v.optional_id(request.room_id, "room_id")
        author = v.author(request.author)
        note = v.text(request.note, "note", v.MAX_BODY_BYTES, required=False)
        if request.status not in common_pb2.TaskStatus.values():
            raise InvalidArgument(f"status {request.status} is not a TaskStatus")
        closing = _CLOSING.get(request.status)
        if not note.strip() and closing is None:
            raise InvalidArgument("an update needs a note or a closing status (DONE or CANCELLED)")
        result = await self._store.update_task(
            task_id=task_id,
            room_id=room_id,
            author=author,
            note=note,
            status=closing,
            run_id=v.optional_key(request.run_id, "run_id"),
            dedupe_key=v.dedupe_key(request.dedupe_key),
            run=_run_record(request),
        )
        return room_pb2.RoomServiceUpdateTaskResponse(
            task=convert.task(result.task, result.updates),
            update=convert.task_update(result.update),
            deduplicated=result.deduplicated,
        )

    async def GetTask(
        self, request: room_pb2.RoomServiceGetTaskRequest, context: Ctx
    ) -> room_pb2.RoomServiceGetTaskResponse:
        task_id = v.required_id(request.task_id, "task_id")
        task, updates = await self._store.get_task(task_id, v.optional_id(request.room_id, "room_id"))
        return room_pb2.RoomServiceGetTaskResponse(task=convert.task(task, updates))

    async def ListTasks(
        self, request: room_pb2.RoomServiceListTasksRequest, context: Ctx
    ) -> room_pb2.RoomServiceListTasksResponse:
        room_id = v.required_id(request.room_id, "room_id")
        if request.status != common_pb2.TASK_STATUS_UNSPECIFIED and request.status not in _TASK_FILTER:
            raise InvalidArgument(f"status {request.status} is not a TaskStatus")
        page, updates = await self._store.list_tasks(
            room_id,
            v.optional_id(request.to_agent_id, "to_agent_id"),
            _TASK_FILTER.get(request.status),
            v.decode_page_token(request.page_token, "tasks"),
            v.page_size(request.page_size),
        )
        return room_pb2.RoomServiceListTasksResponse(
            tasks=[convert.task(r, updates[str(r["task_id"])]) for r in page.rows],
            next_page_token=v.encode_page_token("tasks", page.next_key),
            resume_page_token=_resume("tasks", page.rows, "pos", request.page_token),
        )

    # -- memory ---------------------------------------------------------------------------------------------

    async def WriteMemory(
        self, request: room_pb2.RoomServiceWriteMemoryRequest, context: Ctx
    ) -> room_pb2.RoomServiceWriteMemoryResponse:
        room_id = v.required_id(request.room_id, "room_id")
        visibility = _VISIBILITY.get(request.visibility)
        if visibility is None:
            raise InvalidArgument("visibility must be MEMORY_VISIBILITY_ROOM or MEMORY_VISIBILITY_COMPANY")
        row, deduplicated = await self._store.write_memory(
            room_id=room_id,
            author=v.author(request.author),
            text=v.text(request.text, "text", v.MAX_MEMORY_BYTES),
            visibility=visibility,
            run_id=v.optional_key(request.run_id, "run_id"),
            dedupe_key=v.dedupe_key(request.dedupe_key),
            run=_run_record(request),
        )
        return room_pb2.RoomServiceWriteMemoryResponse(line=convert.memory_line(row), deduplicated=deduplicated)

    async def ListMemory(
        self, request: room_pb2.RoomServiceListMemoryRequest, context: Ctx
    ) -> room_pb2.RoomServiceListMemoryResponse:
        room_id = v.required_id(request.room_id, "room_id")
        reader = v.required_id(request.reader_company_id, "reader_company_id")
        query = v.text(request.query, "query", v.MAX_QUERY_BYTES, required=False).strip() or None
        page = await self._store.list_memory(
            room_id, reader, query, v.decode_page_token(request.page_token, "memory"), v.page_size(request.page_size)
        )
        return room_pb2.RoomServiceListMemoryResponse(
            lines=[convert.memory_line(r) for r in page.rows],
            next_page_token=v.encode_page_token("memory", page.next_key),
        )

    # -- files and passages ---------------------------------------------------------------------------------

    async def UploadFile(
        self, request: room_pb2.RoomServiceUploadFileRequest, context: Ctx
    ) -> room_pb2.RoomServiceUploadFileResponse:
        room_id = v.required_id(request.room_id, "room_id")
        author = v.author(request.author)
        name = v.text(request.name, "name", v.MAX_NAME_BYTES)
        content_type = v.text(request.content_type, "content_type", v.MAX_NAME_BYTES, required=False)
        content = bytes(request.content)
        if len(content) > v.MAX_FILE_BYTES:
            raise InvalidArgument(f"the file is {len(content)} bytes; at most {v.MAX_FILE_BYTES} (10 MiB) are allowed")
        try:
            decoded = content.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"the file is not UTF-8 text (invalid byte at offset {exc.start})") from None
        if "\x00" in decoded:
            raise InvalidArgument("the file is not text: it contains NUL characters")
        row = await self._store.upload_file(
            room_id=room_id,
            author=author,
            name=name,
            content_type=content_type,
            content=content,
            passages=split_passages(decoded),
        )
        return room_pb2.RoomServiceUploadFileResponse(file=convert.file(row))

    async def ListFiles(
        self, request: room_pb2.RoomServiceListFilesRequest, context: Ctx
    ) -> room_pb2.RoomServiceListFilesResponse:
        room_id = v.required_id(request.room_id, "room_id")
        page = await self._store.list_files(
            room_id, v.decode_page_token(request.page_token, "files"), v.page_size(request.page_size)
        )
        return room_pb2.RoomServiceListFilesResponse(
            files=[convert.file(r) for r in page.rows],
            next_page_token=v.encode_page_token("files", page.next_key),
            resume_page_token=_resume("files", page.rows, "pos", request.page_token),
        )

    async def SearchPassages(
        self, request: room_pb2.RoomServiceSearchPassagesRequest, context: Ctx
    ) -> room_pb2.RoomServiceSearchPassagesResponse:
        room_id = v.required_id(request.room_id, "room_id")
        query = v.text(request.query, "query", v.MAX_QUERY_BYTES)
        limit = v.in_range(request.limit or 5, "limit", 1, 50)
        rows = await self._store.search_passages(room_id, query, limit)
        return room_pb2.RoomServiceSearchPassagesResponse(passages=[convert.passage(r) for r in rows])

    # -- the run ledger -------------------------------------------------------------------------------------

    async def RecordRun(
        self, request: room_pb2.RoomServiceRecordRunRequest, context: Ctx
    ) -> room_pb2.RoomServiceRecordRunResponse:
        row = await self._store.record_run(_checked_run(request.run))
        return room_pb2.RoomServiceRecordRunResponse(run=convert.run(row))

    async def GetRun(
        self, request: room_pb2.RoomServiceGetRunRequest, context: Ctx
    ) -> room_pb2.RoomServiceGetRunResponse:
        row, parked = await self._store.get_run(v.text(request.run_id, "run_id", v.MAX_KEY_BYTES))
        response = room_pb2.RoomServiceGetRunResponse(run=convert.run(row))
        if parked is not None:
            response.waitpoint.CopyFrom(convert.waitpoint(parked.waitpoint, parked.held))
        return response

    async def ListRuns(
        self, request: room_pb2.RoomServiceListRunsRequest, context: Ctx
    ) -> room_pb2.RoomServiceListRunsResponse:
        agent_id = v.optional_id(request.agent_id, "agent_id")
        company_id = v.optional_id(request.company_id, "company_id")
        if agent_id is None and company_id is None:
            raise InvalidArgument("set agent_id or company_id")
        filters, scope = _run_filters(request)
        page = await self._store.list_runs(
            agent_id,
            company_id,
            v.decode_page_token(request.page_token, scope),
            v.page_size(request.page_size),
            filters,
        )
        return room_pb2.RoomServiceListRunsResponse(
            runs=[convert.run(r) for r in page.rows], next_page_token=v.encode_page_token(scope, page.next_key)
        )

    # -- the wake outbox ------------------------------------------------------------------------------------

    async def LeaseWakes(
        self, request: room_pb2.RoomServiceLeaseWakesRequest, context: Ctx
    ) -> room_pb2.RoomServiceLeaseWakesResponse:
        rows = await self._store.lease_wakes(
            v.text(request.lease_owner, "lease_owner", v.MAX_KEY_BYTES),
            v.in_range(request.max_wakes, "max_wakes", 1, 500),
            v.in_range(request.lease_seconds, "lease_seconds", 1, 3600),
        )
        return room_pb2.RoomServiceLeaseWakesResponse(wakes=[convert.wake(r) for r in rows])

    async def SettleWake(
        self, request: room_pb2.RoomServiceSettleWakeRequest, context: Ctx
    ) -> room_pb2.RoomServiceSettleWakeResponse:
        item = _wake_to_settle(request)
        settled = await self._store.settle_wake(
            item.wake_id,
            item.lease_owner,
            delivered=item.delivered,
            retry_after_ms=item.retry_after_ms,
            last_error=item.last_error,
        )
        return room_pb2.RoomServiceSettleWakeResponse(settled_at=convert.timestamp(settled))

    async def SettleWakes(
        self, request: room_pb2.RoomServiceSettleWakesRequest, context: Ctx
    ) -> room_pb2.RoomServiceSettleWakesResponse:
        if not 1 <= len(request.wakes) <= MAX_SETTLE_WAKES:
            raise InvalidArgument(
                f"wakes must hold 1 to {MAX_SETTLE_WAKES} items, got {len(request.wakes)}; split a larger batch"
            )
        items = [_wake_to_settle(wake, f"wakes[{n}].") for n, wake in enumerate(request.wakes)]
        if len({i.wake_id for i in items}) < len(items):
            raise InvalidArgument("wakes names a wake more than once; settle each wake once per call")
        annotate(wake_ids=[i.wake_id for i in items])
        response = room_pb2.RoomServiceSettleWakesResponse()
        for result in await self._store.settle_wakes(items):
            response.results.add(
                wake_id=result.wake_id,
                settled=result.settled_at is not None,
                settled_at=convert.timestamp(result.settled_at),
                error=result.error,
            )
        return response

    async def CountPendingWakes(
        self, request: room_pb2.RoomServiceCountPendingWakesRequest, context: Ctx
    ) -> room_pb2.RoomServiceCountPendingWakesResponse:
        row = await self._store.count_pending_wakes()
        return room_pb2.RoomServiceCountPendingWakesResponse(
            pending=row["pending"], oldest_pending_age_ms=row["oldest_pending_age_ms"]
        )

    # -- agent rights ---------------------------------------------------------------------------------------

    async def SetAgentRights(
        self, request: room_pb2.RoomServiceSetAgentRightsRequest, context: Ctx
    ) -> room_pb2.RoomServiceSetAgentRightsResponse:
        company_id = v.required_id(request.rights.company_id, "rights.company_id")
        agent_id = v.optional_id(request.rights.agent_id, "rights.agent_id")
        given = {f: _right_text(getattr(request.rights, f), f"rights.{f}") for f in convert.RIGHT_FIELDS}
        rights = {f: given[f] for f in rights_named(request.update_mask.paths)}
        row = await self._store.set_agent_rights(company_id, agent_id, rights)
        return room_pb2.RoomServiceSetAgentRightsResponse(rights=convert.agent_rights(row, company_id, agent_id))

    async def GetAgentRights(
        self, request: room_pb2.RoomServiceGetAgentRightsRequest, context: Ctx
    ) -> room_pb2.RoomServiceGetAgentRightsResponse:
        company_id = v.required_id(request.company_id, "company_id")
        agent_id = v.optional_id(request.agent_id, "agent_id")
        default, agent = await self._store.get_agent_rights(company_id, agent_id)
        return room_pb2.RoomServiceGetAgentRightsResponse(
            company_default=convert.agent_rights(default, company_id, None),
            agent=convert.agent_rights(agent, company_id, agent_id) if agent_id else None,
            effective=convert.effective_rights(default, agent, company_id, agent_id),
        )

    # -- waitpoints -----------------------------------------------------------------------------------------

    async def CreateWaitpoint(
        self, request: room_pb2.RoomServiceCreateWaitpointRequest, context: Ctx
    ) -> room_pb2.RoomServiceCreateWaitpointResponse:
        run_id = v.text(request.run_id or request.run.run_id, "run_id", v.MAX_KEY_BYTES)
        held = _held_specs(request.held)
        expires_in = v.in_range(request.expires_in_seconds, "expires_in_seconds", 1, v.MAX_EXPIRES_IN_SECONDS)
        run = None
        if request.HasField("run"):
            run = _checked_run(request.run)
            if run.run_id != run_id:
                raise InvalidArgument(f"run.run_id {run.run_id!r} is not run_id {run_id!r}")
            if run.status not in _PARKED_STATUS or run.step not in _PARKED_STEP or run.HasField("ended_at"):
                raise InvalidArgument("a parking run has status PARKED, step PARKED and no ended_at")
            run.status, run.step = common_pb2.RUN_STATUS_PARKED, common_pb2.RUN_STEP_PARKED
        annotate(run_id=run_id)  # the span the continuation's run links to
        rows = await self._store.create_waitpoint(run_id, held, expires_in, run)
        return room_pb2.RoomServiceCreateWaitpointResponse(waitpoint=convert.waitpoint(rows.waitpoint, rows.held))

    async def GetWaitpoint(
        self, request: room_pb2.RoomServiceGetWaitpointRequest, context: Ctx
    ) -> room_pb2.RoomServiceGetWaitpointResponse:
        rows = await self._store.get_waitpoint(v.required_id(request.token, "token"))
        return room_pb2.RoomServiceGetWaitpointResponse(waitpoint=convert.waitpoint(rows.waitpoint, rows.held))

    async def ListWaitpoints(
        self, request: room_pb2.RoomServiceListWaitpointsRequest, context: Ctx
    ) -> room_pb2.RoomServiceListWaitpointsResponse:
        company_id = v.required_id(request.company_id, "company_id")
        status = _WAITPOINT_STATUS.get(request.status or common_pb2.WAITPOINT_STATUS_PENDING)
        if status is None:
            raise InvalidArgument(f"status {request.status} is not a WaitpointStatus")
        scope = f"waitpoints-{status}"
        page, held = await self._store.list_waitpoints(
            company_id, status, v.decode_page_token(request.page_token, scope), v.page_size(request.page_size)
        )
        return room_pb2.RoomServiceListWaitpointsResponse(
            waitpoints=[convert.waitpoint(r, held[str(r["token"])]) for r in page.rows],
            next_page_token=v.encode_page_token(scope, page.next_key),
            resume_page_token=_resume(scope, page.rows, "pos", request.page_token),
        )

    async def DecideHeldAction(
        self, request: room_pb2.RoomServiceDecideHeldActionRequest, context: Ctx
    ) -> room_pb2.RoomServiceDecideHeldActionResponse:
        token = v.required_id(request.token, "token")
        index = v.in_range(request.index, "index", 0, 2**31 - 1)
        company_id = v.required_id(request.company_id, "company_id")
        decided_by = v.text(request.decided_by, "decided_by", v.MAX_NAME_BYTES)
        verified_by = v.text(request.decided_by_verified_by, "decided_by_verified_by", v.MAX_URL_BYTES, required=False)
        decided = await self._store.decide_held_action(
            token, index, company_id, decided_by, approve=request.approve, verified_by=verified_by or None
        )
        wp = decided.rows.waitpoint
        annotate(company_id=company_id, room_id=str(wp["room_id"]), run_id=wp["run_id"])
        return room_pb2.RoomServiceDecideHeldActionResponse(
            waitpoint=convert.waitpoint(decided.rows.waitpoint, decided.rows.held),
            completed=decided.completed,
            already_decided=decided.already_decided,
        )

    async def ExpireWaitpoints(
        self, request: room_pb2.RoomServiceExpireWaitpointsRequest, context: Ctx
    ) -> room_pb2.RoomServiceExpireWaitpointsResponse:
        limit = v.in_range(request.limit or 100, "limit", 1, 1000)
        expired, run_ids = await self._store.expire_waitpoints(limit)
        return room_pb2.RoomServiceExpireWaitpointsResponse(expired=expired, run_ids=run_ids)

    async def AbandonStaleRuns(
        self, request: room_pb2.RoomServiceAbandonStaleRunsRequest, context: Ctx
    ) -> room_pb2.RoomServiceAbandonStaleRunsResponse:
        older = v.in_range(request.older_than_seconds, "older_than_seconds", 60, 30 * 86_400)
        limit = v.in_range(request.limit or 100, "limit", 1, 1000)
        return room_pb2.RoomServiceAbandonStaleRunsResponse(
            abandoned=await self._store.abandon_stale_runs(older, limit)
        )

    async def RecordNotStartedRuns(
        self, request: room_pb2.RoomServiceRecordNotStartedRunsRequest, context: Ctx
    ) -> room_pb2.RoomServiceRecordNotStartedRunsResponse:
        older = v.in_range(request.older_than_seconds, "older_than_seconds", 1, 30 * 86_400)
        limit = v.in_range(request.limit or 100, "limit", 1, 1000)
        recorded, checked = await self._store.record_not_started_runs(older, limit)
        return room_pb2.RoomServiceRecordNotStartedRunsResponse(recorded=recorded, checked=checked)

    # -- the room event log ---------------------------------------------------------------------------------

    async def ReadRoomEvents(
        self, request: room_pb2.RoomServiceReadRoomEventsRequest, context: Ctx
    ) -> room_pb2.RoomServiceReadRoomEventsResponse:
        room_id = v.required_id(request.room_id, "room_id")
        company_id = v.optional_id(request.company_id, "company_id")
        if request.after < 0:
            raise InvalidArgument(f"after must be a cursor (0 or more), got {request.after}")
        limit = v.in_range(request.limit or 100, "limit", 1, 1000)
        if request.from_now:
            last = await self._store.last_event_cursor(room_id, company_id)
            return room_pb2.RoomServiceReadRoomEventsResponse(next_after=last, last_cursor=last)
        page = await self._store.read_events(
            room_id, company_id, request.after, limit, retention_hours=self._event_retention_hours
        )
        entries = []
        for row in page.rows:
            event = convert.room_event(row)
            if event is None:
                continue  # another company's private event: its cursor still counts
            event.cursor = row["seq"]
            event.room_id = room_id
            event.created_at.FromDatetime(row["created_at"])
            audience = row["audience_company_id"]
            entries.append(
                room_pb2.RoomServiceRoomEventEntry(event=event, audience_company_id=str(audience) if audience else "")
            )
        return room_pb2.RoomServiceReadRoomEventsResponse(
            entries=entries, next_after=page.next_after, more=page.more, last_cursor=page.last_cursor
        )

    # -- a run's view of its room ---------------------------------------------------------------------------

    @staticmethod
    def _context_run(
        request: room_pb2.RoomServiceReadRunContextRequest, agent_id: str, room_id: str
    ) -> common_pb2.Run | None:
        if not request.HasField("run"):
            return None
        run = _checked_run(request.run)
        if (run.agent_id, run.room_id) != (agent_id, room_id):
            raise InvalidArgument("run.agent_id and run.room_id must be the agent_id and room_id read")
        return run

    async def ReadRunContext(
        self, request: room_pb2.RoomServiceReadRunContextRequest, context: Ctx
    ) -> room_pb2.RoomServiceReadRunContextResponse:
        agent_id = v.required_id(request.agent_id, "agent_id")
        room_id = v.required_id(request.room_id, "room_id")
        if request.wake_kind not in common_pb2.WakeKind.values():
            raise InvalidArgument(f"wake_kind {request.wake_kind} is not a WakeKind")
        wake_kind = convert.enum_to_text(common_pb2.WakeKind, request.wake_kind, convert.WAKE_KIND_PREFIX)
        if wake_kind in ("message", "task"):
            source_id = v.optional_id(request.wake_source_id, "wake_source_id")
        else:
            v.text(request.wake_source_id, "wake_source_id", v.MAX_KEY_BYTES, required=False)
            source_id = None
        ctx = await self._store.read_run_context(
            agent_id=agent_id,
            room_id=room_id,
            wake_kind=wake_kind,
            wake_source_id=source_id,
            recent_messages=v.in_range(request.recent_messages or 20, "recent_messages", 1, 200),
            max_passages=v.in_range(request.max_passages or 5, "max_passages", 1, 50),
            run=self._context_run(request, agent_id, room_id),
        )
        company_id = str(ctx.agent["company_id"])
        return room_pb2.RoomServiceReadRunContextResponse(
            agent=convert.agent(ctx.agent),
            provider_key=ctx.provider_key,
            rights=convert.effective_rights(ctx.company_default, ctx.agent_rights, company_id, agent_id),
            room_agents=[convert.agent(r) for r in ctx.room_agents],
            messages=[convert.message(r) for r in ctx.messages],
            open_tasks=[convert.task(r, ctx.task_updates[str(r["task_id"])]) for r in ctx.open_tasks],
            memory=[convert.memory_line(r) for r in ctx.memory],
            passages=[convert.passage(r) for r in ctx.passages],
            wake_text=ctx.wake_text,
        )


def _run_record(
    request: room_pb2.RoomServiceCreateTaskRequest
    | room_pb2.RoomServiceUpdateTaskRequest
    | room_pb2.RoomServiceWriteMemoryRequest,
) -> RunRecord | None:
    """The ledger row to record with an action's write, or None when the request carries none."""
    if not request.HasField("run"):
        return None
    return RunRecord(_checked_run(request.run), request.run_action_index)


def _annotate_post(message_id: str, room_id: str, wakes: Sequence[common_pb2.Wake], run_id: str = "") -> None:
    """The post's span names the message and the wakes it made (each wake's delivery links back to it)."""
    annotate(message_id=message_id, room_id=room_id, wake_ids=[w.wake_id for w in wakes], run_id=run_id)


def _checked_run(request_run: common_pb2.Run) -> common_pb2.Run:
    """A copy of a ledger row with its ids in canonical form; INVALID_ARGUMENT for a malformed one."""
    run = common_pb2.Run()
    run.CopyFrom(request_run)
    v.text(run.run_id, "run.run_id", v.MAX_KEY_BYTES)
    run.agent_id = v.required_id(run.agent_id, "run.agent_id")
    run.room_id = v.required_id(run.room_id, "run.room_id")
    run.company_id = v.optional_id(run.company_id, "run.company_id") or ""
    for field in ("wake_id", "wake_source_id", "posted_message_id", "trace_id", "attempt"):
        v.text(getattr(run, field), f"run.{field}", v.MAX_KEY_BYTES, required=False)
    if len(run.trace_ids) > v.MAX_TRACE_IDS:
        raise InvalidArgument(f"run.trace_ids has {len(run.trace_ids)} ids; at most {v.MAX_TRACE_IDS} are allowed")
    for trace_id in run.trace_ids:
        v.text(trace_id, "run.trace_ids", v.MAX_KEY_BYTES, required=False)
    if run.status == common_pb2.RUN_STATUS_NOT_STARTED:
        raise InvalidArgument("run.status NOT_STARTED is recorded by housekeeping only; a run records RUNNING")
    v.text(run.error, "run.error", v.MAX_BODY_BYTES, required=False)
    if run.ByteSize() > v.MAX_RUN_BYTES:
        raise InvalidArgument(f"the run is {run.ByteSize()} bytes; at most {v.MAX_RUN_BYTES} are allowed")
    return run


def rights_named(paths: Sequence[str]) -> tuple[str, ...]:
    """The rights an update mask names, in AgentRights order; every right when it names none (the
    meaning of a request without a mask: replace them all). INVALID_ARGUMENT for a path that is not one."""
    for path in paths:
        if path not in convert.RIGHT_FIELDS:
            raise InvalidArgument(
                f"update_mask names {path[:64]!r}, which is not a right; name some of {', '.join(convert.RIGHT_FIELDS)}"
            )
    return tuple(f for f in convert.RIGHT_FIELDS if f in paths) if paths else convert.RIGHT_FIELDS


def _right_text(value: common_pb2.ActionRight.ValueType, field: str) -> str | None:
    """An ActionRight as stored: None when unspecified (not set here)."""
    if value == common_pb2.ACTION_RIGHT_UNSPECIFIED:
        return None
    right = _RIGHTS.get(value)
    if right is None:
        raise InvalidArgument(f"{field} must be ACTION_RIGHT_AUTO, ACTION_RIGHT_HOLD or ACTION_RIGHT_DENY, got {value}")
    return right


def _held_specs(held: Sequence[common_pb2.HeldAction]) -> list[HeldSpec]:
    """The held actions to park: 1..MAX_HELD_ACTIONS, distinct indexes, known kinds, JSON arguments."""
    if not held:
        raise InvalidArgument("held is required: a waitpoint holds at least one action")
    if len(held) > v.MAX_HELD_ACTIONS:
        raise InvalidArgument(f"at most {v.MAX_HELD_ACTIONS} held actions are allowed, got {len(held)}")
    specs: list[HeldSpec] = []
    for i, action in enumerate(held):
        field = f"held[{i}]"
        kind = _ACTION_KINDS.get(action.kind)
        if kind is None:
            raise InvalidArgument(f"{field}.kind must be a known ActionKind, got {action.kind}")
        arguments = v.text(action.arguments_json, f"{field}.arguments_json", v.MAX_BODY_BYTES, required=False) or "{}"
        try:
            json.loads(arguments)
        except ValueError:
            raise InvalidArgument(f"{field}.arguments_json is not JSON") from None
        specs.append(HeldSpec(v.in_range(action.index, f"{field}.index", 0, 2**31 - 1), kind, arguments))
    if len({s.index for s in specs}) != len(specs):
        raise InvalidArgument("held action indexes must be distinct")
    return specs
