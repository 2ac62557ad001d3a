"""Least privilege between our services: which identity may call which internal RPC.

``RPC_CALLERS`` is the one table. Every RPC of RoomService, ClaimsService and RuntimeService has
an entry naming the identities (``quayutec.tls.IDENTITIES``) that call it in production; an RPC
with no entry admits nobody. ``AuthzInterceptor`` enforces it on every internal server before any
handler runs:

* no verified certificate naming an identity → UNAUTHENTICATED (on the mTLS port a caller without a
  certificate does not get this far: the TLS handshake refuses it and its client sees UNAVAILABLE);
* an identity the table does not name for that RPC → PERMISSION_DENIED naming both.

Health checking and reflection are open to every caller that completed the handshake.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc

from quayutec.errors import WrappedHandlers
from quayutec.tls import ADMIN, GATEWAY, RUNTIME, peer_identity

_log = logging.getLogger("quayutec.authz")

ROOM_SERVICE = "quayutec.v1.RoomService"
CLAIMS_SERVICE = "quayutec.v1.ClaimsService"
RUNTIME_SERVICE = "quayutec.v1.RuntimeService"

# Services any authenticated peer may call: health checks and reflection.
OPEN_SERVICES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)

_G = frozenset({GATEWAY})
_R = frozenset({RUNTIME})
_GR = frozenset({GATEWAY, RUNTIME})

# Who calls what, read from the callers: the Gateway's servicer and delivery loop, the Runtime's run
# executor, and the admin command line (`quayutec company create`).
_ROOM: dict[str, frozenset[str]] = {
    # Companies are made by the operator; the Gateway reads its caller's company (WhoAmI).
    "CreateCompany": frozenset({ADMIN}),
    "GetCompany": frozenset({GATEWAY, ADMIN}),
    # Rooms and membership: the public API only.
    "CreateRoom": _G,
    "RenameRoom": _G,
    "ArchiveRoom": _G,
    "GetRoom": _G,
    "ListRooms": _G,
    "CreateInvitation": _G,
    "ListInvitations": _G,
    "AcceptInvitation": _G,
    "DeclineInvitation": _G,
    "ListRoomInvitations": _G,
    "WithdrawInvitation": _G,
    "LeaveRoom": _G,
    "RemoveMember": _G,
    "ListMembers": _G,
    # The room event log behind WatchRoom: every audience when no company is named, so Gateway only.
    "ReadRoomEvents": _G,
    # Agents: registered and read through the public API; their provider key only by the Runtime.
    "RegisterAgent": _G,
    "RenameAgent": _G,
    "RetireAgent": _G,
    "GetAgent": _G,
    "ListAgents": _G,
    "GetAgentCredentials": _R,
    # Conversation and tasks: people post through the Gateway, agents' runs through the Runtime.
    "PostMessage": _GR,
    "ListMessages": _G,
    "GetMessage": _G,
    "CreateTask": _GR,
    "UpdateTask": _GR,
    "GetTask": _G,
    "ListTasks": _G,
    # Memory is written by runs only; read through the public API.
    "WriteMemory": _R,
    "ListMemory": _G,
    "UploadFile": _G,
    "ListFiles": _G,
    "SearchPassages": _G,
    # The run ledger: written by the Runtime only; read by the Runtime (resuming) and the public API.
    "RecordRun": _R,
    "GetRun": _GR,
    "ListRuns": _G,
    # Wake delivery and housekeeping: the Gateway's delivery loop.
    "LeaseWakes": _G,
    "SettleWake": _G,
    "SettleWakes": _G,
    "CountPendingWakes": _G,
    "ExpireWaitpoints": _G,
    "AbandonStaleRuns": _G,
    "RecordNotStartedRuns": _G,
    # Rights and held actions: set and decided by companies through the Gateway; a run holds an
    # action (CreateWaitpoint) and reads its decision (GetWaitpoint).
    "SetAgentRights": _G,
    "GetAgentRights": _G,
    "CreateWaitpoint": _R,
    "GetWaitpoint": _R,
    "ListWaitpoints": _G,
    "DecideHeldAction": _G,
    # What a run sees, provider key included: the Runtime only.
    "ReadRunContext": _R,
}
_CLAIMS: dict[str, frozenset[str]] = {
    # Burning a wake is the Runtime's alone; reading a claim also for the operator.
    "ClaimOnce": _R,
    "ClaimMany": _R,
    "GetClaim": frozenset({RUNTIME, ADMIN}),
}
_RUNTIME: dict[str, frozenset[str]] = {
    # Runs start from delivered wakes only.
    "StartRun": _G,
    "StartRuns": _G,
}

RPC_CALLERS: Mapping[str, frozenset[str]] = {
    f"/{service}/{method}": callers
    for service, methods in ((ROOM_SERVICE, _ROOM), (CLAIMS_SERVICE, _CLAIMS), (RUNTIME_SERVICE, _RUNTIME))
    for method, callers in methods.items()
}


def allowed_callers(method: str) -> frozenset[str]:
    """The identities that may call ``method`` ("/package.Service/Method"); empty when none may."""
    return RPC_CALLERS.get(method, frozenset())


class AuthzInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Admits a call only when the caller's certificate names an identity ``table`` allows."""

    def __init__(self, table: Mapping[str, frozenset[str]] = RPC_CALLERS) -> None:
        self._table = table
        # The guarded handler of each method, built once: per call only the caller's certificate is read.
        self._guarded = WrappedHandlers()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        return self._guarded.get(method, handler, lambda: self._guard(method, handler))

    def _guard(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        allowed = self._table.get(method, frozenset())

        async def admit(context: grpc.aio.ServicerContext) -> None:
            caller = peer_identity(context.auth_context())
            if caller is None:
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"{method} needs mutual TLS with a certificate naming a quayutec service identity",
                )
            if caller not in allowed:
                who = ", ".join(sorted(allowed)) or "no identity"
                _log.info("refused %s to %s (allowed: %s)", method, caller, who)
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED, f"{caller} may not call {method}; only {who} may"
                )

        return _guarded(handler, admit)


