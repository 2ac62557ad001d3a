"""Errors of Gateway calls: one class per status code the Gateway answers, each keeping the gRPC code
and the Gateway's message (which says what to fix)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc

# The trailing metadata in which the Gateway advises how long to wait before trying again.
RETRY_AFTER_MS = "retry-after-ms"


class QuayutecError(Exception):
    """A Gateway call that failed: ``code`` is the gRPC status code, ``message`` the Gateway's text,
    ``method`` the RPC, ``attempts`` how many times it was sent (retries included)."""

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


class CursorExpired(QuayutecError):
    """OUT_OF_RANGE: a watch's cursor is older than the events the Gateway keeps. Reload with the list
    methods and watch from now."""


class Aborted(QuayutecError):
    """A concurrent change rolled the call back; nothing was written."""


class Unavailable(QuayutecError):
    """The Gateway, or a service behind it, could not be reached (after the retries the policy allows)."""


class DeadlineExceeded(QuayutecError):
    """No answer in time (after the retries the policy allows)."""


class Cancelled(QuayutecError):
    """The call was cancelled."""


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
    grpc.StatusCode.OUT_OF_RANGE: CursorExpired,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
}


def advised_wait(trailing_metadata: Iterable[tuple[str, Any]] | None) -> float | None:
    """The wait, in seconds, of a ``retry-after-ms`` trailer; None when there is none or it is not a
    whole number of milliseconds."""
    for key, value in trailing_metadata or ():
        if key == RETRY_AFTER_MS:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            if text.strip().isdigit():
                return int(text) / 1000.0
    return None


def error_for(exc: grpc.aio.AioRpcError, *, method: str, attempts: int) -> QuayutecError:
    """The typed error of a failed call."""
    code = exc.code()
    message = exc.details() or code.name
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RateLimited(
            code, message, method=method, attempts=attempts, retry_after=advised_wait(exc.trailing_metadata())
        )
    cls = _BY_CODE.get(code, QuayutecError)
    return cls(code, message, method=method, attempts=attempts)
