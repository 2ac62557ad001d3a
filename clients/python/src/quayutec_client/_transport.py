"""The one layer that sends Gateway calls: the RPC table read from the service descriptor, the
channel and its metadata (API key, trace context), and the retry loop."""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.message import Message

from quayutec_client._checks import check_request
from quayutec_client._proto import gateway_pb2
from quayutec_client.errors import (
    Closed,
    ConnectionFailed,
    QuayutecError,
    RateLimited,
    connection_failure,
    error_for,
)
from quayutec_client.retry import REFUSED_BEFORE_ACTING, RETRYABLE, RetryPolicy

_propagate: ModuleType | None
try:  # Trace context follows the caller's current span when OpenTelemetry is installed; nothing when not.
    from opentelemetry import propagate as _propagate
except ImportError:  # pragma: no cover - depends on the environment
    _propagate = None

_log = logging.getLogger("quayutec_client")

# A Gateway that closes this many new connections in a row before gRPC begins is taken to speak
# something else (TLS, when the client has it off).
CLOSED_EARLY_LIMIT = 4

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
    "CreateRoom": Safety.KEYED_WRITE,
    "RenameRoom": Safety.IDEMPOTENT_WRITE,
    "ArchiveRoom": Safety.IDEMPOTENT_WRITE,
    "RenameAgent": Safety.IDEMPOTENT_WRITE,
    "RetireAgent": Safety.IDEMPOTENT_WRITE,
    "ListRooms": Safety.READ,
    "InviteCompany": Safety.KEYED_WRITE,
    "ListInvitations": Safety.READ,
    "AcceptInvitation": Safety.IDEMPOTENT_WRITE,
    "DeclineInvitation": Safety.IDEMPOTENT_WRITE,
    "ListRoomInvitations": Safety.READ,
    "WithdrawInvitation": Safety.IDEMPOTENT_WRITE,
    "LeaveRoom": Safety.UNKEYED_WRITE,
    "RemoveMember": Safety.UNKEYED_WRITE,
    "ListMembers": Safety.READ,
    "RegisterAgent": Safety.KEYED_WRITE,
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
    "CreateSessionKey": Safety.KEYED_WRITE,
    # Ending an ended session leaves it ended (a repeat answers UNAUTHENTICATED: the client counts it done).
    "EndSession": Safety.IDEMPOTENT_WRITE,
    "CreateApiKey": Safety.KEYED_WRITE,
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
        channel: Callable[[], grpc.aio.Channel],
        key: ApiKey,
        address: str,
        *,
        sleep: Callable[[float], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        # The channel is made at the first call, in the event loop that makes it (gRPC binds a channel
        # to the loop it is made in): a client made at import time works under a later asyncio.run.
        self._make_channel = channel
        self._channel: grpc.aio.Channel | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop the channel was made in
        self.address = address
        self.sleep = sleep
        self.clock = clock
        self.rng = rng or random.Random()
        self._closed = asyncio.Event()
        self._key = key  # the metadata is made per call, so no attribute of this object holds the key
        self.key_id = key.key_id
        self._unary: dict[str, Any] = {}
        self._streams: dict[str, Any] = {}

    @property
    def channel(self) -> grpc.aio.Channel:
        """The channel (made, with a callable per RPC, on first use)."""
        if self._channel is None:
            self._loop = asyncio.get_running_loop()
            channel = self._channel = self._make_channel()
            for rpc in RPCS.values():
                make = channel.unary_stream if rpc.server_streaming else channel.unary_unary
                callables = self._streams if rpc.server_streaming else self._unary
                callables[rpc.name] = make(
                    rpc.path,
                    request_serializer=rpc.request.SerializeToString,
                    response_deserializer=rpc.response.FromString,
                )
        return self._channel

    def _callable(self, name: str) -> Any:
        self.channel  # noqa: B018 - makes the channel and the callables on first use
        return self._streams[name] if RPCS[name].server_streaming else self._unary[name]

    def same_loop(self, method: str) -> None:
        """RuntimeError naming the rule when this client is used from an event loop other than the one
        its channel was made in (gRPC binds a channel to one loop): one client per event loop."""
        if self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self._loop:
            was = "closed" if self._loop.is_closed() else "another, still open"
            raise RuntimeError(
                f"{method}: this client was first used in another event loop ({was}), and gRPC binds a client's "
                "channel to the loop it was made in: use one client per event loop, e.g. call connect() inside the "
                "coroutine that asyncio.run() runs (or inside each asyncio.run call), and close it there"
            )

    def metadata(self, request_id: str = "") -> tuple[tuple[str, str], ...]:
        """The API key, the call's request id, and the caller's current trace context when OpenTelemetry
        is installed (the Gateway links its own trace to it; it does not decide the Gateway's sampling)."""
        auth = (self._key.bearer(),) + ((("x-request-id", request_id),) if request_id else ())
        if _propagate is None:
            return auth
        carrier: dict[str, str] = {}
        _propagate.inject(carrier)
        return auth + tuple(carrier.items()) if carrier else auth

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def close(self) -> None:
        """Close the channel: every call and watch under way, or waiting to retry, ends with Closed."""
        self._closed.set()
        if self._channel is not None:
            await self._channel.close()

    def closed_error(self, method: str, attempts: int) -> Closed:
        return Closed(grpc.StatusCode.CANCELLED, "the client was closed", method=method, attempts=attempts)

    async def pause(self, seconds: float, method: str, attempts: int) -> None:
        """Wait ``seconds`` before a retry; Closed at once if the client is closed meanwhile."""
        closing = asyncio.ensure_future(self._closed.wait())
        waiting = asyncio.ensure_future(self.sleep(seconds))
        try:
            await asyncio.wait((closing, waiting), return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
            waiting.cancel()
        if self.closed:
            raise self.closed_error(method, attempts)

    def failure(
        self, exc: grpc.aio.AioRpcError, method: str, attempts: int, closed_early: int
    ) -> tuple[QuayutecError, bool]:
        """The typed error of a failed attempt, and whether the attempt was sent (a call that found no
        connection was not). A TLS failure, or a connection closed before gRPC began ``CLOSED_EARLY_LIMIT``
        times in a row, raises ConnectionFailed: retrying cannot mend either."""
        why = connection_failure(exc)
        if why == "tls":
            raise ConnectionFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"the TLS handshake with the Gateway at {self.address} failed ({exc.details()}): check that the "
                "Gateway serves TLS, that its certificate is trusted (Tls(root_certificates=...)) and names this "
                "address (Tls(server_name=...)); a Gateway without TLS needs plaintext=True",
                method=method,
                attempts=attempts,
            )
        if why == "closed" and closed_early + 1 >= CLOSED_EARLY_LIMIT:
            raise ConnectionFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"the Gateway at {self.address} closed the connection before speaking gRPC, "
                f"{CLOSED_EARLY_LIMIT} times in a row: if it serves TLS, connect without plaintext=True",
                method=method,
                attempts=attempts,
            )
        return error_for(exc, method=method, attempts=attempts), why is None

    async def unary(self, name: str, request: Message, policy: RetryPolicy, timeout: float | None = None) -> Any:
        """Send ``request`` to RPC ``name``, retried as its safety and ``policy`` allow; ``timeout``
        (seconds) bounds the whole call, retries included, instead of the policy's total time."""
        rpc = RPCS[name]
        if type(request) is not rpc.request:
            raise TypeError(f"{name} takes {rpc.request.__name__}, not {type(request).__name__}")
        check_request(name, request)
        self.same_loop(name)
        policy = policy.within(timeout)
        call = self._unary.get(name) or self._callable(name)
        request_id = new_request_id()
        metadata = self.metadata(request_id)
        # One coroutine per call: the retry loop is inlined here (this is every call's path).
        started = self.clock()
        sent = tries = closed_early = 0
        try:
            while True:
                if self._closed.is_set():
                    raise self.closed_error(name, sent)
                tries += 1
                left = policy.total_timeout - (self.clock() - started)
                try:
                    return await call(request, timeout=max(0.001, min(policy.attempt_timeout, left)), metadata=metadata)
                except grpc.aio.AioRpcError as exc:
                    if self.closed:
                        raise self.closed_error(name, sent) from exc
                    error, was_sent = self.failure(exc, name, tries, closed_early)
                    closed_early = 0 if was_sent or connection_failure(exc) != "closed" else closed_early + 1
                    sent += was_sent
                    codes = rpc.safety.retry_codes if was_sent else RETRYABLE
                    wait = self.retry_wait(policy, error, sent if was_sent else 0, started, codes, retry=tries)
                    if wait is None:
                        raise error from exc
                except asyncio.CancelledError:
                    if self.closed and not _being_cancelled():
                        raise self.closed_error(name, sent) from None
                    raise
                await self.pause(wait, name, sent)
        except QuayutecError as error:
            identified(error, request_id, metadata)
            raise

    def stream(self, name: str, request: Message, request_id: str = "") -> grpc.aio.UnaryStreamCall:
        """Open server stream ``name`` (no deadline)."""
        if self.closed:
            raise self.closed_error(name, 0)
        self.same_loop(name)
        return self._callable(name)(request, metadata=self.metadata(request_id))

    def retry_wait(
        self,
        policy: RetryPolicy,
        error: QuayutecError,
        attempt: int,
        started: float,
        codes: frozenset[grpc.StatusCode] = RETRYABLE,
        *,
        retry: int | None = None,
    ) -> float | None:
        """How long to wait before trying again after ``error``, the ``attempt``-th attempt that reached
        the Gateway (0: none did, so the policy's attempts are not used up, only its total time, unless
        it allows one attempt only); ``retry`` counts every try, for the backoff. None to give up."""
        if error.code not in codes or attempt >= policy.max_attempts or policy.max_attempts == 1:
            return None
        advised = error.retry_after if isinstance(error, RateLimited) else None
        if advised is not None and advised > policy.max_advised_wait:
            return None
        wait = policy.wait_before(retry or attempt, advised, self.rng)
        if self.clock() - started + wait >= policy.total_timeout:
            return None
        _log.info(
            "%s: %s after attempt %d%s; retrying in %.2f s%s",
            error.method,
            error.code.name,
            retry or attempt,
            "" if attempt else " (not sent: no connection)",
            wait,
            f" (the Gateway advised {advised:.3f} s)" if advised is not None else "",
        )
        return wait


def new_request_id() -> str:
    """A fresh id for one call or watch (32 hex digits), sent as ``x-request-id``. From os.urandom
    rather than uuid4, which costs a few µs more on every call for a UUID object nobody reads."""
    return os.urandom(16).hex()


def identified(error: QuayutecError, request_id: str, metadata: tuple[tuple[str, str], ...]) -> QuayutecError:
    """``error`` with the request id and the trace id (of the ``traceparent`` sent) of its call."""
    error.request_id = request_id
    traceparent = dict(metadata).get("traceparent", "").split("-")
    error.trace_id = traceparent[1] if len(traceparent) == 4 else ""
    return error


def _being_cancelled() -> bool:
    """Whether the current task is being cancelled (rather than its call cut by a closed channel)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


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
