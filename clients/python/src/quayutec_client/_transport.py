"""The one layer that sends Gateway calls: the RPC table read from the service descriptor, the
channel and its metadata (API key, trace context), and the retry loop."""

from __future__ import annotations

import enum
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message

from quayutec_client._proto import gateway_pb2
from quayutec_client.errors import QuayutecError, RateLimited, error_for
from quayutec_client.retry import REFUSED_BEFORE_ACTING, RETRYABLE, RetryPolicy

_propagate: ModuleType | None
try:  # Trace context follows the caller's current span when OpenTelemetry is installed; nothing when not.
    from opentelemetry import propagate as _propagate
except ImportError:  # pragma: no cover - depends on the environment
    _propagate = None

_log = logging.getLogger("quayutec_client")

SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"]


class Safety(enum.Enum):
    """What sending a call again may do, which decides the codes it is retried on."""

    READ = "read"
    # Carries an idempotency key, the same on every attempt: the Gateway does it once.
    KEYED_WRITE = "keyed write"
    # The Gateway answers a repeat as it answered the first (accepting, deciding, setting again).
    IDEMPOTENT_WRITE = "idempotent write"
    # Takes no key and a repeat would act again: retried only when refused before acting.
    UNKEYED_WRITE = "unkeyed write"

    @property
    def retry_codes(self) -> frozenset[grpc.StatusCode]:
        return REFUSED_BEFORE_ACTING if self is Safety.UNKEYED_WRITE else RETRYABLE


# Every Gateway RPC. An RPC missing here is treated as an unkeyed write (tests/clients checks the table
# against the service descriptor).
SAFETY: Mapping[str, Safety] = {
    "WhoAmI": Safety.READ,
    "CreateRoom": Safety.UNKEYED_WRITE,
    "ListRooms": Safety.READ,
    "InviteCompany": Safety.UNKEYED_WRITE,
    "ListInvitations": Safety.READ,
    "AcceptInvitation": Safety.IDEMPOTENT_WRITE,
    "DeclineInvitation": Safety.IDEMPOTENT_WRITE,
    "LeaveRoom": Safety.UNKEYED_WRITE,
    "RemoveMember": Safety.UNKEYED_WRITE,
    "ListMembers": Safety.READ,
    "RegisterAgent": Safety.UNKEYED_WRITE,
    "ListAgents": Safety.READ,
    "PostMessage": Safety.KEYED_WRITE,
    "ListMessages": Safety.READ,
    "GetMessage": Safety.READ,
    "SendTask": Safety.KEYED_WRITE,
    "UpdateTask": Safety.KEYED_WRITE,
    "ListTasks": Safety.READ,
    "GetTask": Safety.READ,
    "ListMemory": Safety.READ,
    "UploadFile": Safety.UNKEYED_WRITE,
    "ListFiles": Safety.READ,
    "SearchPassages": Safety.READ,
    "ListRuns": Safety.READ,
    "GetRun": Safety.READ,
    "SetAgentRights": Safety.IDEMPOTENT_WRITE,
    "GetAgentRights": Safety.READ,
    "ListApprovals": Safety.READ,
    "DecideApproval": Safety.IDEMPOTENT_WRITE,
    "WatchRoom": Safety.READ,
    "WatchRooms": Safety.READ,
    # A repeat would make a second key.
    "CreateSessionKey": Safety.UNKEYED_WRITE,
    # Ending an ended session leaves it ended (a repeat answers UNAUTHENTICATED: the client counts it done).
    "EndSession": Safety.IDEMPOTENT_WRITE,
    # A repeat would make a second key.
    "CreateApiKey": Safety.UNKEYED_WRITE,
    "ListApiKeys": Safety.READ,
    "RevokeApiKey": Safety.IDEMPOTENT_WRITE,
    # Setting the same provider again leaves it set (a repeat makes its sign-ins end once more).
    "SetSignInProvider": Safety.IDEMPOTENT_WRITE,
    "GetSignInProvider": Safety.READ,
    # Removing a removed provider leaves it removed.
    "RemoveSignInProvider": Safety.IDEMPOTENT_WRITE,
}


@dataclass(frozen=True)
class Rpc:
    """One Gateway RPC as the descriptor declares it."""

    name: str
    path: str
    request: type[Message]
    response: type[Message]
    server_streaming: bool
    safety: Safety


def _rpcs() -> dict[str, Rpc]:
    return {
        m.name: Rpc(
            name=m.name,
            path=f"/{SERVICE.full_name}/{m.name}",
            request=message_factory.GetMessageClass(m.input_type),
            response=message_factory.GetMessageClass(m.output_type),
            server_streaming=m.server_streaming,
            safety=SAFETY.get(m.name, Safety.UNKEYED_WRITE),
        )
        for m in SERVICE.methods
    }


