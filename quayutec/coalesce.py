"""One sender for many callers: items asked for concurrently travel together in one batched call.

``Coalescer(send, max_batch=N)`` serves ``await coalescer.submit(item)``, which answers what ``send``
answered for that item. One sender task makes the calls, one at a time: ``send(batch)`` takes the
items in the order they were submitted and returns one answer per item, in the same order.

- **No timer.** The sender starts when the first item is submitted and sends on the event loop's
  next turn, carrying whatever was submitted in that same turn: an idle process adds no delay and
  nothing ever waits to fill a batch. Items submitted while a call is in flight queue and leave
  together in the next call, at most ``max_batch`` per call (what is beyond waits for the call
  after). The sender ends when the queue is empty; the next submit starts a new one.
- **Bounded by its callers.** Every caller awaits its own answer, so the queue never holds more
  items than there are callers waiting (or callers that gave up, see below); it has no limit of
  its own. Whoever submits bounds its own concurrency.
- **Failures.** A ``send`` that raises answers every item of its batch with that exception (each
  caller sees it raised from ``submit``), so each user decides what a failed call means: map it
  to a default, retry, or let it propagate. An answer list of the wrong length is an error for the
  whole batch too (a ``RuntimeError`` naming both lengths): answers are never guessed by position.
  The next batch goes as usual after a failed one. Errors of single items are the answer type's
  business (e.g. ``Answer = Response | Exception``, raised by the caller).
- **A caller that stops waiting** (cancelled, or timed out around ``submit``) gets no answer: its
  answer is dropped, never set on a done future, and the other callers of its batch are
  unaffected. Whether its item is still sent is the user's choice: by default an item already
  queued is sent (a settlement must reach the Room even when the delivery that queued it was
  cancelled); with ``drop_abandoned=True`` an item whose caller gave up before its batch was taken
  is left out (a claim nobody waits for is never made). An item whose batch is already in flight
  is in that call either way.
- **Tracing.** Each ``submit`` notes the caller's OpenTelemetry context. Given a ``span_name``, a
  batch of two or more runs its call in a span of that name (``quayutec.telemetry.batch_span``)
  linked to every item's caller and naming the items' wakes (``wake_id(item)``), so each caller's
  trace reaches the call; otherwise the call runs in the context of its first item. Either is
  attached only while sending.
- **Stopping.** ``drain(timeout)`` waits for the sender to send what is queued (including what is
  submitted meanwhile), then cancels a sender still busy after ``timeout``. ``close(error)`` stops
  at once: every caller still waiting, queued or in flight, gets ``error``, the sender is
  cancelled, and each later ``submit`` raises ``error``. A caller whose item the sender will no
  longer send (after ``drain`` gave up, or the sender task was cancelled from outside) gets
  ``CoalescerStopped``, an ``Exception`` like any failed call: its own task was not cancelled, so
  it is not told so.

One event loop only: create, submit to and stop a coalescer from the loop it serves.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from opentelemetry import context as otel_context

from quayutec.telemetry import batch_span

ItemT = TypeVar("ItemT")
AnswerT = TypeVar("AnswerT")


class CoalescerStopped(Exception):
    """The coalescer's sender stopped before this item was answered."""


@dataclass(slots=True)
class _Queued(Generic[ItemT, AnswerT]):
    item: ItemT
    # The submitter's trace context: a batch's call runs in its first item's.
    context: otel_context.Context
    # Its caller's answer; done (cancelled) as soon as the caller stops waiting.
    answer: asyncio.Future[AnswerT] = field(repr=False)


