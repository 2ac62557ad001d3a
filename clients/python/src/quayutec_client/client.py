"""The client: ``connect(address, api_key)`` and one method per Gateway RPC.

Adding an RPC: regenerate the stubs (scripts/gen_protos.py), give it a line in
``_transport.SAFETY``, and a method here marked ``@rpc("TheRpc")`` that builds the request and
calls ``self._unary`` (or ``self._paged`` for a list). tests/clients fails while one is missing.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, Protocol, TypeVar, cast

import grpc
from google.protobuf.message import Message as _ProtoMessage

from quayutec_client._checks import check_request, sequence_of_str, watch_cursor, watch_cursors
from quayutec_client._proto import common_pb2, gateway_pb2
from quayutec_client._transport import ApiKey, Transport, channel_for
from quayutec_client.errors import Unauthenticated
from quayutec_client.retry import RetryPolicy
from quayutec_client.types import (
    AcceptedInvitation,
    Agent,
    AgentRights,
    ApprovalDecision,
    Company,
    File,
    Invitation,
    KeyInfo,
    MadeKey,
    MemoryLine,
    Message,
    Passage,
    PostedMessage,
    RightsOfAgent,
    Room,
    RoomMember,
    Run,
    SentTask,
    SessionKey,
    Task,
    Waitpoint,
)
from quayutec_client.watch import RoomsWatch, RoomWatch

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

# gRPC reconnects to a Gateway that went away within this (its default ceiling is two minutes), and a
# connection whose peer fell silent (a network cut: no reset ever comes, and bytes sent into it wait on
# TCP's retransmission backoff, tens of seconds) is found out by a ping unanswered for 5 s and replaced,
# instead of holding every call made on it until TCP gives up. The Gateway accepts a ping a second.
DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


def rpc(name: str) -> Callable[[F], F]:
    """Marks the method that wraps Gateway RPC ``name`` (what the coverage test reads), and checks the
    types of its arguments before anything is built or sent: ``post_message(room, 123)`` is a TypeError
    naming ``body``, not one from deep inside protobuf."""

    def mark(method: F) -> F:
        checked = _typed(method)
        checked.__quayutec_rpc__ = name  # type: ignore[attr-defined]
        return checked

    return mark


# The annotations (strings: ``from __future__ import annotations``) whose values are checked, and what
# a value must be. A bool is never taken for an int.
_ARG_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "str": ((str,), "a str"),
    "str | None": ((str, type(None)), "a str or None"),
    "bytes | str": ((bytes, str), "bytes or a str"),
    "int": ((int,), "an int"),
    "int | None": ((int, type(None)), "an int or None"),
    "bool": ((bool,), "a bool"),
    "float | None": ((int, float, type(None)), "a number of seconds or None"),
    "int | str": ((int, str), "an int or a str"),
    "datetime | None": ((datetime, type(None)), "a datetime or None"),
}


def _typed(method: F) -> F:
    sig = inspect.signature(method)
    checks = [
        (param, *_ARG_TYPES[ann])
        for param, ann in method.__annotations__.items()
        if param != "return" and isinstance(ann, str) and ann in _ARG_TYPES
    ]
    where = method.__name__

    position = {name: i for i, name in enumerate(sig.parameters)}  # "self" is 0

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for param, types, what in checks:
            if param in kwargs:
                value = kwargs[param]
            elif position[param] < len(args):
                value = args[position[param]]
            else:
                continue  # its default
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise TypeError(f"{where}: {param} must be {what}, not {type(value).__name__} ({value!r:.40})")

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def checked_call(*args: Any, **kwargs: Any) -> Any:
            check(args, kwargs)
            return await method(*args, **kwargs)

        return cast("F", checked_call)

    @functools.wraps(method)
    def checked(*args: Any, **kwargs: Any) -> Any:
        check(args, kwargs)
        return method(*args, **kwargs)

    return cast("F", checked)


def rpc_methods() -> dict[str, str]:
    """Gateway RPC name -> the Client method that wraps it."""
    return {
        member.__quayutec_rpc__: name for name, member in vars(Client).items() if hasattr(member, "__quayutec_rpc__")
    }


@dataclass(frozen=True)
class Tls:
    """TLS to the Gateway: ``root_certificates`` (PEM) to trust instead of the system's roots, and
    ``server_name`` when the certificate names the Gateway otherwise than the address does."""

    root_certificates: bytes | None = None
    server_name: str | None = None


def new_idempotency_key() -> str:
    """A fresh key for one logical write (sent unchanged on each of its retries): a random UUID
    (version 4) as text, made from os.urandom directly, a few µs cheaper than ``str(uuid.uuid4())``."""
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # the RFC 4122 variant
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class _EnumType(Protocol):
    def Value(self, name: str) -> Any: ...
    def keys(self) -> list[str]: ...


def _enum(wrapper: _EnumType, prefix: str, value: int | str) -> Any:
    """An enum value from its value or its short name ("anthropic" -> PROVIDER_ANTHROPIC)."""
    if isinstance(value, int):
        return value
    try:
        return wrapper.Value(prefix + value.upper())
    except ValueError:
        names = [n.removeprefix(prefix).lower() for n in wrapper.keys() if not n.endswith("_UNSPECIFIED")]
        raise ValueError(f"{value!r} is not one of {names}") from None


# Where connect() looks when it is not given the address or the key.
GATEWAY_ENV = "QUAYUTEC_GATEWAY"
GATEWAY_ADDR_ENV = "QUAYUTEC_GATEWAY_ADDR"
API_KEY_ENV = "QUAYUTEC_API_KEY"


def check_address(address: str) -> str:
    """``address`` when it is a gRPC target the client can dial ("host:port", "[::1]:port",
    "unix:/path", "dns:///host:port"); else ValueError saying what is wrong."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str (host:port), not {type(address).__name__}")
    address = address.strip()
    if not address:
        raise ValueError(f'address is empty: pass the Gateway as "host:port" (or set {GATEWAY_ENV})')
    scheme, sep, rest = address.partition("://")
    if sep and scheme in ("http", "https", "grpc", "grpcs"):
        hint = "and plaintext=True " if scheme in ("http", "grpc") else ""
        raise ValueError(f'address {address!r} is a URL: pass "host:port" ({rest.rstrip("/")!r}) {hint}instead')
    if address.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:")):
        return address
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f'address {address!r} is not "host:port" with a port from 1 to 65535')
    return address


