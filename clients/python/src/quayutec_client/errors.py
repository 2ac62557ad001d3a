"""Errors of Gateway calls: one class per status code the Gateway answers, each keeping the gRPC code
and the Gateway's message (which says what to fix)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

# The trailing metadata in which the Gateway advises how long to wait before trying again.
RETRY_AFTER_MS = "retry-after-ms"
# The trailing metadata of an OUT_OF_RANGE cursor: its room, and that room's newest cursor.
ROOM_ID = "quayutec-room-id"
NEWEST_CURSOR = "quayutec-newest-cursor"


class QuayutecError(Exception):
    """A Gateway call that failed: ``code`` is the gRPC status code, ``message`` the Gateway's text,
    ``method`` the RPC, ``attempts`` how many times it was tried (retries included), ``request_id`` and
    ``trace_id`` what identifies the call."""

    # The id the client sent as ``x-request-id`` on every attempt of the call (or every stream of the
    # watch), and the trace id of the ``traceparent`` it sent ("" when OpenTelemetry sent none): quote
    # them when you ask about a call.
    request_id: str = ""
    trace_id: str = ""

    def __init__(self, code: grpc.StatusCode, message: str, *, method: str = "", attempts: int = 1) -> None:
        super().__init__(f"{method + ': ' if method else ''}{code.name}: {message}")
        self.code = code
        self.message = message
        self.method = method
        self.attempts = attempts


class InvalidArgument(QuayutecError):
    """A field is missing, malformed or too large: fix the request (the message names the field)."""


class NotFound(QuayutecError):
    """It does not exist, or your company may not see it (a room you are not a member of)."""


class AlreadyExists(QuayutecError):
    """The state you asked for is already there (e.g. the company is already invited)."""


class PermissionDenied(QuayutecError):
    """You can see it but may not do this."""


class FailedPrecondition(QuayutecError):
    """The state does not allow it (a closed task, a declined invitation); read it again."""


class Unauthenticated(QuayutecError):
    """No key, or a malformed, unknown or revoked one."""


class RateLimited(QuayutecError):
    """RESOURCE_EXHAUSTED: a limit of your company was reached. ``retry_after`` is the wait the Gateway
    advised, in seconds (None when it advised none)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        method: str = "",
        attempts: int = 1,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(code, message, method=method, attempts=attempts)
        self.retry_after = retry_after


class CursorOutOfRange(QuayutecError):
    """OUT_OF_RANGE: a watch's cursor is older than the events the Gateway keeps (reload with the list
    methods and watch from now), or past the room's newest event (resume after a cursor you received).
    ``room_id`` is the room it is of and ``newest_cursor`` that room's newest cursor (past the end),
    when the Gateway says (its ``quayutec-room-id`` and ``quayutec-newest-cursor`` trailers); else None."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        method: str = "",
        attempts: int = 1,
        room_id: str | None = None,
        newest_cursor: int | None = None,
    ) -> None:
        super().__init__(code, message, method=method, attempts=attempts)
        self.room_id = room_id
        self.newest_cursor = newest_cursor


# The name of CursorOutOfRange in the first releases of this client.
CursorExpired = CursorOutOfRange


class Aborted(QuayutecError):
    """A concurrent change rolled the call back; nothing was written."""


class Unavailable(QuayutecError):
    """The Gateway, or a service behind it, could not be reached (after the retries the policy allows)."""


class DeadlineExceeded(QuayutecError):
    """No answer in time (after the retries the policy allows)."""


class Cancelled(QuayutecError):
    """The call was cancelled."""


class Closed(Cancelled):
    """The client was closed (``await client.close()``) while the call or watch was under way, or
    before it began: nothing more is sent on it."""


class ConnectionFailed(Unavailable):
    """The Gateway was reached but no gRPC connection could be made with it, so retrying cannot help:
    a TLS handshake that failed (TLS to a plaintext port, an untrusted certificate, a certificate that
    does not name the address), or a Gateway that closes every connection before speaking gRPC (often
    plaintext to a TLS port). The message says which and what to check."""


class Internal(QuayutecError):
    """The Gateway failed; the message says no more, by design."""


class Unimplemented(QuayutecError):
    """The Gateway does not serve this RPC (it is older than this client)."""


_BY_CODE: dict[grpc.StatusCode, type[QuayutecError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RateLimited,
    grpc.StatusCode.OUT_OF_RANGE: CursorOutOfRange,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
}


def _trailer(trailing_metadata: Iterable[tuple[str, Any]] | None, name: str) -> str | None:
    for key, value in trailing_metadata or ():
        if key == name:
            return (value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)).strip()
    return None


def _whole_number(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def advised_wait(trailing_metadata: Iterable[tuple[str, Any]] | None) -> float | None:
    """The wait, in seconds, of a ``retry-after-ms`` trailer; None when there is none or it is not a
    whole number of milliseconds."""
    ms = _whole_number(_trailer(trailing_metadata, RETRY_AFTER_MS))
    return None if ms is None else ms / 1000.0


# The start of a gRPC status that says the call never reached a Gateway: no connection could be made.
_NOT_CONNECTED = "failed to connect to all addresses"
_TLS_SIGNS = ("tls handshake", "ssl", "certificate", "hostname verification")


def connection_failure(exc: grpc.aio.AioRpcError) -> str | None:
    """Why a call was never sent, from its status: "tls" (a TLS handshake failed), "closed" (the
    connection closed before gRPC began), "unreachable" (refused, unroutable, no such host); None when
    it may have been sent."""
    details = exc.details() or ""
    if exc.code() != grpc.StatusCode.UNAVAILABLE or not details.startswith(_NOT_CONNECTED):
        return None
    lowered = details.lower()
    if any(sign in lowered for sign in _TLS_SIGNS):
        return "tls"
    if lowered.endswith("socket closed"):
        return "closed"
    return "unreachable"


def error_for(exc: grpc.aio.AioRpcError, *, method: str, attempts: int) -> QuayutecError:
    """The typed error of a failed call."""
    code = exc.code()
    message = exc.details() or code.name
    trailers = exc.trailing_metadata()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RateLimited(code, message, method=method, attempts=attempts, retry_after=advised_wait(trailers))
    if code == grpc.StatusCode.OUT_OF_RANGE:
        return CursorOutOfRange(
            code,
            message,
            method=method,
            attempts=attempts,
            room_id=_trailer(trailers, ROOM_ID) or None,
            newest_cursor=_whole_number(_trailer(trailers, NEWEST_CURSOR)),
        )
    cls = _BY_CODE.get(code, QuayutecError)
    return cls(code, message, method=method, attempts=attempts)
