"""The Runtime's client of Claims: concurrent ClaimOnce calls travel together in one ClaimMany.

``ClaimsClient.ClaimOnce(request, timeout=t)`` is called like the stub's and answers exactly what
ClaimOnce answers for that request. Claims asked while no call is in flight leave at once (no timer:
the call starts on the event loop's next turn, carrying whatever was asked in the same turn); claims
asked while a call is in flight queue and leave together in the next call, up to ``max_items`` per
call. A lone claim goes as ClaimOnce; two or more as ClaimMany, whose per-item answers are
ClaimOnce's (the Claims server answers a repeated pair as if the items were asked in order).

Each caller gets its own answer, or the error of the call that carried its claim. A caller whose
``timeout`` passes first gets DEADLINE_EXCEEDED, as from the stub: if its claim had left it may
have committed, and asking again with the same claimant token is answered claimed=true (so
``with_retries`` in ``services.runtime.run`` works unchanged); if it had not left it is dropped and
never sent. A ClaimMany refused with INVALID_ARGUMENT (nothing was written) is asked again item
by item, so one bad claim fails only its own caller; a server without ClaimMany (UNIMPLEMENTED, an
older Claims during a rolling upgrade) is asked item by item from then on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc

from quayutec.v1 import claims_pb2

_log = logging.getLogger("quayutec.runtime.claims")

# Most claims in one ClaimMany (the server takes up to 1,000); what queues beyond waits for the next call.
DEFAULT_MAX_ITEMS = 256
# The shortest deadline given to a call that carries claims (their callers time out on their own).
MIN_CALL_SECONDS = 0.05


@dataclass
class _Waiter:
    request: claims_pb2.ClaimOnceRequest
    deadline: float
    future: asyncio.Future[claims_pb2.ClaimOnceResponse] = field(repr=False)


class ClaimsClient:
    """Coalesces concurrent ClaimOnce calls into ClaimMany calls, one call in flight at a time."""

    def __init__(self, stub: Any, *, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, got {max_items}")
        self._stub = stub
        self._max_items = max_items
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._sender: asyncio.Task[None] | None = None
        self._many = True
        self._closed = False

    async def ClaimOnce(
        self,
        request: claims_pb2.ClaimOnceRequest,
        *,
        timeout: float,  # noqa: ASYNC109 (the stub's own signature)
    ) -> claims_pb2.ClaimOnceResponse:
        """What ClaimOnce answers for ``request``; ``timeout`` bounds this caller's wait."""
        if self._closed:
            raise _status(grpc.StatusCode.UNAVAILABLE, "the Runtime's Claims client is closed")
        loop = asyncio.get_running_loop()
        waiter = _Waiter(request, loop.time() + timeout, loop.create_future())
        self._queue.append(waiter)
        if self._sender is None:
            self._sender = loop.create_task(self._send_queued(), name="claims client")
        try:
            return await asyncio.wait_for(waiter.future, timeout)
        except TimeoutError:
            raise _status(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer from Claims within {timeout:.3g} s") from None

    async def close(self) -> None:
        """Fail what is queued or in flight (UNAVAILABLE) and refuse further claims."""
        self._closed = True
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.cancel()
            try:
                await sender
            except asyncio.CancelledError:
                pass
        while self._queue:
            _fail(self._queue.popleft(), _status(grpc.StatusCode.UNAVAILABLE, "the Runtime's Claims client closed"))

    async def _send_queued(self) -> None:
        """Sends what is queued, one call at a time, until the queue is empty."""
        try:
            while True:
                batch: list[_Waiter] = []
                while self._queue and len(batch) < self._max_items:
                    waiter = self._queue.popleft()
                    if not waiter.future.done():  # a caller that gave up before its claim left: not sent
                        batch.append(waiter)
                if not batch:
                    return
                await self._send(batch)
        finally:
            if self._sender is asyncio.current_task():
                self._sender = None

    async def _send(self, batch: list[_Waiter]) -> None:
        loop = asyncio.get_running_loop()
        timeout = max(MIN_CALL_SECONDS, max(w.deadline for w in batch) - loop.time())
        if len(batch) == 1 or not self._many:
            await asyncio.gather(*(self._send_one(w) for w in batch))
            return
        try:
            response: claims_pb2.ClaimManyResponse = await self._stub.ClaimMany(
                claims_pb2.ClaimManyRequest(claims=[w.request for w in batch]), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                _log.warning("Claims has no ClaimMany (%s); claiming one call per claim", exc.details())
                self._many = False
            if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT):
                # Nothing was written: each claim is asked alone and gets its own answer or error.
                await asyncio.gather(*(self._send_one(w) for w in batch))
                return
            for waiter in batch:
                _fail(waiter, exc)
            return
        except Exception as exc:
            for waiter in batch:
                _fail(waiter, exc)
            return
        except BaseException:
            for waiter in batch:
                waiter.future.cancel()
            raise
        answers = response.answers
        if len(answers) != len(batch):
            error = _status(
                grpc.StatusCode.INTERNAL, f"Claims answered {len(answers)} claims to a ClaimMany of {len(batch)}"
            )
            for waiter in batch:
                _fail(waiter, error)
            return
        for waiter, answer in zip(batch, answers, strict=True):
            if not waiter.future.done():
                waiter.future.set_result(answer)

    async def _send_one(self, waiter: _Waiter) -> None:
        timeout = max(MIN_CALL_SECONDS, waiter.deadline - asyncio.get_running_loop().time())
        try:
            answer: claims_pb2.ClaimOnceResponse = await self._stub.ClaimOnce(waiter.request, timeout=timeout)
        except Exception as exc:
            _fail(waiter, exc)
        except BaseException:
            waiter.future.cancel()
            raise
        else:
            if not waiter.future.done():
                waiter.future.set_result(answer)


def _fail(waiter: _Waiter, exc: BaseException) -> None:
    if not waiter.future.done():
        waiter.future.set_exception(exc)


def _status(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An error shaped like the stub's, so callers handle both alike."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