def connect(
    address: str | None = None,
    api_key: str | None = None,
    *,
    tls: Tls | None = None,
    plaintext: bool = False,
    retry: RetryPolicy | None = None,
    channel_options: Sequence[tuple[str, Any]] = (),
) -> Client:
    """A client of the Gateway at ``address`` ("host:port") calling as the company of ``api_key``
    (when not given, from the environment variables QUAYUTEC_GATEWAY, else QUAYUTEC_GATEWAY_ADDR, and
    QUAYUTEC_API_KEY).

    TLS is on, with the system's roots unless ``tls`` names others; ``plaintext=True`` turns it off
    (a Gateway on your own machine). ``retry`` is the policy of every call (``RetryPolicy()`` by
    default). Call it anywhere (the channel is made at the first call, in that call's event
    loop); close the client with ``await client.close()`` or
    ``async with connect(...) as client``.
    """
    if plaintext and tls is not None:
        raise ValueError("plaintext=True and tls options contradict each other: choose one")
    if address is None:  # QUAYUTEC_GATEWAY_ADDR is what `quayutec up` exports for the CLI
        address = os.environ.get(GATEWAY_ENV) or os.environ.get(GATEWAY_ADDR_ENV, "")
    address = check_address(address)
    if api_key is None:
        api_key = os.environ.get(API_KEY_ENV, "")
        if not api_key:
            raise ValueError(f"no api_key given and {API_KEY_ENV} is not set")
    key = ApiKey(api_key)
    tls = tls or Tls()
    options = (*DEFAULT_CHANNEL_OPTIONS, *channel_options)

    def channel() -> grpc.aio.Channel:
        return channel_for(
            address,
            plaintext=plaintext,
            root_certificates=tls.root_certificates,
            server_name=tls.server_name,
            options=options,
        )

    return Client(Transport(channel, key, address, sleep=asyncio.sleep), retry or RetryPolicy())


