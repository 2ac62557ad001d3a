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
import logging
from dataclasses import dataclass
from typing import Any

import grpc

from quayutec.coalesce import Coalescer
from quayutec.v1 import claims_pb2

_log = logging.getLogger("quayutec.runtime.claims")

# Most claims in one ClaimMany (the server takes up to 1,000); what queues beyond waits for the next call.
DEFAULT_MAX_ITEMS = 256
# The shortest deadline given to a call that carries claims (their callers time out on their own).
MIN_CALL_SECONDS = 0.05

# What one claim is answered: ClaimOnce's answer, or the error of the call asked for it alone.
_Answer = claims_pb2.ClaimOnceResponse | Exception


@dataclass(slots=True)
class _Claim:
    request: claims_pb2.ClaimOnceRequest
    # When its caller stops waiting (the event loop's clock).
    deadline: float


class ClaimsClient:
    """Coalesces concurrent ClaimOnce calls into ClaimMany calls, one call in flight at a time
    (``quayutec.coalesce.Coalescer``)."""

    def __init__(self, stub: Any, *, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, got {max_items}")
        self._stub = stub
        # A claim whose caller gave up before it left is never sent.
        self._claims: Coalescer[_Claim, _Answer] = Coalescer(
            self._send,
            max_batch=max_items,
            name="claims client",
            drop_abandoned=True,
            span_name="ClaimMany batch",
            wake_id=lambda claim: claim.request.wake_id,
        )
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
        claim = _Claim(request, asyncio.get_running_loop().time() + timeout)
        try:
            async with asyncio.timeout(timeout):
                answer = await self._claims.submit(claim)
        except TimeoutError:
            raise _status(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer from Claims within {timeout:.3g} s") from None
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def close(self) -> None:
        """Fail what is queued or in flight (UNAVAILABLE) and refuse further claims."""
        self._closed = True
        await self._claims.close(_status(grpc.StatusCode.UNAVAILABLE, "the Runtime's Claims client closed"))

    async def _send(self, batch: list[_Claim]) -> list[_Answer]:
        """One batch: a lone claim as ClaimOnce, more as one ClaimMany. An error of the whole call is
        raised (each caller of the batch gets it); a claim asked alone is answered its own error."""
        loop = asyncio.get_running_loop()
        timeout = max(MIN_CALL_SECONDS, max(c.deadline for c in batch) - loop.time())
        if len(batch) == 1 or not self._many:
            return await self._send_each(batch)
        try:
            response: claims_pb2.ClaimManyResponse = await self._stub.ClaimMany(
                claims_pb2.ClaimManyRequest(claims=[c.request for c in batch]), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                _log.warning("Claims has no ClaimMany (%s); claiming one call per claim", exc.details())
                self._many = False
            if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INVALID_ARGUMENT):
                # Nothing was written: each claim is asked alone and gets its own answer or error.
                return await self._send_each(batch)
            raise
        answers = response.answers
        if len(answers) != len(batch):
            raise _status(
                grpc.StatusCode.INTERNAL, f"Claims answered {len(answers)} claims to a ClaimMany of {len(batch)}"
            )
        return list(answers)

    async def _send_each(self, batch: list[_Claim]) -> list[_Answer]:
        return list(await asyncio.gather(*(self._send_one(c) for c in batch)))

    async def _send_one(self, claim: _Claim) -> _Answer:
        timeout = max(MIN_CALL_SECONDS, claim.deadline - asyncio.get_running_loop().time())
        try:
            answer: claims_pb2.ClaimOnceResponse = await self._stub.ClaimOnce(claim.request, timeout=timeout)
        except Exception as exc:
            return exc
        return answer


def _status(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An error shaped like the stub's, so callers handle both alike."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
