"""Runtime's calls to Room and Claims, retried where a second try cannot do anything twice.

A call is retried on UNAVAILABLE, DEADLINE_EXCEEDED or ABORTED (Room or PostgreSQL restarting, a slow
database) with backoff, for a bounded time, when it is one of:
- a read (GetRun, GetWaitpoint);
- a ledger write (RecordRun, ReadRunContext, which records the claimed row; CreateWaitpoint, which
  gives a run's existing waitpoint back unchanged): writing the same row twice leaves one row;
- a write that carries a dedupe key (PostMessage, WriteMemory, CreateTask, UpdateTask): Room
  answers a repeat with what the first call wrote.
Anything else, and any of these without its dedupe key, is called once. The channels under these
stubs make no retries of their own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc

_log = logging.getLogger("quayutec.runtime")

T = TypeVar("T")

# ABORTED: Room's transaction was rolled back whole by a concurrent change (nothing written).
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED})
# Room methods that are safe to repeat as they are.
IDEMPOTENT_ROOM_METHODS = frozenset({"GetRun", "GetWaitpoint", "RecordRun", "ReadRunContext", "CreateWaitpoint"})
# Room methods safe to repeat only with a non-empty dedupe_key.
DEDUPED_ROOM_METHODS = frozenset({"PostMessage", "WriteMemory", "CreateTask", "UpdateTask"})
FIRST_BACKOFF_SECONDS = 0.05
MAX_BACKOFF_SECONDS = 1.0
# The least time a later try is given, however little of the bound is left.
MIN_TRY_SECONDS = 0.05


def retryable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in RETRYABLE_CODES


async def with_retries(
    call: Callable[[float], Awaitable[T]], *, call_timeout: float, retry_seconds: float, what: str
) -> T:
    """``call(timeout)`` until it answers or fails otherwise; on UNAVAILABLE / DEADLINE_EXCEEDED it is
    tried again, with backoff, while ``retry_seconds`` since the first try have not passed (then the
    last error is raised). The first try has ``call_timeout``; a later one no more than is left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retry_seconds
    backoff = FIRST_BACKOFF_SECONDS
    attempt = 1
    timeout = call_timeout
    while True:
        try:
            return await call(timeout)
        except grpc.aio.AioRpcError as exc:
            if not retryable(exc) or loop.time() + backoff >= deadline:
                raise
            _log.info("%s: %s on attempt %d; trying again in %.2f s", what, exc.code().name, attempt, backoff)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
        attempt += 1
        timeout = min(call_timeout, max(MIN_TRY_SECONDS, deadline - loop.time()))


class RetryingRoom:
    """A RoomServiceStub whose idempotent calls are retried (see the module's rules).

    Called like the stub (``await room.GetRun(request, timeout=t)``); ``timeout`` bounds each try.
    """

    def __init__(self, stub: Any, *, retry_seconds: float) -> None:
        self._stub = stub
        self._retry_seconds = retry_seconds

    def __getattr__(self, name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        method = getattr(self._stub, name)

        async def call(request: Any, *, timeout: float) -> Any:  # noqa: ASYNC109 (the stub's own signature)
            if not self._repeatable(name, request):
                return await method(request, timeout=timeout)
            return await with_retries(
                lambda t: method(request, timeout=t),
                call_timeout=timeout,
                retry_seconds=self._retry_seconds,
                what=f"Room {name}",
            )

        return call

    @staticmethod
    def _repeatable(name: str, request: Any) -> bool:
        if name in IDEMPOTENT_ROOM_METHODS:
            return True
        return name in DEDUPED_ROOM_METHODS and bool(getattr(request, "dedupe_key", ""))