RPCS = _rpcs()


class ApiKey:
    """An API key that never shows itself: not in repr, str, logs or error messages."""

    __slots__ = ("_secret",)

    def __init__(self, secret: str) -> None:
        if not secret or not secret.isascii() or not secret.isprintable() or any(c.isspace() for c in secret):
            raise ValueError("api_key must be a non-empty API key of printable ASCII without spaces (qyk_...)")
        self._secret = secret

    def bearer(self) -> tuple[str, str]:
        return ("authorization", f"Bearer {self._secret}")

    @property
    def key_id(self) -> str:
        """The key's id (``qyk_<key id>_<secret>``; not secret: ``quayutec keys list`` shows it); "" when
        the key is not shaped so."""
        key_id, sep, secret = self._secret.removeprefix("qyk_").partition("_")
        return key_id if self._secret.startswith("qyk_") and sep and secret else ""

    def __repr__(self) -> str:
        return "ApiKey(<redacted>)"

    __str__ = __repr__


class Transport:
    """A channel to one Gateway, the calls built on it, the metadata every call carries, and the
    retry loop. Shared by a client and the clients ``with_retry`` derives from it."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        key: ApiKey,
        address: str,
        *,
        sleep: Callable[[float], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.channel = channel
        self.address = address
        self.sleep = sleep
        self.clock = clock
        self.rng = rng or random.Random()
        self._key = key  # the metadata is made per call, so no attribute of this object holds the key
        self.key_id = key.key_id
        self._unary: dict[str, Any] = {}
        self._streams: dict[str, Any] = {}
        for rpc in RPCS.values():
            make = channel.unary_stream if rpc.server_streaming else channel.unary_unary
            callables = self._streams if rpc.server_streaming else self._unary
            callables[rpc.name] = make(
                rpc.path,
                request_serializer=rpc.request.SerializeToString,
                response_deserializer=rpc.response.FromString,
            )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The API key, and the caller's current trace context when OpenTelemetry is installed."""
        auth = (self._key.bearer(),)
        if _propagate is None:
            return auth
        carrier: dict[str, str] = {}
        _propagate.inject(carrier)
        return auth + tuple(carrier.items()) if carrier else auth

    async def unary(self, name: str, request: Message, policy: RetryPolicy) -> Any:
        """Send ``request`` to RPC ``name``, retried as its safety and ``policy`` allow."""
        rpc = RPCS[name]
        if type(request) is not rpc.request:
            raise TypeError(f"{name} takes {rpc.request.__name__}, not {type(request).__name__}")
        call = self._unary[name]
        started = self.clock()
        attempt = 0
        while True:
            attempt += 1
            left = policy.total_timeout - (self.clock() - started)
            try:
                return await call(
                    request,
                    timeout=max(0.001, min(policy.attempt_timeout, left)),
                    metadata=self.metadata(),
                    wait_for_ready=True,
                )
            except grpc.aio.AioRpcError as exc:
                error = error_for(exc, method=name, attempts=attempt)
                wait = self.retry_wait(policy, error, attempt, started, rpc.safety.retry_codes)
                if wait is None:
                    raise error from exc
            await self.sleep(wait)

    def stream(self, name: str, request: Message) -> grpc.aio.UnaryStreamCall:
        """Open server stream ``name`` (no deadline, waiting for the Gateway when it is not up)."""
        return self._streams[name](request, metadata=self.metadata(), wait_for_ready=True)

    def retry_wait(
        self,
        policy: RetryPolicy,
        error: QuayutecError,
        attempt: int,
        started: float,
        codes: frozenset[grpc.StatusCode] = RETRYABLE,
    ) -> float | None:
        """How long to wait before attempt ``attempt + 1`` after ``error``; None to give up."""
        if error.code not in codes or attempt >= policy.max_attempts:
            return None
        advised = error.retry_after if isinstance(error, RateLimited) else None
        if advised is not None and advised > policy.max_advised_wait:
            return None
        wait = policy.wait_before(attempt, advised, self.rng)
        if self.clock() - started + wait >= policy.total_timeout:
            return None
        _log.info(
            "%s: %s after attempt %d; retrying in %.2f s%s",
            error.method,
            error.code.name,
            attempt,
            wait,
            f" (the Gateway advised {advised:.3f} s)" if advised is not None else "",
        )
        return wait


def channel_for(
    address: str,
    *,
    plaintext: bool,
    root_certificates: bytes | None,
    server_name: str | None,
    options: Sequence[tuple[str, Any]],
) -> grpc.aio.Channel:
    if plaintext:
        return grpc.aio.insecure_channel(address, options=options)
    if server_name:
        options = (*options, ("grpc.ssl_target_name_override", server_name))
    credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    return grpc.aio.secure_channel(address, credentials, options=options)
