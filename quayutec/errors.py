"""Errors every service raises, and the one table that maps them to gRPC status codes."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import grpc

from quayutec.ratelog import RateLimitedLog

_log = logging.getLogger("quayutec.errors")
_undecodable_log = logging.getLogger("quayutec.undecodable")

# PostgreSQL SQLSTATE classes that mean "the database is not reachable right now".
CONNECTION_SQLSTATE_CLASSES = ("08", "53", "57")
# The server ended the session and rolled its transaction back: 25P03 idle_in_transaction_session_timeout
# (a client cut off mid-transaction, see quayutec.db.create_pool), 25P04 transaction_timeout; or the
# server is no longer the primary: 25006 read_only_sql_transaction (a demoted primary; the pool drops
# its connections and a multi-host URL finds the new one).
CONNECTION_SQLSTATES = ("25P03", "25P04", "25006")


class ServiceError(Exception):
    """A failure with a gRPC status code and a message that says what to fix."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def trailers(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata that says in fields what the message says in words (none by default)."""
        return ()


def trailers_of(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """The trailing metadata to answer ``exc`` with (a ServiceError's own, else none)."""
    return exc.trailers() if isinstance(exc, ServiceError) else ()


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


# The trailing metadata in which a RESOURCE_EXHAUSTED answer advises how long to wait, in milliseconds.
RETRY_AFTER_METADATA_KEY = "retry-after-ms"


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, *, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms

    def trailers(self) -> tuple[tuple[str, str], ...]:
        return () if self.retry_after_ms is None else ((RETRY_AFTER_METADATA_KEY, str(self.retry_after_ms)),)


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


# The trailing metadata of an OUT_OF_RANGE watch cursor: the room it is of, and (for a cursor past the
# room's end) the room's newest cursor, so a client can say which room to resume from where.
ROOM_ID_METADATA_KEY = "quayutec-room-id"
NEWEST_CURSOR_METADATA_KEY = "quayutec-newest-cursor"


class OutOfRange(ServiceError):
    """A cursor out of a room's event log: ``room_id`` and ``newest_cursor`` (when known) are sent as
    trailers too."""

    code = grpc.StatusCode.OUT_OF_RANGE

    def __init__(self, message: str, *, room_id: str = "", newest_cursor: int | None = None) -> None:
        super().__init__(message)
        self.room_id = room_id
        self.newest_cursor = newest_cursor

    def trailers(self) -> tuple[tuple[str, str], ...]:
        fields: tuple[tuple[str, str], ...] = ((ROOM_ID_METADATA_KEY, self.room_id),) if self.room_id else ()
        if self.newest_cursor is not None:
            fields += ((NEWEST_CURSOR_METADATA_KEY, str(self.newest_cursor)),)
        return fields


# The trailing metadata key naming the room rule that refused a call (RuleBroken).
RULE_METADATA_KEY = "quayutec-rule"


class RuleBroken(ServiceError):
    """A refusal by a rule of the room (services/room/rules.py): the rule's status code, its id
    (sent as the ``quayutec-rule`` trailer) and its words (the message)."""

    def __init__(self, code: grpc.StatusCode, rule: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.rule = rule

    def trailers(self) -> tuple[tuple[str, str], ...]:
        return ((RULE_METADATA_KEY, self.rule),)


def broken_rule(exc: grpc.aio.AioRpcError) -> str | None:
    """The id of the room rule that refused the call, when a rule did (its ``quayutec-rule`` trailer)."""
    for key, value in exc.trailing_metadata() or ():
        if key == RULE_METADATA_KEY:
            return str(value)
    return None


# Codes of a downstream service's answer that pass through unchanged to our caller.
_PASS_THROUGH = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.ABORTED,
    }
)


def is_connection_error(exc: BaseException) -> bool:
    """True when ``exc`` means PostgreSQL could not be reached (retryable, UNAVAILABLE)."""
    if isinstance(exc, asyncpg.PostgresError):
        sqlstate = getattr(exc, "sqlstate", None) or ""
        return sqlstate[:2] in CONNECTION_SQLSTATE_CLASSES or sqlstate in CONNECTION_SQLSTATES
    # asyncpg's InternalClientError ("cannot switch to state ...; another operation is in progress")
    # comes from a connection broken in the middle of an operation, e.g. PostgreSQL shutting down
    # mid-transaction: it is answered like a lost connection.
    return isinstance(
        exc,
        (
            OSError,
            asyncpg.InterfaceError,
            asyncpg.exceptions.ConnectionDoesNotExistError,
            asyncpg.exceptions.InternalClientError,
        ),
    )


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message our caller sees for ``exc``."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        if code in _PASS_THROUGH:
            return code, exc.details() or code.name
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return grpc.StatusCode.UNAVAILABLE, f"a backend did not answer in time: {exc.details()}"
        return grpc.StatusCode.INTERNAL, f"a backend failed: {code.name}"
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED, "this method is not implemented by this server version"
    if isinstance(exc, (asyncpg.exceptions.SerializationError, asyncpg.exceptions.DeadlockDetectedError)):
        # The transaction was rolled back whole: nothing of the call was written.
        return grpc.StatusCode.ABORTED, "a concurrent change rolled this call back; nothing was written; retry"
    if is_connection_error(exc) or isinstance(exc, TimeoutError):
        return grpc.StatusCode.UNAVAILABLE, "the database is unavailable; retry later"
    return grpc.StatusCode.INTERNAL, "internal error"