class Pages(AsyncIterator[T]):
    """A list call's items, page after page. An iterator object rather than an async generator: one
    left before its end (``break``) has nothing to close, where a generator costs the event loop a
    task to finalize it, on every such loop.

    Resumable: ``page_token`` is the token of the page being read ("" for the first), and
    ``next_page_token`` that of the page after it ("" when it is the last); pass either as the list
    method's ``page_token`` later (another process too) to go on from there. Resuming from
    ``page_token`` reads the current page again, so nothing is missed."""

    def __init__(
        self, client: Client, timeout: float | None, name: str, request: Any, items: Callable[[Any], Iterable[T]]
    ) -> None:
        self._client = client
        self._timeout = timeout
        self._name = name
        self._request = request
        self._items = items
        self._page: Iterator[T] = iter(())
        self._more = True  # a next page may hold more
        self.page_token: str = request.page_token
        self.next_page_token: str = request.page_token

    async def __anext__(self) -> T:
        for item in self._page:
            return item
        while self._more:
            page = await self._client._unary(self._timeout, self._name, self._request)
            self.page_token = self._request.page_token
            self.next_page_token = page.next_page_token
            self._more = bool(page.next_page_token)
            self._request.page_token = page.next_page_token
            self._page = iter(self._items(page))
            for item in self._page:
                return item
        raise StopAsyncIteration


