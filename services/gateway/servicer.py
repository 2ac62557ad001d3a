"""GatewayService: the public door. Checks the request's shape, rate-limits, then calls the Room as the caller.

The calling company comes from the auth interceptor (CallerContext). Who may do what to a room's
objects is the Room's to decide (services/room/rules.py, docs/rules.md), for this door and every
other alike: the Gateway keeps no rule of its own. It passes the Room's refusals on, except that a
room the caller is not a member of answers NOT_FOUND, as if it did not exist, and so do malformed
ids; nothing another company owns is ever returned.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import grpc

from quayutec.crypto import MultiFernet
from quayutec.errors import InvalidArgument, NotFound, PermissionDenied, status_for, trailers_of
from quayutec.ratelog import RateLimitedLog
from quayutec.telemetry import annotate
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2
from services.gateway.auth import CallerContext
from services.gateway.delivery import WakeDelivery
from services.gateway.keys import KeyRpcs
from services.gateway.oidc import OidcClient
from services.gateway.ratelimit import PostRateLimiter
from services.gateway.signin import SignInProviderRpcs
from services.gateway.store import ApiKeyStore
from services.gateway.watch import RoomEventHub

_log = logging.getLogger("quayutec.gateway.servicer")

MAX_NAME_BYTES = 200
MAX_BODY_BYTES = 64 * 1024
MAX_TITLE_BYTES = 500
MAX_FILE_BYTES = 10 * 1024 * 1024
MAX_FILE_NAME_BYTES = 255
MAX_QUERY_BYTES = 1000
MAX_IDEMPOTENCY_KEY_BYTES = 200
MAX_MENTIONS = 50
MAX_SYSTEM_PROMPT_BYTES = 64 * 1024
MAX_PROVIDER_KEY_BYTES = 4096
MAX_PAGE_SIZE = 500
MAX_PASSAGES = 50
RIGHT_FIELDS = ("remember", "create_task", "update_task", "close_task", "cross_company_task")

_CLOSING_STATUSES = (common_pb2.TASK_STATUS_DONE, common_pb2.TASK_STATUS_CANCELLED)
_registration_log = logging.getLogger("quayutec.gateway.registration")
# How the Room refuses a registration: a base_url its egress rules refuse, or a host it cannot resolve.
_REGISTRATION_REFUSALS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE})
# Said for an agent a write names that is unknown or not in the room: one answer for both, so agent ids
# of other companies cannot be probed.
AGENT_NOT_IN_ROOM = "agent not found in this room (unknown, or its company is not a member)"
# The Room's answers that refuse a write for what it names (not for a fault of the Room's own).
_REFUSALS = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.OUT_OF_RANGE,
    }
)


def _bytes(value: str) -> int:
    return len(value.encode("utf-8"))


def _required_text(value: str, field: str, max_bytes: int) -> str:
    if not value.strip():
        raise InvalidArgument(f"{field} is required")
    if _bytes(value) > max_bytes:
        raise InvalidArgument(f"{field} must be at most {max_bytes} bytes")
    return value


def _optional_text(value: str, field: str, max_bytes: int) -> str:
    if _bytes(value) > max_bytes:
        raise InvalidArgument(f"{field} must be at most {max_bytes} bytes")
    return value


def _page_size(value: int) -> int:
    if value == 0:
        return 0  # the Room's default (50)
    if not 1 <= value <= MAX_PAGE_SIZE:
        raise InvalidArgument(f"page_size must be between 1 and {MAX_PAGE_SIZE} (0 for the default 50), got {value}")
    return value


def _is_uuid(value: str) -> bool:
    try:
        return str(uuid.UUID(value)) == value.lower()
    except ValueError:
        return False


def _required_id(value: str, field: str) -> str:
    """An id the caller supplied for something that is not a room: missing or malformed is INVALID_ARGUMENT."""
    if not value:
        raise InvalidArgument(f"{field} is required")
    if not _is_uuid(value):
        raise InvalidArgument(f"{field} must be an id (uuid), got {value[:64]!r}")
    return value


def _idempotency_key(value: str) -> str:
    return _optional_text(value, "idempotency_key", MAX_IDEMPOTENCY_KEY_BYTES)


def _check_enum(enum: Any, value: int, field: str) -> None:
    if value not in enum.values():
        raise InvalidArgument(f"{field} has unknown value {value}")


class GatewayServicer(KeyRpcs, SignInProviderRpcs):
    """The public API over the Room, scoped to the calling company."""

    def __init__(
        self,
        room: Any,
        caller: CallerContext,
        limiter: PostRateLimiter,
        *,
        room_timeout_seconds: float,
        watch: RoomEventHub | None = None,
        keys: ApiKeyStore | None = None,
        max_session_keys: int = 1000,
        max_api_keys: int = 100,
        cipher: MultiFernet | None = None,
        oidc: OidcClient | None = None,
        delivery: WakeDelivery | None = None,
    ) -> None:
        self._room = room
        # This replica's delivery loop: a person's post leases its wakes to it (None: never).
        self._delivery = delivery
        self._cipher = cipher
        self._oidc = oidc
        self._caller = caller
        self._limiter = limiter
        self._timeout = room_timeout_seconds
        self._watch = watch
        self._keys = keys
        self._max_session_keys = max_session_keys
        self._max_api_keys = max_api_keys
        # One line per refused registration, no traceback; anyone with a key can cause them, so bounded.
        self._refusals = RateLimitedLog(_registration_log)

    # --- helpers -------------------------------------------------------------------------------

    def _person(self, company_id: str, person: str) -> common_pb2.Author:
        """The caller's person as an author; a company acts only through its own people."""
        name, verified_by = self._person_name(person)
        return common_pb2.Author(
            kind=common_pb2.AUTHOR_KIND_PERSON, company_id=company_id, person=name, verified_by=verified_by
        )

    def _person_name(self, person: str) -> tuple[str, str]:
        """Who acts, and the issuer that verified them ("" when the calling company's service states the
        name). A sign-in through the company's provider acts only as the person it verified."""
        verified = self._caller.caller().person
        if verified is None:
            return _required_text(person, "person", MAX_NAME_BYTES).strip(), ""
        stated = person.strip()
        if stated and stated != verified.name:
            raise PermissionDenied(
                f"this sign-in is {verified.name}'s, verified by {verified.issuer}: it cannot act as "
                f"{stated[:100]!r} (leave person empty, or send {verified.name!r})"
            )
        return verified.name, verified.issuer

    @staticmethod
    def _room_not_found(room_id: str) -> NotFound:
        return NotFound(f"room {room_id[:64]!r} not found")

    def _checked_room_id(self, room_id: str) -> str:
        """A well-formed room id; a malformed one answers like a room that does not exist."""
        if not room_id:
            raise InvalidArgument("room_id is required")
        if not _is_uuid(room_id):
            raise self._room_not_found(room_id)
        return room_id

    async def _member_room(self, room_id: str, company_id: str) -> common_pb2.Room:
        """The room, when the caller's company is a member; NOT_FOUND otherwise (or when malformed)."""
        self._checked_room_id(room_id)
        try:
            response = await self._room.GetRoom(
                room_pb2.RoomServiceGetRoomRequest(room_id=room_id, member_company_id=company_id),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise self._room_not_found(room_id) from None
            raise
        room: common_pb2.Room = response.room
        return room

    async def _agent_company(self, agent_id: str) -> str | None:
        try:
            response = await self._room.GetAgent(
                room_pb2.RoomServiceGetAgentRequest(agent_id=agent_id), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                return None
            raise
        return str(response.agent.company_id)

    async def _write_to_room(
        self, call: Any, request: Any, company_id: str, room_id: str, not_found: str | None = None
    ) -> Any:
        """A write sent to the Room without asking first whether the caller's company is a member: the
        Room decides by the room's rules, in the write's own transaction, whether the caller may. Its
        answer is translated to what a membership check first would have answered.

        The Room checks what the write names before the author, so its refusals alone would tell a
        non-member what exists, and it returns an earlier write of the same dedupe key before admitting
        the author. So on a refusal, and on a deduplicated answer, the membership is asked (a rare path):
        a non-member gets NOT_FOUND for the room, as for a room that does not exist. A member gets the
        Room's refusal (its NOT_FOUND said as ``not_found`` when given).
        """
        self._checked_room_id(room_id)
        try:
            response = await call(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _REFUSALS:
                raise
            await self._member_room(room_id, company_id)
            if exc.code() == grpc.StatusCode.NOT_FOUND and not_found is not None:
                raise NotFound(not_found) from None
            raise
        if getattr(response, "deduplicated", False):  # the Room answered before admitting the author
            await self._member_room(room_id, company_id)
        return response

    async def _rooms_changed(self, company_id: str) -> None:
        """Tell every replica's WatchRooms streams of the company to follow its new room now (their
        periodic re-listing is the fallback, so a failure here fails nothing)."""
        if self._keys is None:
            return
        try:
            await self._keys.notify_company_rooms(company_id)
        except Exception as exc:
            _log.warning("announcing a room change of company %s failed (%s)", company_id, type(exc).__name__)

    @staticmethod
    def _dedupe_key(company_id: str, key: str) -> str:
        """Idempotency keys are namespaced by company so two companies' keys never collide."""
        return f"gw:{company_id}:{key}" if key else ""

    # --- companies and rooms -------------------------------------------------------------------

    async def WhoAmI(self, request: gateway_pb2.WhoAmIRequest, context: Any) -> gateway_pb2.WhoAmIResponse:
        company_id = self._caller.company_id()
        response = await self._room.GetCompany(
            room_pb2.RoomServiceGetCompanyRequest(company_id=company_id), timeout=self._timeout
        )
        return gateway_pb2.WhoAmIResponse(company=response.company)

    async def CreateRoom(self, request: gateway_pb2.CreateRoomRequest, context: Any) -> gateway_pb2.CreateRoomResponse:
        company_id = self._caller.company_id()
        name = _required_text(request.name, "name", MAX_NAME_BYTES)
        key = _idempotency_key(request.idempotency_key)
        response = await self._room.CreateRoom(
            room_pb2.RoomServiceCreateRoomRequest(
                company_id=company_id, name=name, dedupe_key=self._dedupe_key(company_id, key)
            ),
            timeout=self._timeout,
        )
        await self._rooms_changed(company_id)
        return gateway_pb2.CreateRoomResponse(room=response.room)

    async def RenameRoom(self, request: gateway_pb2.RenameRoomRequest, context: Any) -> gateway_pb2.RenameRoomResponse:
        company_id = self._caller.company_id()
        name = _required_text(request.name, "name", MAX_NAME_BYTES)
        response = await self._write_to_room(
            self._room.RenameRoom,
            room_pb2.RoomServiceRenameRoomRequest(room_id=request.room_id, company_id=company_id, name=name),
            company_id,
            request.room_id,
        )
        return gateway_pb2.RenameRoomResponse(room=response.room)

    async def ArchiveRoom(
        self, request: gateway_pb2.ArchiveRoomRequest, context: Any
    ) -> gateway_pb2.ArchiveRoomResponse:
        company_id = self._caller.company_id()
        response = await self._write_to_room(
            self._room.ArchiveRoom,
            room_pb2.RoomServiceArchiveRoomRequest(room_id=request.room_id, company_id=company_id),
            company_id,
            request.room_id,
        )
        return gateway_pb2.ArchiveRoomResponse(room=response.room)

    async def ListRooms(self, request: gateway_pb2.ListRoomsRequest, context: Any) -> gateway_pb2.ListRoomsResponse:
        company_id = self._caller.company_id()
        response = await self._room.ListRooms(
            room_pb2.RoomServiceListRoomsRequest(
                company_id=company_id, page_size=_page_size(request.page_size), page_token=request.page_token
            ),
            timeout=self._timeout,
        )
        return gateway_pb2.ListRoomsResponse(
            rooms=response.rooms, next_page_token=response.next_page_token, resume_page_token=response.resume_page_token
        )

    async def InviteCompany(
        self, request: gateway_pb2.InviteCompanyRequest, context: Any
    ) -> gateway_pb2.InviteCompanyResponse:
        company_id = self._caller.company_id()
        invited = request.company_id
        if not invited:
            raise InvalidArgument("company_id is required")
        not_found = f"company {invited[:64]!r} not found"
        key = _idempotency_key(request.idempotency_key)
        if not _is_uuid(invited):
            await self._member_room(request.room_id, company_id)
            raise NotFound(not_found)
        response = await self._write_to_room(
            self._room.CreateInvitation,
            room_pb2.RoomServiceCreateInvitationRequest(
                room_id=request.room_id,
                company_id=invited,
                invited_by_company_id=company_id,
                dedupe_key=self._dedupe_key(company_id, key),
            ),
            company_id,
            request.room_id,
            not_found,
        )
        return gateway_pb2.InviteCompanyResponse(invitation=response.invitation)

    async def ListInvitations(
        self, request: gateway_pb2.ListInvitationsRequest, context: Any
    ) -> gateway_pb2.ListInvitationsResponse:
        company_id = self._caller.company_id()
        page_size = _page_size(request.page_size)
        _check_enum(common_pb2.InvitationStatus, request.status, "status")
        response = await self._room.ListInvitations(
            room_pb2.RoomServiceListInvitationsRequest(
                company_id=company_id,
                status=request.status,
                page_size=page_size,
                page_token=request.page_token,
                sent=request.sent,
            ),
            timeout=self._timeout,
        )
        # Only invitations to (or, sent, from) the caller's company, whatever the Room returns.
        invitations = [
            i for i in response.invitations if (i.invited_by_company_id if request.sent else i.company_id) == company_id
        ]
        return gateway_pb2.ListInvitationsResponse(
            invitations=invitations,
            next_page_token=response.next_page_token,
            resume_page_token=response.resume_page_token,
        )

    def _invitation_id(self, invitation_id: str) -> str:
        """A well-formed invitation id; a malformed one answers like an unknown one."""
        if not invitation_id:
            raise InvalidArgument("invitation_id is required")
        if not _is_uuid(invitation_id):
            raise NotFound(f"invitation {invitation_id[:64]!r} not found among your company's invitations")
        return invitation_id

    async def AcceptInvitation(
        self, request: gateway_pb2.AcceptInvitationRequest, context: Any
    ) -> gateway_pb2.AcceptInvitationResponse:
        company_id = self._caller.company_id()
        response = await self._room.AcceptInvitation(
            room_pb2.RoomServiceAcceptInvitationRequest(
                invitation_id=self._invitation_id(request.invitation_id), company_id=company_id
            ),
            timeout=self._timeout,
        )
        await self._rooms_changed(company_id)
        return gateway_pb2.AcceptInvitationResponse(invitation=response.invitation, member=response.member)

    async def DeclineInvitation(
        self, request: gateway_pb2.DeclineInvitationRequest, context: Any
    ) -> gateway_pb2.DeclineInvitationResponse:
        company_id = self._caller.company_id()
        response = await self._room.DeclineInvitation(
            room_pb2.RoomServiceDeclineInvitationRequest(
                invitation_id=self._invitation_id(request.invitation_id), company_id=company_id
            ),
            timeout=self._timeout,
        )
        return gateway_pb2.DeclineInvitationResponse(invitation=response.invitation)

    async def ListRoomInvitations(
        self, request: gateway_pb2.ListRoomInvitationsRequest, context: Any
    ) -> gateway_pb2.ListRoomInvitationsResponse:
        company_id = self._caller.company_id()
        _check_enum(common_pb2.InvitationStatus, request.status, "status")
        response = await self._room.ListRoomInvitations(
            room_pb2.RoomServiceListRoomInvitationsRequest(
                room_id=self._checked_room_id(request.room_id),
                company_id=company_id,
                status=request.status,
                page_size=_page_size(request.page_size),
                page_token=request.page_token,
            ),
            timeout=self._timeout,
        )
        return gateway_pb2.ListRoomInvitationsResponse(
            invitations=response.invitations, next_page_token=response.next_page_token
        )

    async def WithdrawInvitation(
        self, request: gateway_pb2.WithdrawInvitationRequest, context: Any
    ) -> gateway_pb2.WithdrawInvitationResponse:
        company_id = self._caller.company_id()
        response = await self._room.WithdrawInvitation(
            room_pb2.RoomServiceWithdrawInvitationRequest(
                invitation_id=self._invitation_id(request.invitation_id), company_id=company_id
            ),
            timeout=self._timeout,
        )
        return gateway_pb2.WithdrawInvitationResponse(invitation=response.invitation)

    async def LeaveRoom(self, request: gateway_pb2.LeaveRoomRequest, context: Any) -> gateway_pb2.LeaveRoomResponse:
        company_id = self._caller.company_id()
        await self._write_to_room(
            self._room.LeaveRoom,
            room_pb2.RoomServiceLeaveRoomRequest(room_id=request.room_id, company_id=company_id),
            company_id,
            request.room_id,
        )
        return gateway_pb2.LeaveRoomResponse()

    async def RemoveMember(
        self, request: gateway_pb2.RemoveMemberRequest, context: Any
    ) -> gateway_pb2.RemoveMemberResponse:
        company_id = self._caller.company_id()
        removed = request.company_id
        if not removed:
            raise InvalidArgument("company_id is required")
        not_member = f"company {removed[:64]!r} is not a member of this room"
        if not _is_uuid(removed):
            await self._member_room(request.room_id, company_id)
            raise NotFound(not_member)
        await self._write_to_room(
            self._room.RemoveMember,
            room_pb2.RoomServiceRemoveMemberRequest(
                room_id=request.room_id, company_id=removed, removed_by_company_id=company_id
            ),
            company_id,
            request.room_id,
            not_member,
        )
        return gateway_pb2.RemoveMemberResponse()

    async def ListMembers(
        self, request: gateway_pb2.ListMembersRequest, context: Any
    ) -> gateway_pb2.ListMembersResponse:
        company_id = self._caller.company_id()
        page_size = _page_size(request.page_size)
        await self._member_room(request.room_id, company_id)
        response = await self._room.ListMembers(
            room_pb2.RoomServiceListMembersRequest(
                room_id=request.room_id, page_size=page_size, page_token=request.page_token
            ),
            timeout=self._timeout,
        )
        return gateway_pb2.ListMembersResponse(
            members=response.members,
            next_page_token=response.next_page_token,
            resume_page_token=response.resume_page_token,
        )

    # --- agents --------------------------------------------------------------------------------

    async def RegisterAgent(
        self, request: gateway_pb2.RegisterAgentRequest, context: Any
    ) -> gateway_pb2.RegisterAgentResponse:
        company_id = self._caller.company_id()
        name = _required_text(request.name, "name", MAX_NAME_BYTES)
        if request.provider == common_pb2.PROVIDER_UNSPECIFIED:
            raise InvalidArgument(
                "provider is required (PROVIDER_ANTHROPIC, PROVIDER_OPENAI or PROVIDER_OPENAI_COMPATIBLE)"
            )
        _check_enum(common_pb2.Provider, request.provider, "provider")
        model = _required_text(request.model, "model", MAX_NAME_BYTES)
        base_url = request.base_url.strip()
        if base_url:
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.netloc or len(base_url) > 2048:
                raise InvalidArgument(f"base_url must be an http:// or https:// URL, got {base_url[:100]!r}")
        elif request.provider == common_pb2.PROVIDER_OPENAI_COMPATIBLE:
            raise InvalidArgument("base_url is required for PROVIDER_OPENAI_COMPATIBLE")
        provider_key = _required_text(request.provider_key, "provider_key", MAX_PROVIDER_KEY_BYTES)
        system_prompt = _optional_text(request.system_prompt, "system_prompt", MAX_SYSTEM_PROMPT_BYTES)
        key = _idempotency_key(request.idempotency_key)
        try:
            response = await self._room.RegisterAgent(
                room_pb2.RoomServiceRegisterAgentRequest(
                    company_id=company_id,
                    name=name,
                    provider=request.provider,
                    model=model,
                    base_url=base_url,
                    provider_key=provider_key,
                    system_prompt=system_prompt,
                    dedupe_key=self._dedupe_key(company_id, key),
                ),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _REGISTRATION_REFUSALS:
                raise
            # The Room refused (its base_url check, or it cannot resolve the host now): passed on as is.
            code, details = exc.code(), exc.details() or exc.code().name
            self._refusals.warning("RegisterAgent refused for company %s: %s %s", company_id, code.name, details)
            await context.abort(code, details)
        return gateway_pb2.RegisterAgentResponse(agent=response.agent)

    async def RenameAgent(
        self, request: gateway_pb2.RenameAgentRequest, context: Any
    ) -> gateway_pb2.RenameAgentResponse:
        # The Room answers another company's agent exactly as an unknown id (the rule `own-agent`).
        company_id = self._caller.company_id()
        agent_id = _required_id(request.agent_id, "agent_id")
        name = _required_text(request.name, "name", MAX_NAME_BYTES)
        response = await self._room.RenameAgent(
            room_pb2.RoomServiceRenameAgentRequest(agent_id=agent_id, company_id=company_id, name=name),
            timeout=self._timeout,
        )
        return gateway_pb2.RenameAgentResponse(agent=response.agent)

    async def RetireAgent(
        self, request: gateway_pb2.RetireAgentRequest, context: Any
    ) -> gateway_pb2.RetireAgentResponse:
        company_id = self._caller.company_id()
        agent_id = _required_id(request.agent_id, "agent_id")
        response = await self._room.RetireAgent(
            room_pb2.RoomServiceRetireAgentRequest(agent_id=agent_id, company_id=company_id), timeout=self._timeout
        )
        return gateway_pb2.RetireAgentResponse(agent=response.agent)

    async def ListAgents(self, request: gateway_pb2.ListAgentsRequest, context: Any) -> gateway_pb2.ListAgentsResponse:
        company_id = self._caller.company_id()
        page_size = _page_size(request.page_size)
        if request.room_id:
            # The Room decides what the caller sees of each agent, by the room's rule `room-agents`.
            listing = room_pb2.RoomServiceListAgentsRequest(
                room_id=self._checked_room_id(request.room_id), reader_company_id=company_id
            )
        else:
            listing = room_pb2.RoomServiceListAgentsRequest(company_id=company_id)
        listing.page_size, listing.page_token = page_size, request.page_token
        try:
            response = await self._room.ListAgents(listing, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if request.room_id and exc.code() == grpc.StatusCode.NOT_FOUND:
                raise self._room_not_found(request.room_id) from None
            raise
        return gateway_pb2.ListAgentsResponse(
            agents=response.agents,
            next_page_token=response.next_page_token,
            resume_page_token=response.resume_page_token,
        )

    # --- messages ------------------------------------------------------------------------------

    async def PostMessage(
        self, request: gateway_pb2.PostMessageRequest, context: Any
    ) -> gateway_pb2.PostMessageResponse:
        company_id = self._caller.company_id()
        self._limiter.take(company_id)
        author = self._person(company_id, request.person)
        if not request.body.strip():
            raise InvalidArgument("body is required")
        if _bytes(request.body) > MAX_BODY_BYTES:
            raise InvalidArgument(f"body must be at most {MAX_BODY_BYTES} bytes (64 KiB)")
        if len(request.mention_agent_ids) > MAX_MENTIONS:
            raise InvalidArgument(f"mention_agent_ids may name at most {MAX_MENTIONS} agents")
        for agent_id in request.mention_agent_ids:
            _required_id(agent_id, "mention_agent_ids")
        key = _idempotency_key(request.idempotency_key)
        room_request = room_pb2.RoomServicePostMessageRequest(
            room_id=request.room_id,
            author=author,
            body=request.body,
            mention_agent_ids=request.mention_agent_ids,
            dedupe_key=self._dedupe_key(company_id, key),
        )
        # The post leases its own wakes to this replica's delivery loop when the loop has places for them
        # all (held until the answer, so concurrent posts and the loop's own leasing never pass its cap):
        # delivered at once, with no LeaseWakes and no wait for the new-wakes notification. Otherwise the
        # wakes wait unleased for whichever replica's loop leases them first.
        places = len(set(request.mention_agent_ids))
        delivery = self._delivery if self._delivery is not None and self._delivery.reserve(places) else None
        if delivery is not None:
            room_request.lease_owner = delivery.lease_owner
            room_request.lease_seconds = delivery.lease_seconds
        try:
            response = await self._write_to_room(
                self._room.PostMessage, room_request, company_id, request.room_id, AGENT_NOT_IN_ROOM
            )
        except BaseException:
            # Had the Room committed (a timeout after it did), the wakes stay leased to us until their
            # leases expire, and are delivered then: as after a replica that stopped holding leases.
            if delivery is not None:
                delivery.release(places)
            raise
        if delivery is not None:
            delivery.adopt(list(response.wakes) if response.leased else [], places)
        wake_ids = [w.wake_id for w in response.wakes]
        annotate(
            company_id=company_id, room_id=request.room_id, message_id=response.message.message_id, wake_ids=wake_ids
        )
        return gateway_pb2.PostMessageResponse(message=response.message, wake_ids=wake_ids)

    async def ListMessages(
        self, request: gateway_pb2.ListMessagesRequest, context: Any
    ) -> gateway_pb2.ListMessagesResponse:
        company_id = self._caller.company_id()
        page_size = _page_size(request.page_size)
        await self._member_room(request.room_id, company_id)
        response = await self._room.ListMessages(
            room_pb2.RoomServiceListMessagesRequest(
                room_id=request.room_id,
                page_size=page_size,
                page_token=request.page_token,
                newest_first=request.newest_first,
            ),
            timeout=self._timeout,
        )
        return gateway_pb2.ListMessagesResponse(
            messages=response.messages,
            next_page_token=response.next_page_token,
            resume_page_token=response.resume_page_token,
        )

    async def GetMessage(self, request: gateway_pb2.GetMessageRequest, context: Any) -> gateway_pb2.GetMessageResponse:
        company_id = self._caller.company_id()
        if not request.message_id:
            raise InvalidArgument("message_id is required")
        await self._member_room(request.room_id, company_id)
        not_found = NotFound(f"message {request.message_id[:64]!r} not found in this room")
        if not _is_uuid(request.message_id):
            raise not_found
        try:
            response = await self._room.GetMessage(
                room_pb2.RoomServiceGetMessageRequest(room_id=request.room_id, message_id=request.message_id),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise not_found from None
            raise
        return gateway_pb2.GetMessageResponse(message=response.message)

    # --- tasks ---------------------------------------------------------------------------------

    async def SendTask(self, request: gateway_pb2.SendTaskRequest, context: Any) -> gateway_pb2.SendTaskResponse:
        company_id = self._caller.company_id()
        self._limiter.take(company_id)
        author = self._person(company_id, request.person)
        to_agent_id = _required_id(request.to_agent_id, "to_agent_id")
        title = _required_text(request.title, "title", MAX_TITLE_BYTES)
        body = _optional_text(request.body, "body", MAX_BODY_BYTES)
        key = _idempotency_key(request.idempotency_key)
        create = room_pb2.RoomServiceCreateTaskRequest(
            room_id=request.room_id,
            to_agent_id=to_agent_id,
            title=title,
            body=body,
            dedupe_key=self._dedupe_key(company_id, key),
        )
        getattr(create, "from").CopyFrom(author)  # `from` is a Python keyword
        response = await self._write_to_room(
            self._room.CreateTask, create, company_id, request.room_id, AGENT_NOT_IN_ROOM
        )
        return gateway_pb2.SendTaskResponse(task=response.task, wake_ids=[w.wake_id for w in response.wakes])

    async def _task_in_room(self, room_id: str, task_id: str) -> common_pb2.Task:
        not_found = NotFound(f"task {task_id[:64]!r} not found in this room")
        if not _is_uuid(task_id):
            raise not_found
        try:
            response = await self._room.GetTask(
                room_pb2.RoomServiceGetTaskRequest(task_id=task_id, room_id=room_id), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise not_found from None
            raise
        task: common_pb2.Task = response.task
        return task

    async def UpdateTask(self, request: gateway_pb2.UpdateTaskRequest, context: Any) -> gateway_pb2.UpdateTaskResponse:
        company_id = self._caller.company_id()
        self._limiter.take(company_id)
        if not request.task_id:
            raise InvalidArgument("task_id is required")
        author = self._person(company_id, request.person)
        note = _optional_text(request.note, "note", MAX_BODY_BYTES)
        _check_enum(common_pb2.TaskStatus, request.status, "status")
        status = request.status
        if not note.strip() and status not in _CLOSING_STATUSES:
            raise InvalidArgument("note is required unless status closes the task (DONE or CANCELLED)")
        key = _idempotency_key(request.idempotency_key)
        not_found = f"task {request.task_id[:64]!r} not found in this room"
        if not _is_uuid(request.task_id):
            await self._member_room(request.room_id, company_id)
            raise NotFound(not_found)
        response = await self._write_to_room(
            self._room.UpdateTask,
            room_pb2.RoomServiceUpdateTaskRequest(
                task_id=request.task_id,
                room_id=request.room_id,
                author=author,
                note=note,
                status=status,
                dedupe_key=self._dedupe_key(company_id, key),
            ),
            company_id,
            request.room_id,
            not_found,
        )
        return gateway_pb2.UpdateTaskResponse(task=response.task)

    async def ListTasks(self, request: gateway_pb2.ListTasksRequest, context: Any) -> gateway_pb2.ListTasksResponse:
        company_id = self._caller.company_id()
        page_size = _page_size(request.page_size)
        if request.to_agent_id:
            _required_id(request.to_agent_id, "to_agent_id")
        _check_enum(common_pb2.TaskStatus, request.status, "status")
        status = request.status
        await self._member_room(request.room_id, company_id)
        response = await self._room.ListTasks(
            room_pb2.RoomServiceListTasksRequest(
                room_id=request.room_id,
                to_agent_id=request.to_agent_id,
                status=status,
                page_size=page_size,
                page_token=request.page_token,
            ),
            timeout=self._timeout,
        )
        return gateway_pb2.ListTasksResponse(
            tasks=response.tasks, next_page_token=response.next_page_token, resume_page_token=response.resume_page_token
        )

    async def GetTask(self, request: gateway_pb2.GetTaskRequest, context: Any) -> gateway_pb2.GetTaskResponse:
        company_id = self._caller.company_id()
        if not request.task_id:
            raise InvalidArgument("task_id is required")
        await self._member_room(request.room_id, company_id)
        return gateway_pb2.GetTaskResponse(task=await self._task_in_room(request.room_id, request.task_id))

    # --- memory and files ----------------------------------------------------------------------

    async def ListMemory(self, request: gateway_pb2.ListMemoryRequest, context: Any) -> gateway_pb2.ListMemoryResponse:
        company_id = self._caller.company_id()
        page_size = _page_size(request.page_size)
        query = _optional_text(request.query, "query", MAX_QUERY_BYTES)
        await self._member_room(request.room_id, company_id)
        response = await self._room.ListMemory(
            room_pb2.RoomServiceListMemoryRequest(
                room_id=request.room_id,
                reader_company_id=company_id,
                query=query,
                page_size=page_size,
                page_token=request.page_token,
            ),
            timeout=self._timeout,
        )
        # Defence in depth: never hand out another company's private line, whatever the Room returns.
        lines = [
            line
            for line in response.lines
            if line.visibility != common_pb2.MEMORY_VISIBILITY_COMPANY or line.author.company_id == company_id
        ]
        return gateway_pb2.ListMemoryResponse(lines=lines, next_page_token=response.next_page_token)

    async def UploadFile(self, request: gateway_pb2.UploadFileRequest, context: Any) -> gateway_pb2.UploadFileResponse:
        company_id = self._caller.company_id()
        self._limiter.take(company_id)
        author = self._person(company_id, request.person)
        name = _required_text(request.name, "name", MAX_FILE_NAME_BYTES)
        content_type = _optional_text(request.content_type, "content_type", MAX_NAME_BYTES)
        if len(request.content) > MAX_FILE_BYTES:
            raise InvalidArgument(
                f"content must be at most {MAX_FILE_BYTES} bytes (10 MiB), got {len(request.content)}"
            )
        try:
            request.content.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidArgument(f"content must be UTF-8 text (invalid byte at offset {exc.start})") from None
        response = await self._write_to_room(
            self._room.UploadFile,
            room_pb2.RoomServiceUploadFileRequest(
                room_id=request.room_id,
                author=author,
                name=name,
                content_type=content_type or "text/plain",
                content=request.content,
            ),
            company_id,
            request.room_id,
        )
        return gateway_pb2.UploadFileResponse(file=response.file)

    async def ListFiles(self, request: gateway_pb2.ListFilesRequest, context: Any) -> gateway_pb2.ListFilesResponse:
        company_id = self._caller.company_id()
        page_size = _page_size(request.page_size)
        await self._member_room(request.room_id, company_id)
        response = await self._room.ListFiles(
            room_pb2.RoomServiceListFilesRequest(
                room_id=request.room_id, page_size=page_size, page_token=request.page_token
            ),
            timeout=self._timeout,
        )
        return gateway_pb2.ListFilesResponse(
            files=response.files, next_page_token=response.next_page_token, resume_page_token=response.resume_page_token
        )

    async def SearchPassages(
        self, request: gateway_pb2.SearchPassagesRequest, context: Any
    ) -> gateway_pb2.SearchPassagesResponse:
        company_id = self._caller.company_id()
        query = _required_text(request.query, "query", MAX_QUERY_BYTES)
        if not 0 <= request.limit <= MAX_PASSAGES:
            raise InvalidArgument(
                f"limit must be between 1 and {MAX_PASSAGES} (0 for the default 5), got {request.limit}"
            )
        await self._member_room(request.room_id, company_id)
        response = await self._room.SearchPassages(
            room_pb2.RoomServiceSearchPassagesRequest(room_id=request.room_id, query=query, limit=request.limit),
            timeout=self._timeout,
        )
        return gateway_pb2.SearchPassagesResponse(passages=response.passages)

    # --- runs ----------------------------------------------------------------------------------

    async def ListRuns(self, request: gateway_pb2.ListRunsRequest, context: Any) -> gateway_pb2.ListRunsResponse:
        company_id = self._caller.company_id()
        page_size = _page_size(request.page_size)
        _check_enum(common_pb2.RunStatus, request.status, "status")
        if request.room_id and not _is_uuid(request.room_id):
            raise InvalidArgument(f"room_id must be a room id (uuid), got {request.room_id[:64]!r}")
        room_request = room_pb2.RoomServiceListRunsRequest(
            page_size=page_size, page_token=request.page_token, room_id=request.room_id, status=request.status
        )
        for bound in ("started_after", "started_before"):
            if request.HasField(bound):
                getattr(room_request, bound).CopyFrom(getattr(request, bound))
        if request.agent_id:
            if not _is_uuid(request.agent_id) or await self._agent_company(request.agent_id) != company_id:
                raise NotFound(f"agent {request.agent_id[:64]!r} not found among your company's agents")
            room_request.agent_id = request.agent_id
        else:
            room_request.company_id = company_id
        response = await self._room.ListRuns(room_request, timeout=self._timeout)
        runs = [run for run in response.runs if await self._run_is_callers(run, company_id)]
        return gateway_pb2.ListRunsResponse(runs=runs, next_page_token=response.next_page_token)

    async def GetRun(self, request: gateway_pb2.GetRunRequest, context: Any) -> gateway_pb2.GetRunResponse:
        company_id = self._caller.company_id()
        if not request.run_id:
            raise InvalidArgument("run_id is required")
        not_found = NotFound(f"run {request.run_id[:64]!r} not found among your company's agents' runs")
        if len(request.run_id) > MAX_NAME_BYTES:
            raise not_found
        try:
            response = await self._room.GetRun(
                room_pb2.RoomServiceGetRunRequest(run_id=request.run_id), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise not_found from None
            raise
        if not await self._run_is_callers(response.run, company_id):
            raise not_found
        answer = gateway_pb2.GetRunResponse(run=response.run)
        if response.HasField("waitpoint") and response.waitpoint.company_id == company_id:
            answer.approval.CopyFrom(_public_waitpoint(response.waitpoint))
        return answer

    async def _run_is_callers(self, run: common_pb2.Run, company_id: str) -> bool:
        if run.company_id:
            return bool(run.company_id == company_id)
        return await self._agent_company(run.agent_id) == company_id

    # --- agent rights and approvals ------------------------------------------------------------

    async def _rights_call(self, call: Any, request: Any, agent_id: str) -> Any:
        """A rights call for the caller's default (``agent_id`` empty) or one of its agents; the Room
        decides whose the agent is, and an agent that is not the caller's answers NOT_FOUND."""
        not_found = NotFound(f"agent {agent_id[:64]!r} not found among your company's agents")
        if agent_id and not _is_uuid(agent_id):
            raise not_found
        try:
            return await call(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise not_found from None
            raise

    async def SetAgentRights(
        self, request: gateway_pb2.SetAgentRightsRequest, context: Any
    ) -> gateway_pb2.SetAgentRightsResponse:
        company_id = self._caller.company_id()
        for field in RIGHT_FIELDS:
            _check_enum(common_pb2.ActionRight, getattr(request, field), field)
        rights = common_pb2.AgentRights(
            company_id=company_id,
            agent_id=request.agent_id,
            remember=request.remember,
            create_task=request.create_task,
            update_task=request.update_task,
            close_task=request.close_task,
            cross_company_task=request.cross_company_task,
        )
        response = await self._rights_call(
            self._room.SetAgentRights,
            room_pb2.RoomServiceSetAgentRightsRequest(rights=rights, update_mask=request.update_mask),
            request.agent_id,
        )
        return gateway_pb2.SetAgentRightsResponse(rights=response.rights)

    async def GetAgentRights(
        self, request: gateway_pb2.GetAgentRightsRequest, context: Any
    ) -> gateway_pb2.GetAgentRightsResponse:
        company_id = self._caller.company_id()
        response = await self._rights_call(
            self._room.GetAgentRights,
            room_pb2.RoomServiceGetAgentRightsRequest(company_id=company_id, agent_id=request.agent_id),
            request.agent_id,
        )
        return gateway_pb2.GetAgentRightsResponse(
            company_default=response.company_default, agent=response.agent, effective=response.effective
        )

    async def ListApprovals(
        self, request: gateway_pb2.ListApprovalsRequest, context: Any
    ) -> gateway_pb2.ListApprovalsResponse:
        company_id = self._caller.company_id()
        page_size = _page_size(request.page_size)
        _check_enum(common_pb2.WaitpointStatus, request.status, "status")
        response = await self._room.ListWaitpoints(
            room_pb2.RoomServiceListWaitpointsRequest(
                company_id=company_id, status=request.status, page_size=page_size, page_token=request.page_token
            ),
            timeout=self._timeout,
        )
        # Only the owning company's approvals, whatever the Room returns.
        waitpoints = [_public_waitpoint(w) for w in response.waitpoints if w.company_id == company_id]
        return gateway_pb2.ListApprovalsResponse(
            waitpoints=waitpoints,
            next_page_token=response.next_page_token,
            resume_page_token=response.resume_page_token,
        )

    async def DecideApproval(
        self, request: gateway_pb2.DecideApprovalRequest, context: Any
    ) -> gateway_pb2.DecideApprovalResponse:
        company_id = self._caller.company_id()
        if not request.token:
            raise InvalidArgument("token is required")
        if request.index < 0:
            raise InvalidArgument(f"index must be 0 or more, got {request.index}")
        person, verified_by = self._person_name(request.person)
        not_found = NotFound(f"approval {request.token[:64]!r} (index {request.index}) not found")
        if not _is_uuid(request.token):
            raise not_found
        try:
            response = await self._room.DecideHeldAction(
                room_pb2.RoomServiceDecideHeldActionRequest(
                    token=request.token,
                    index=request.index,
                    company_id=company_id,
                    decided_by=person,
                    decided_by_verified_by=verified_by,
                    approve=request.approve,
                ),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            # The Room answers another company's token exactly as an unknown one (the room's rule).
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise not_found from None
            raise
        annotate(company_id=company_id, room_id=response.waitpoint.room_id, run_id=response.waitpoint.run_id)
        return gateway_pb2.DecideApprovalResponse(
            waitpoint=_public_waitpoint(response.waitpoint),
            completed=response.completed,
            already_decided=response.already_decided,
        )

    # --- live rooms ----------------------------------------------------------------------------

    async def WatchRoom(
        self, request: gateway_pb2.WatchRoomRequest, context: Any
    ) -> AsyncIterator[gateway_pb2.WatchRoomResponse]:
        def items(hub: RoomEventHub, company_id: str) -> AsyncIterator[gateway_pb2.WatchRoomResponse]:
            if not request.room_id:
                raise InvalidArgument("room_id is required")
            if not _is_uuid(request.room_id):
                raise NotFound(f"room {request.room_id[:64]!r} not found")
            after = request.after if request.HasField("after") else None
            if after is not None and after < 0:
                raise InvalidArgument(f"after must be a cursor (0 or more) or unset (from now), got {after}")
            return hub.watch(request.room_id, company_id, after)

        async for item in self._stream(context, items):
            yield item

    async def WatchRooms(
        self, request: gateway_pb2.WatchRoomsRequest, context: Any
    ) -> AsyncIterator[gateway_pb2.WatchRoomsResponse]:
        def items(hub: RoomEventHub, company_id: str) -> AsyncIterator[gateway_pb2.WatchRoomsResponse]:
            cursors = _room_cursors(request.after, hub.config.max_rooms)
            return hub.watch_rooms(company_id, cursors, unnamed_from_joining=request.unnamed_from_joining)

        async for item in self._stream(context, items):
            yield item

    async def _stream(
        self, context: Any, items: Callable[[RoomEventHub, str], AsyncIterator[Any]]
    ) -> AsyncIterator[Any]:
        """A watch's items, its failures answered with their status codes."""
        try:
            company_id = self._caller.company_id()
            if self._watch is None:
                raise NotImplementedError("watching is not served by this Gateway")
            async for item in items(self._watch, company_id):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:
            code, message = status_for(exc)
            if trailers := trailers_of(exc):
                context.set_trailing_metadata(trailers)
            await context.abort(code, message)


def _room_cursors(after: Any, most: int) -> dict[str, int]:
    """WatchRooms' ``after``: room id to cursor, each room once, every id well-formed."""
    if len(after) > most:
        raise InvalidArgument(f"after names {len(after)} rooms; a WatchRooms stream follows at most {most}")
    cursors: dict[str, int] = {}
    for index, named in enumerate(after):
        if not _is_uuid(named.room_id):
            raise InvalidArgument(f"after[{index}].room_id must be a room id (uuid), got {named.room_id[:64]!r}")
        if named.cursor < 0:
            raise InvalidArgument(f"after[{index}].cursor must be 0 or more, got {named.cursor}")
        room_id = named.room_id.lower()
        if room_id in cursors:
            raise InvalidArgument(f"after names room {room_id} twice")
        cursors[room_id] = int(named.cursor)
    return cursors


def _public_waitpoint(waitpoint: common_pb2.Waitpoint) -> common_pb2.Waitpoint:
    """``waitpoint`` as API clients see it: without ``traceparent``, our internal trace context."""
    public = common_pb2.Waitpoint()
    public.CopyFrom(waitpoint)
    public.ClearField("traceparent")
    return public