def _guarded(
    handler: grpc.RpcMethodHandler, admit: Callable[[grpc.aio.ServicerContext], Awaitable[None]]
) -> grpc.RpcMethodHandler:
    """``handler`` with ``admit(context)`` run before its body, for all four kinds of RPC."""
    codecs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        unary_unary = handler.unary_unary

        async def uu(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await admit(context)
            return await unary_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(uu, **codecs)
    if handler.unary_stream is not None:
        unary_stream = handler.unary_stream

        async def us(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await admit(context)
            async for response in _responses(unary_stream(request, context)):
                yield response

        return grpc.unary_stream_rpc_method_handler(us, **codecs)
    if handler.stream_unary is not None:
        stream_unary = handler.stream_unary

        async def su(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await admit(context)
            return await stream_unary(requests, context)

        return grpc.stream_unary_rpc_method_handler(su, **codecs)
    stream_stream = handler.stream_stream

    async def ss(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await admit(context)
        async for response in _responses(stream_stream(requests, context)):
            yield response

    return grpc.stream_stream_rpc_method_handler(ss, **codecs)


async def _responses(result: Any) -> AsyncIterator[Any]:
    """The responses of a streaming handler, whether it yields them or writes them with
    ``context.write`` and returns."""
    if hasattr(result, "__aiter__"):
        async for response in result:
            yield response
    elif hasattr(result, "__await__"):
        await result
    else:
        for response in result:
            yield response


# Which identity a ``CallersStub`` uses when the table lets several make a call.
CALLER_PREFERENCE = (GATEWAY, RUNTIME, ADMIN)


class CallersStub:
    """A client of one internal service that makes each RPC as an identity the table lets make it
    (the Gateway's when it may, else the Runtime's, else the admin's). For tools that stand in for
    several callers at once to set up a world (benches, tests); ``stubs`` maps identities to stubs."""

    def __init__(self, service: str, stubs: Mapping[str, Any]) -> None:
        self._service = service
        self._stubs = stubs

    def __getattr__(self, method: str) -> Any:
        callers = allowed_callers(f"/{self._service}/{method}")
        for identity in CALLER_PREFERENCE:
            if identity in callers and identity in self._stubs:
                return getattr(self._stubs[identity], method)
        raise AttributeError(f"none of {sorted(self._stubs)} may call {self._service}/{method}")