class Client:
    """The Gateway API as the calling company sees it. Every method retries as its policy allows
    and raises a ``quayutec_client.errors.QuayutecError`` subclass when it fails."""

    def __init__(self, transport: Transport, policy: RetryPolicy) -> None:
        self._transport = transport
        self.retry_policy = policy

    def __repr__(self) -> str:
        return f"Client(address={self._transport.address!r}, retry_policy={self.retry_policy!r})"

    def with_retry(self, policy: RetryPolicy) -> Client:
        """The same client (one channel) with another retry policy."""
        return Client(self._transport, policy)

    async def close(self) -> None:
        """Close the channel (of this client and those made from it with ``with_retry``): every call
        and watch under way, or waiting to retry, ends with ``errors.Closed``, and so does any later one."""
        await self._transport.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _unary(self, timeout: float | None, name: str, request: _ProtoMessage) -> Awaitable[Any]:
        return self._transport.unary(name, request, self.retry_policy, timeout)

    def _paged(self, timeout: float | None, name: str, request: Any, items: Callable[[Any], Iterable[T]]) -> Pages[T]:
        """Every item of every page, each page fetched (and retried, within ``timeout`` each) when the
        previous one is used up."""
        return Pages(self, timeout, name, request, items)

    # Identity and rooms.

    @rpc("WhoAmI")
    async def who_am_i(self, *, timeout: float | None = None) -> Company:
        """The company the API key names."""
        response: gateway_pb2.WhoAmIResponse = await self._unary(timeout, "WhoAmI", gateway_pb2.WhoAmIRequest())
        return response.company

    @rpc("CreateRoom")
    async def create_room(self, name: str, *, idempotency_key: str | None = None, timeout: float | None = None) -> Room:
        """A new room; your company is its first member. Safe to retry, as ``post_message``: a repeat of
        ``idempotency_key`` answers the first room."""
        request = gateway_pb2.CreateRoomRequest(name=name, idempotency_key=idempotency_key or new_idempotency_key())
        response: gateway_pb2.CreateRoomResponse = await self._unary(timeout, "CreateRoom", request)
        return response.room

    @rpc("RenameRoom")
    async def rename_room(self, room_id: str, name: str, *, timeout: float | None = None) -> Room:
        """Rename a room your company created (its creator only). Names are unique among the rooms a
        company creates, trimmed and case ignored: a taken one raises ``AlreadyExists`` naming the room
        that has it. Safe to retry: renaming again to the same name changes nothing."""
        request = gateway_pb2.RenameRoomRequest(room_id=room_id, name=name)
        response: gateway_pb2.RenameRoomResponse = await self._unary(timeout, "RenameRoom", request)
        return response.room

    @rpc("ArchiveRoom")
    async def archive_room(self, room_id: str, *, timeout: float | None = None) -> Room:
        """Archive a room your company created: read-only from then on (writes raise
        ``FailedPrecondition`` saying it is archived), its history readable; ``archived_at`` is set.
        Safe to retry: archiving again changes nothing."""
        request = gateway_pb2.ArchiveRoomRequest(room_id=room_id)
        response: gateway_pb2.ArchiveRoomResponse = await self._unary(timeout, "ArchiveRoom", request)
        return response.room

    @rpc("ListRooms")
    def rooms(self, *, page_size: int = 0, page_token: str = "", timeout: float | None = None) -> Pages[Room]:
        """The rooms your company is a member of."""
        return self._paged(
            timeout,
            "ListRooms",
            gateway_pb2.ListRoomsRequest(page_size=page_size, page_token=page_token),
            lambda p: p.rooms,
        )

    @rpc("ListMembers")
    def members(
        self, room_id: str, *, page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> Pages[RoomMember]:
        """The member companies of a room."""
        request = gateway_pb2.ListMembersRequest(room_id=room_id, page_size=page_size, page_token=page_token)
        return self._paged(timeout, "ListMembers", request, lambda p: p.members)

    # Invitations and membership.

    @rpc("InviteCompany")
    async def invite_company(
        self, room_id: str, company_id: str, *, idempotency_key: str | None = None, timeout: float | None = None
    ) -> Invitation:
        """Invite a company into a room; it becomes a member when it accepts. Safe to retry, as
        ``post_message``: a repeat of ``idempotency_key`` answers the first invitation."""
        request = gateway_pb2.InviteCompanyRequest(
            room_id=room_id, company_id=company_id, idempotency_key=idempotency_key or new_idempotency_key()
        )
        response: gateway_pb2.InviteCompanyResponse = await self._unary(timeout, "InviteCompany", request)
        return response.invitation

    @rpc("ListInvitations")
    def invitations(
        self,
        *,
        status: int | str = 0,
        sent: bool = False,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Pages[Invitation]:
        """Invitations to your company (or, ``sent``, those it sent), oldest first: pending ones unless
        ``status`` says otherwise."""
        request = gateway_pb2.ListInvitationsRequest(
            status=_enum(common_pb2.InvitationStatus, "INVITATION_STATUS_", status),
            sent=sent,
            page_size=page_size,
            page_token=page_token,
        )
        return self._paged(timeout, "ListInvitations", request, lambda p: p.invitations)

    @rpc("AcceptInvitation")
    async def accept_invitation(self, invitation_id: str, *, timeout: float | None = None) -> AcceptedInvitation:
        """Become a member of the invitation's room (accepting again answers the same)."""
        request = gateway_pb2.AcceptInvitationRequest(invitation_id=invitation_id)
        response: AcceptedInvitation = await self._unary(timeout, "AcceptInvitation", request)
        return response

    @rpc("DeclineInvitation")
    async def decline_invitation(self, invitation_id: str, *, timeout: float | None = None) -> Invitation:
        """Refuse an invitation (declining again changes nothing)."""
        request = gateway_pb2.DeclineInvitationRequest(invitation_id=invitation_id)
        response: gateway_pb2.DeclineInvitationResponse = await self._unary(timeout, "DeclineInvitation", request)
        return response.invitation

    @rpc("ListRoomInvitations")
    def room_invitations(
        self,
        room_id: str,
        *,
        status: int | str = 0,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Pages[Invitation]:
        """Every invitation into a room your company created, oldest first: pending ones unless ``status``
        says otherwise."""
        request = gateway_pb2.ListRoomInvitationsRequest(
            room_id=room_id,
            status=_enum(common_pb2.InvitationStatus, "INVITATION_STATUS_", status),
            page_size=page_size,
            page_token=page_token,
        )
        return self._paged(timeout, "ListRoomInvitations", request, lambda p: p.invitations)

    @rpc("WithdrawInvitation")
    async def withdraw_invitation(self, invitation_id: str, *, timeout: float | None = None) -> Invitation:
        """Withdraw a pending invitation (the room's creator, or its sender); withdrawing again changes nothing."""
        request = gateway_pb2.WithdrawInvitationRequest(invitation_id=invitation_id)
        response: gateway_pb2.WithdrawInvitationResponse = await self._unary(timeout, "WithdrawInvitation", request)
        return response.invitation

    @rpc("LeaveRoom")
    async def leave_room(self, room_id: str, *, timeout: float | None = None) -> None:
        """End your company's membership at once."""
        await self._unary(timeout, "LeaveRoom", gateway_pb2.LeaveRoomRequest(room_id=room_id))

    @rpc("RemoveMember")
    async def remove_member(self, room_id: str, company_id: str, *, timeout: float | None = None) -> None:
        """End another company's membership (the room's creator only)."""
        await self._unary(
            timeout, "RemoveMember", gateway_pb2.RemoveMemberRequest(room_id=room_id, company_id=company_id)
        )

    # Agents.

    @rpc("RenameAgent")
    async def rename_agent(self, agent_id: str, name: str, *, timeout: float | None = None) -> Agent:
        """Rename one of your company's agents. Names are unique within a company, trimmed and case
        ignored (retired agents' too): a taken one raises ``AlreadyExists`` naming the agent that has
        it. Safe to retry: renaming again to the same name changes nothing."""
        request = gateway_pb2.RenameAgentRequest(agent_id=agent_id, name=name)
        response: gateway_pb2.RenameAgentResponse = await self._unary(timeout, "RenameAgent", request)
        return response.agent

    @rpc("RetireAgent")
    async def retire_agent(self, agent_id: str, *, timeout: float | None = None) -> Agent:
        """Retire one of your company's agents: it wakes no more (a mention of it makes no wake); its runs
        and messages stay, and ``retired_at`` is set. Safe to retry: retiring again changes nothing."""
        request = gateway_pb2.RetireAgentRequest(agent_id=agent_id)
        response: gateway_pb2.RetireAgentResponse = await self._unary(timeout, "RetireAgent", request)
        return response.agent

    @rpc("RegisterAgent")
    async def register_agent(
        self,
        name: str,
        *,
        provider: int | str,
        model: str,
        provider_key: str = "",
        base_url: str = "",
        system_prompt: str = "",
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> Agent:
        """An always-on agent of your company; ``provider`` is "anthropic", "openai" or
        "openai_compatible" (with ``base_url``). The provider key is stored encrypted, never returned.
        Safe to retry, as ``post_message``: a repeat of ``idempotency_key`` answers the first agent."""
        request = gateway_pb2.RegisterAgentRequest(
            name=name,
            provider=_enum(common_pb2.Provider, "PROVIDER_", provider),
            model=model,
            provider_key=provider_key,
            base_url=base_url,
            system_prompt=system_prompt,
            idempotency_key=idempotency_key or new_idempotency_key(),
        )
        response: gateway_pb2.RegisterAgentResponse = await self._unary(timeout, "RegisterAgent", request)
        return response.agent

    @rpc("ListAgents")
    def agents(
        self, *, room_id: str = "", page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> Pages[Agent]:
        """Your company's agents; with ``room_id``, the agents in that room (every member company's, another
        company's by id, name and company only)."""
        request = gateway_pb2.ListAgentsRequest(room_id=room_id, page_size=page_size, page_token=page_token)
        return self._paged(timeout, "ListAgents", request, lambda p: p.agents)

    # Messages and tasks.

    @rpc("PostMessage")
    async def post_message(
        self,
        room_id: str,
        body: str,
        *,
        person: str,
        mentions: list[str] | tuple[str, ...] = (),
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> PostedMessage:
        """Post as ``person`` of your company, waking each agent in ``mentions`` (agent ids) once.

        Safe to retry: the call carries ``idempotency_key`` (a fresh one when None), the same on every
        retry, so it posts once. Pass your own to make retries of your own (after a crash) safe too."""
        request = gateway_pb2.PostMessageRequest(
            room_id=room_id,
            person=person,
            body=body,
            mention_agent_ids=sequence_of_str(mentions, "mentions"),
            idempotency_key=idempotency_key or new_idempotency_key(),
        )
        response: PostedMessage = await self._unary(timeout, "PostMessage", request)
        return response

    @rpc("ListMessages")
    def messages(
        self,
        room_id: str,
        *,
        newest_first: bool = False,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Pages[Message]:
        """A room's messages, oldest first unless ``newest_first``."""
        request = gateway_pb2.ListMessagesRequest(
            room_id=room_id, newest_first=newest_first, page_size=page_size, page_token=page_token
        )
        return self._paged(timeout, "ListMessages", request, lambda p: p.messages)

    @rpc("SendTask")
    async def send_task(
        self,
        room_id: str,
        *,
        to_agent_id: str,
        title: str,
        person: str,
        body: str = "",
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> SentTask:
        """Send a task from ``person`` to an agent in the room, waking it once (safe to retry, as
        ``post_message``)."""
        request = gateway_pb2.SendTaskRequest(
            room_id=room_id,
            person=person,
            to_agent_id=to_agent_id,
            title=title,
            body=body,
            idempotency_key=idempotency_key or new_idempotency_key(),
        )
        response: SentTask = await self._unary(timeout, "SendTask", request)
        return response

    @rpc("UpdateTask")
    async def update_task(
        self,
        room_id: str,
        task_id: str,
        *,
        person: str,
        note: str = "",
        status: int | str = 0,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> Task:
        """Add a note to a task; ``status`` "done" or "cancelled" closes it (safe to retry)."""
        request = gateway_pb2.UpdateTaskRequest(
            room_id=room_id,
            task_id=task_id,
            person=person,
            note=note,
            status=_enum(common_pb2.TaskStatus, "TASK_STATUS_", status),
            idempotency_key=idempotency_key or new_idempotency_key(),
        )
        response: gateway_pb2.UpdateTaskResponse = await self._unary(timeout, "UpdateTask", request)
        return response.task

    @rpc("ListTasks")
    def tasks(
        self,
        room_id: str,
        *,
        to_agent_id: str = "",
        status: int | str = 0,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Pages[Task]:
        """A room's tasks, optionally those of one agent or in one status."""
        request = gateway_pb2.ListTasksRequest(
            room_id=room_id,
            to_agent_id=to_agent_id,
            status=_enum(common_pb2.TaskStatus, "TASK_STATUS_", status),
            page_size=page_size,
            page_token=page_token,
        )
        return self._paged(timeout, "ListTasks", request, lambda p: p.tasks)

    @rpc("GetTask")
    async def get_task(self, room_id: str, task_id: str, *, timeout: float | None = None) -> Task:
        """One task with its updates."""
        request = gateway_pb2.GetTaskRequest(room_id=room_id, task_id=task_id)
        response: gateway_pb2.GetTaskResponse = await self._unary(timeout, "GetTask", request)
        return response.task

    # Memory and files.

    @rpc("ListMemory")
    def memory(
        self, room_id: str, *, query: str = "", page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> Pages[MemoryLine]:
        """Memory lines your company may read (room-wide and its own), optionally searched."""
        request = gateway_pb2.ListMemoryRequest(
            room_id=room_id, query=query, page_size=page_size, page_token=page_token
        )
        return self._paged(timeout, "ListMemory", request, lambda p: p.lines)

    @rpc("UploadFile")
    async def upload_file(
        self,
        room_id: str,
        name: str,
        content: bytes | str,
        *,
        person: str,
        content_type: str = "text/plain",
        timeout: float | None = None,
    ) -> File:
        """Upload UTF-8 text (at most 10 MiB) into a room, searchable by passage."""
        data = content.encode("utf-8") if isinstance(content, str) else content
        request = gateway_pb2.UploadFileRequest(
            room_id=room_id, person=person, name=name, content_type=content_type, content=data
        )
        response: gateway_pb2.UploadFileResponse = await self._unary(timeout, "UploadFile", request)
        return response.file

    @rpc("ListFiles")
    def files(
        self, room_id: str, *, page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> Pages[File]:
        """A room's files (without their content)."""
        request = gateway_pb2.ListFilesRequest(room_id=room_id, page_size=page_size, page_token=page_token)
        return self._paged(timeout, "ListFiles", request, lambda p: p.files)

    @rpc("SearchPassages")
    async def search_passages(
        self, room_id: str, query: str, *, limit: int = 0, timeout: float | None = None
    ) -> list[Passage]:
        """The passages of a room's files that best match ``query``."""
        request = gateway_pb2.SearchPassagesRequest(room_id=room_id, query=query, limit=limit)
        response: gateway_pb2.SearchPassagesResponse = await self._unary(timeout, "SearchPassages", request)
        return list(response.passages)

    # Runs, rights and approvals.

    @rpc("ListRuns")
    def runs(
        self,
        *,
        agent_id: str = "",
        room_id: str = "",
        status: int | str = 0,
        started_after: datetime | None = None,
        started_before: datetime | None = None,
        page_size: int = 0,
        page_token: str = "",
        timeout: float | None = None,
    ) -> Pages[Run]:
        """Your agents' runs (or one agent's), newest first; optionally in one room, with one status
        ("failed"...), started at or after ``started_after`` and before ``started_before``."""
        request = gateway_pb2.ListRunsRequest(
            agent_id=agent_id,
            room_id=room_id,
            status=_enum(common_pb2.RunStatus, "RUN_STATUS_", status),
            page_size=page_size,
            page_token=page_token,
        )
        if started_after is not None:
            request.started_after.FromDatetime(started_after)
        if started_before is not None:
            request.started_before.FromDatetime(started_before)
        return self._paged(timeout, "ListRuns", request, lambda p: p.runs)

    @rpc("GetRun")
    async def get_run(self, run_id: str, *, timeout: float | None = None) -> Run:
        """One run's ledger row: what it posted and wrote, each model request, its trace id."""
        response: gateway_pb2.GetRunResponse = await self._unary(
            timeout, "GetRun", gateway_pb2.GetRunRequest(run_id=run_id)
        )
        return response.run

    @rpc("GetMessage")
    async def get_message(self, room_id: str, message_id: str, *, timeout: float | None = None) -> Message:
        """One message of a room (an agent's reply carries the ``run_id`` that posted it)."""
        request = gateway_pb2.GetMessageRequest(room_id=room_id, message_id=message_id)
        response: gateway_pb2.GetMessageResponse = await self._unary(timeout, "GetMessage", request)
        return response.message

    # Your company's API keys.

    @rpc("CreateApiKey")
    async def create_api_key(
        self, label: str = "", *, idempotency_key: str | None = None, timeout: float | None = None
    ) -> MadeKey:
        """A new API key of your company (call with a company key: a session key may not). Its
        ``secret`` is in this answer (and a repeat's) only; keep it. Safe to retry, as ``post_message``:
        a repeat of ``idempotency_key`` answers the first key and its secret."""
        request = gateway_pb2.CreateApiKeyRequest(label=label, idempotency_key=idempotency_key or new_idempotency_key())
        response: MadeKey = await self._unary(timeout, "CreateApiKey", request)
        return response

    @rpc("ListApiKeys")
    def api_keys(
        self, *, include_sessions: bool = False, page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> Pages[KeyInfo]:
        """Your company's keys, oldest first (never a secret); its session keys too when asked."""
        request = gateway_pb2.ListApiKeysRequest(
            include_sessions=include_sessions, page_size=page_size, page_token=page_token
        )
        return self._paged(timeout, "ListApiKeys", request, lambda p: p.keys)

    @rpc("RevokeApiKey")
    async def revoke_api_key(self, key_id: str, *, timeout: float | None = None) -> KeyInfo:
        """Revoke one of your company's keys at once (its session keys with it)."""
        request = gateway_pb2.RevokeApiKeyRequest(key_id=key_id)
        response: gateway_pb2.RevokeApiKeyResponse = await self._unary(timeout, "RevokeApiKey", request)
        return response.key

    @rpc("SetSignInProvider")
    async def set_sign_in_provider(
        self,
        issuer: str,
        client_id: str,
        client_secret: str,
        *,
        email_domains: Sequence[str] = (),
        allow_api_key_sign_in: bool = False,
        timeout: float | None = None,
    ) -> gateway_pb2.SignInProvider:
        """Register (or replace) the OpenID Connect provider your people sign in to the console with
        (call with a company key). The secret is stored encrypted and never returned."""
        request = gateway_pb2.SetSignInProviderRequest(
            issuer=issuer,
            client_id=client_id,
            client_secret=client_secret,
            email_domains=list(email_domains),
            allow_api_key_sign_in=allow_api_key_sign_in,
        )
        response: gateway_pb2.SetSignInProviderResponse = await self._unary(timeout, "SetSignInProvider", request)
        return response.provider

    @rpc("GetSignInProvider")
    async def sign_in_provider(self, *, timeout: float | None = None) -> gateway_pb2.SignInProvider | None:
        """Your company's sign-in provider (never its secret), or None when none is set."""
        request = gateway_pb2.GetSignInProviderRequest()
        response: gateway_pb2.GetSignInProviderResponse = await self._unary(timeout, "GetSignInProvider", request)
        return response.provider if response.found else None

    @rpc("RemoveSignInProvider")
    async def remove_sign_in_provider(self, *, timeout: float | None = None) -> bool:
        """Remove your company's sign-in provider (its sign-ins end); False when none was set."""
        request = gateway_pb2.RemoveSignInProviderRequest()
        response: gateway_pb2.RemoveSignInProviderResponse = await self._unary(timeout, "RemoveSignInProvider", request)
        return response.removed

    @rpc("SetAgentRights")
    async def set_agent_rights(
        self,
        *,
        agent_id: str = "",
        remember: int | str | None = None,
        create_task: int | str | None = None,
        update_task: int | str | None = None,
        close_task: int | str | None = None,
        cross_company_task: int | str | None = None,
        replace: bool = False,
        timeout: float | None = None,
    ) -> AgentRights:
        """Set "auto", "hold" or "deny" per action for one agent, or for all (``agent_id`` empty).

        Only the rights you name change; the others keep what is stored ("unspecified" clears one,
        so it is inherited again). ``replace=True`` replaces every right, those not named cleared."""
        named = {
            "remember": remember,
            "create_task": create_task,
            "update_task": update_task,
            "close_task": close_task,
            "cross_company_task": cross_company_task,
        }
        given = {k: _enum(common_pb2.ActionRight, "ACTION_RIGHT_", v) for k, v in named.items() if v is not None}
        request = gateway_pb2.SetAgentRightsRequest(agent_id=agent_id, **given)
        if not replace:
            if not given:
                raise ValueError("name at least one right to set (or replace=True to clear them all)")
            request.update_mask.paths.extend(given)
        response: gateway_pb2.SetAgentRightsResponse = await self._unary(timeout, "SetAgentRights", request)
        return response.rights

    @rpc("GetAgentRights")
    async def get_agent_rights(self, agent_id: str = "", *, timeout: float | None = None) -> RightsOfAgent:
        """Stored and effective rights of your default (``agent_id`` empty) or of one agent."""
        response: RightsOfAgent = await self._unary(
            timeout, "GetAgentRights", gateway_pb2.GetAgentRightsRequest(agent_id=agent_id)
        )
        return response

    @rpc("ListApprovals")
    def approvals(
        self, *, status: int | str = 0, page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> Pages[Waitpoint]:
        """Your parked runs whose held actions await your decision (pending unless ``status``)."""
        request = gateway_pb2.ListApprovalsRequest(
            status=_enum(common_pb2.WaitpointStatus, "WAITPOINT_STATUS_", status),
            page_size=page_size,
            page_token=page_token,
        )
        return self._paged(timeout, "ListApprovals", request, lambda p: p.waitpoints)

    @rpc("DecideApproval")
    async def decide_approval(
        self, token: str, index: int, *, person: str, approve: bool, timeout: float | None = None
    ) -> ApprovalDecision:
        """Approve or deny one held action; the decision that completes a waitpoint continues its run
        once (deciding again the same way answers ``already_decided``)."""
        request = gateway_pb2.DecideApprovalRequest(token=token, index=index, person=person, approve=approve)
        response: ApprovalDecision = await self._unary(timeout, "DecideApproval", request)
        return response

    # Following a room.

    @rpc("WatchRoom")
    def watch(self, room_id: str, *, after: int | None = None, idle_timeout: float = 60.0) -> RoomWatch:
        """A room's events, replayed after ``after`` (a cursor you kept; 0: from the oldest kept) and
        then live, as they happen; without ``after``, from now. See ``RoomWatch``."""
        check_request("WatchRoom", gateway_pb2.WatchRoomRequest(room_id=room_id))
        after = watch_cursor(after)
        return RoomWatch(self._transport, self.retry_policy, room_id, after=after, idle_timeout=idle_timeout)

    @rpc("WatchRooms")
    def watch_rooms(self, *, after: Mapping[str, int] | None = None, idle_timeout: float = 60.0) -> RoomsWatch:
        """Every room of your company in one stream: the rooms ``after`` names (room id -> a cursor you
        kept) resumed after their cursors and the others from their joining; without ``after``, from now.
        ``watch.cursors`` is the map to keep. See ``RoomsWatch``."""
        return RoomsWatch(self._transport, self.retry_policy, after=watch_cursors(after), idle_timeout=idle_timeout)

    # Session keys.

    @rpc("CreateSessionKey")
    async def create_session_key(
        self,
        ttl_seconds: int,
        *,
        label: str = "",
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> SessionKey:
        """A short-lived key of your company (``ttl_seconds``: 60 to 604800) that works like this one
        until it expires or is ended (``end_session`` called with it); ``.secret`` is shown in this
        answer (and a repeat's) only. Call it with a company key. Safe to retry, as ``post_message``: a
        repeat of ``idempotency_key`` answers the first key and its secret."""
        request = gateway_pb2.CreateSessionKeyRequest(
            ttl_seconds=ttl_seconds, label=label, idempotency_key=idempotency_key or new_idempotency_key()
        )
        response: SessionKey = await self._unary(timeout, "CreateSessionKey", request)
        return response

    @rpc("EndSession")
    async def end_session(self, *, timeout: float | None = None) -> str:
        """Revoke the session key this client calls with, at once (its open watches end with
        Unauthenticated); returns its key id. Retried like a read: when a retry is answered
        UNAUTHENTICATED, an earlier attempt ended the session, and the call returns as done.
        FailedPrecondition when this client's key is a company key (revoke those with ``quayutec keys
        revoke``)."""
        try:
            response: gateway_pb2.EndSessionResponse = await self._unary(
                timeout, "EndSession", gateway_pb2.EndSessionRequest()
            )
        except Unauthenticated as exc:
            if exc.attempts > 1 and self._transport.key_id:
                return self._transport.key_id  # the session was ended by an attempt whose answer was lost
            raise
        return response.key_id