class Coalescer(Generic[ItemT, AnswerT]):
    """Coalesces concurrent ``submit(item)`` calls into ``send(batch)`` calls, one in flight at a time."""

    def __init__(
        self,
        send: Callable[[list[ItemT]], Awaitable[Sequence[AnswerT]]],
        *,
        max_batch: int,
        name: str = "coalescer",
        drop_abandoned: bool = False,
        span_name: str = "",
        wake_id: Callable[[ItemT], str] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._send = send
        self._max_batch = max_batch
        self._name = name
        self._drop_abandoned = drop_abandoned
        self._span_name = span_name
        self._wake_id = wake_id
        self._queue: collections.deque[_Queued[ItemT, AnswerT]] = collections.deque()
        self._in_flight: list[_Queued[ItemT, AnswerT]] = []
        self._sender: asyncio.Task[None] | None = None
        self._closed: BaseException | None = None

    @property
    def queued(self) -> tuple[ItemT, ...]:
        """The items waiting for a call (not those in flight), oldest first."""
        return tuple(q.item for q in self._queue)

    async def submit(self, item: ItemT) -> AnswerT:
        """Queue ``item`` for the next call and wait for its answer (or its batch's error)."""
        if self._closed is not None:
            raise self._closed
        loop = asyncio.get_running_loop()
        queued: _Queued[ItemT, AnswerT] = _Queued(item, otel_context.get_current(), loop.create_future())
        self._queue.append(queued)
        if self._sender is None:
            self._sender = loop.create_task(self._send_queued(), name=self._name)
        # Awaited directly: a caller that is cancelled cancels its own answer, which the sender then skips.
        return await queued.answer

    async def drain(self, timeout: float | None) -> None:  # noqa: ASYNC109 (a grace, not a deadline of a call)
        """Let the sender send what is queued within ``timeout`` seconds, then cancel it if still busy;
        callers still waiting then get ``CoalescerStopped``."""
        sender = self._sender
        if sender is None:
            return
        _, unfinished = await asyncio.wait({sender}, timeout=timeout)
        for task in unfinished:
            task.cancel()
        await asyncio.gather(sender, return_exceptions=True)

    async def close(self, error: BaseException) -> None:
        """Answer every caller still waiting with ``error``, stop the sender, and refuse later items."""
        self._closed = error
        _fail_all((*self._in_flight, *self._queue), error)
        self._queue.clear()
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)

    def _take(self) -> list[_Queued[ItemT, AnswerT]]:
        batch: list[_Queued[ItemT, AnswerT]] = []
        while self._queue and len(batch) < self._max_batch:
            queued = self._queue.popleft()
            if not (self._drop_abandoned and queued.answer.done()):
                batch.append(queued)
        return batch

    async def _send_queued(self) -> None:
        """Send what is queued, one call at a time, until the queue is empty."""
        try:
            while batch := self._take():
                self._in_flight = batch
                try:
                    await self._send_batch(batch)
                finally:
                    self._in_flight = []
        except BaseException:  # cancelled: what is still queued will not be sent by this sender
            _fail_all(self._queue, CoalescerStopped(f"{self._name}: stopped before this item was sent"))
            self._queue.clear()
            raise
        finally:
            if self._sender is asyncio.current_task():
                self._sender = None

    async def _send_batch(self, batch: list[_Queued[ItemT, AnswerT]]) -> None:
        traced: contextlib.AbstractContextManager[object]
        if self._span_name and len(batch) > 1:
            wake_ids = [self._wake_id(q.item) for q in batch] if self._wake_id is not None else []
            traced = batch_span(self._span_name, [q.context for q in batch], wake_ids=wake_ids)
        else:
            traced = contextlib.nullcontext()
        token = otel_context.attach(batch[0].context)
        try:
            with traced:
                answers = await self._send([q.item for q in batch])
        except Exception as exc:
            _fail_all(batch, exc)
            return
        except BaseException:  # the sender was cancelled: its callers were not, they get an error
            _fail_all(batch, CoalescerStopped(f"{self._name}: stopped while sending this item's batch"))
            raise
        finally:
            otel_context.detach(token)
        if len(answers) != len(batch):
            _fail_all(
                batch,
                RuntimeError(f"{self._name}: send answered {len(answers)} answers to a batch of {len(batch)} items"),
            )
            return
        for queued, answer in zip(batch, answers, strict=True):
            if not queued.answer.done():  # its caller may have stopped waiting meanwhile
                queued.answer.set_result(answer)


def _fail_all(queued: Iterable[_Queued[ItemT, AnswerT]], error: BaseException) -> None:
    """Answer ``error`` to each caller still waiting (one that stopped waiting is skipped)."""
    for each in queued:
        if not each.answer.done():
            each.answer.set_exception(error)