class Undecodable:
    """Stands in for a request whose bytes did not decode (corrupt protobuf, a string field that is
    not UTF-8), so the handler answers INVALID_ARGUMENT instead of gRPC's UNKNOWN and traceback."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:
            return Undecodable(type(exc).__name__)

    return deserialize


def status_logged(exc: BaseException, what: str) -> tuple[grpc.StatusCode, str]:
    """``status_for(exc)``, with a warning and its traceback when the code is ours or a dependency's
    fault (INTERNAL, UNAVAILABLE) rather than the caller's: "<what> failed: <message>"."""
    code, message = status_for(exc)
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE):
        _log.warning("%s failed: %s", what, message, exc_info=exc)
    return code, message


class WrappedHandlers:
    """Each method's handler as an interceptor wrapped it, built on the method's first call and
    answered to every later one; built again if the server ever answers another handler for it."""

    def __init__(self) -> None:
        self._by_method: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler | None]] = {}

    def get(
        self, method: str, handler: grpc.RpcMethodHandler, wrap: Callable[[], grpc.RpcMethodHandler | None]
    ) -> grpc.RpcMethodHandler | None:
        cached = self._by_method.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = wrap()
        self._by_method[method] = (handler, wrapped)
        return wrapped


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Turns exceptions raised by unary handlers into the status codes of ``status_for``, and a
    request that does not decode (any handler kind) into INVALID_ARGUMENT, logged at a bounded rate
    without a traceback."""

    def __init__(self, undecodable_log: RateLimitedLog | None = None) -> None:
        self._undecodable_log = undecodable_log or RateLimitedLog(_undecodable_log)
        self._wrapped = WrappedHandlers()

    async def _refuse_undecodable(self, method: str, request: Undecodable, context: grpc.aio.ServicerContext) -> None:
        self._undecodable_log.warning(
            "%s: refused a request that does not decode (%s) from %s", method, request.reason, context.peer()
        )
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request does not decode ({request.reason}): send a valid protobuf message of the method's "
            "request type; string fields must be UTF-8",
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method: str = handler_call_details.method
        return self._wrapped.get(method, handler, lambda: self._wrap(method, handler))

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if handler.unary_unary is None:
            return self._streaming(method, handler)
        inner = handler.unary_unary

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await self._refuse_undecodable(method, request, context)
            try:
                return await inner(request, context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                code, message = status_logged(exc, method)
                if trailers := trailers_of(exc):
                    context.set_trailing_metadata(trailers)
                await context.abort(code, message)

        return grpc.unary_unary_rpc_method_handler(
            guarded,
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )

    def _streaming(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """Health's Watch and reflection: only the undecodable-request refusal is added."""
        refuse = self._refuse_undecodable
        deserializer = _tolerant(handler.request_deserializer)
        serializer = handler.response_serializer
        if handler.unary_stream is not None:
            unary_inner = handler.unary_stream
            if inspect.isasyncgenfunction(unary_inner):

                async def unary_stream_gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                    if isinstance(request, Undecodable):
                        await refuse(method, request, context)
                    async for item in unary_inner(request, context):
                        yield item

                wrapped_us: Any = unary_stream_gen
            else:

                async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                    if isinstance(request, Undecodable):
                        await refuse(method, request, context)
                    return await unary_inner(request, context)

                wrapped_us = unary_stream
            return grpc.unary_stream_rpc_method_handler(
                wrapped_us, request_deserializer=deserializer, response_serializer=serializer
            )

        def checked(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async def each() -> AsyncIterator[Any]:
                async for request in requests:
                    if isinstance(request, Undecodable):
                        await refuse(method, request, context)
                    yield request

            return each()

        stream_inner = handler.stream_stream or handler.stream_unary
        if inspect.isasyncgenfunction(stream_inner):

            async def stream_gen(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for item in stream_inner(checked(requests, context), context):
                    yield item

            wrapped: Any = stream_gen
        else:

            async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                return await stream_inner(checked(requests, context), context)

            wrapped = stream
        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.stream_stream is not None
            else grpc.stream_unary_rpc_method_handler
        )
        return make(wrapped, request_deserializer=deserializer, response_serializer=serializer)
