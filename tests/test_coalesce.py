"""The shared coalescer (quayutec/coalesce.py) on a real event loop: the calls it makes, what each
caller is answered, failures, callers that stop waiting, tracing and stopping.

The ``send`` here is a recorder that notes each batch and can hold a call back until released, so
that items queue behind it; the tests wait on events and on the queue's length, never on time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from quayutec.coalesce import Coalescer, CoalescerStopped


class Recorder:
    """A ``send`` noting each batch; it answers each item ``answer(item)`` and raises ``ValueError``
    for a batch holding "boom". While ``held``, each call waits for ``release``."""

    def __init__(self, answer: Callable[[str], str] = str.upper) -> None:
        self.batches: list[list[str]] = []
        self.trace_ids: list[int] = []
        self.answer = answer
        self.held = False
        self.release = asyncio.Event()
        self.called = asyncio.Event()

    async def __call__(self, batch: list[str]) -> Sequence[str]:
        self.batches.append(list(batch))
        self.trace_ids.append(trace.get_current_span().get_span_context().trace_id)
        self.called.set()
        if self.held:
            await self.release.wait()
        if "boom" in batch:
            raise ValueError(f"cannot send {batch}")
        return [self.answer(item) for item in batch]


async def queued(coalescer: Coalescer[str, str], count: int) -> None:
    """Let every task made so far run up to its first wait, then check that ``count`` items are queued.

    The loop runs ready tasks in the order they were made: once a task made now has run, so has each
    submitting task made before it (up to its wait for its answer, its item queued)."""
    await asyncio.create_task(_nothing())
    assert len(coalescer.queued) == count


async def _nothing() -> None:
    return None


def submit_all(coalescer: Coalescer[str, str], items: Sequence[str]) -> list[asyncio.Task[str]]:
    return [asyncio.create_task(coalescer.submit(item)) for item in items]


@dataclass
class Held:
    send: Recorder
    coalescer: Coalescer[str, str]
    # "first", whose call is out and held back until ``send.release`` is set.
    first: asyncio.Task[str]
    # The callers whose items queued behind it, in order.
    later: list[asyncio.Task[str]]


async def behind_a_held_call(
    items: Sequence[str], *, max_batch: int = 10, name: str = "coalescer", drop_abandoned: bool = False
) -> Held:
    """A coalescer whose first call (of "first") is out and held back, with ``items`` queued behind it."""
    send = Recorder()
    send.held = True
    coalescer = Coalescer(send, max_batch=max_batch, name=name, drop_abandoned=drop_abandoned)
    first = asyncio.create_task(coalescer.submit("first"))
    await send.called.wait()
    later = submit_all(coalescer, items)
    await queued(coalescer, len(items))
    return Held(send, coalescer, first, later)


async def test_a_lone_item_goes_at_once_and_items_of_one_turn_go_together() -> None:
    send = Recorder()
    coalescer = Coalescer(send, max_batch=10)
    assert await coalescer.submit("a") == "A"  # nothing else asked: it went without waiting for company
    assert send.batches == [["a"]]
    assert await asyncio.gather(*(coalescer.submit(x) for x in "bcd")) == ["B", "C", "D"]
    assert send.batches == [["a"], ["b", "c", "d"]]


async def test_items_queued_during_a_call_go_together_in_the_next() -> None:
    held = await behind_a_held_call(["b", "c", "d", "e"])
    send, coalescer, first, later = held.send, held.coalescer, held.first, held.later
    assert coalescer.queued == ("b", "c", "d", "e")
    assert send.batches == [["first"]]  # one call in flight at a time
    send.release.set()
    assert await asyncio.gather(first, *later) == ["FIRST", "B", "C", "D", "E"]
    assert send.batches == [["first"], ["b", "c", "d", "e"]]
    assert not coalescer.queued


async def test_no_call_carries_more_than_max_batch_items() -> None:
    items = [f"i{n}" for n in range(7)]
    held = await behind_a_held_call(items, max_batch=3)
    send, first, later = held.send, held.first, held.later
    send.release.set()
    assert await asyncio.gather(first, *later) == ["FIRST", *(i.upper() for i in items)]
    assert send.batches == [["first"], ["i0", "i1", "i2"], ["i3", "i4", "i5"], ["i6"]]


async def test_each_caller_gets_its_own_answer_in_order() -> None:
    send = Recorder(answer=lambda item: f"answer to {item}")
    coalescer = Coalescer(send, max_batch=4)
    items = [f"item-{n}" for n in reversed(range(10))]
    answers = await asyncio.gather(*(coalescer.submit(item) for item in items))
    assert answers == [f"answer to {item}" for item in items]
    assert [item for batch in send.batches for item in batch] == items  # sent in the order submitted
    assert [len(batch) for batch in send.batches] == [4, 4, 2]


async def test_a_raising_send_answers_every_caller_of_its_batch_and_the_next_batch_still_goes() -> None:
    held = await behind_a_held_call(["a", "boom", "b"])
    send, coalescer, first, failing = held.send, held.coalescer, held.first, held.later
    send.release.set()
    assert await first == "FIRST"
    errors = await asyncio.gather(*failing, return_exceptions=True)
    assert all(isinstance(e, ValueError) for e in errors)
    assert len({id(e) for e in errors}) == 1  # the one error of their call, as raised by send
    assert "cannot send ['a', 'boom', 'b']" in str(errors[0])
    # Behind a failing call, the next batch goes as usual.
    send.held, send.release = True, asyncio.Event()
    send.called.clear()
    failing = submit_all(coalescer, ["boom"])
    await send.called.wait()
    after = submit_all(coalescer, ["c", "d"])
    await queued(coalescer, 2)
    send.release.set()
    with pytest.raises(ValueError, match="boom"):
        await failing[0]
    assert await asyncio.gather(*after) == ["C", "D"]
    assert send.batches[-2:] == [["boom"], ["c", "d"]]


async def test_answers_of_the_wrong_length_fail_the_whole_batch() -> None:
    calls = 0

    async def short(batch: list[str]) -> list[str]:
        nonlocal calls
        calls += 1
        return [item.upper() for item in batch][: 1 if calls == 1 else None]

    coalescer = Coalescer(short, max_batch=10, name="shorty")
    errors = await asyncio.gather(*(coalescer.submit(x) for x in "abc"), return_exceptions=True)
    assert all(isinstance(e, RuntimeError) for e in errors)
    assert "shorty: send answered 1 answers to a batch of 3 items" in str(errors[0])
    assert await asyncio.gather(*(coalescer.submit(x) for x in "de")) == ["D", "E"]  # the next call is fine


async def test_a_cancelled_caller_does_not_break_the_others_and_its_item_is_still_sent() -> None:
    held = await behind_a_held_call(["b", "c", "d"])
    send, coalescer, first, (b, c, d) = held.send, held.coalescer, held.first, held.later
    c.cancel()
    first.cancel()  # its call is in flight: the answer that comes is dropped
    send.release.set()
    assert list(await asyncio.gather(b, d)) == ["B", "D"]
    for cancelled in (c, first):
        with pytest.raises(asyncio.CancelledError):
            await cancelled
    assert send.batches == [["first"], ["b", "c", "d"]]  # by default a queued item is sent all the same
    assert await coalescer.submit("e") == "E"  # the sender carries on


async def test_with_drop_abandoned_an_item_given_up_before_its_batch_left_is_not_sent() -> None:
    held = await behind_a_held_call(["b", "c", "d"], drop_abandoned=True)
    send, coalescer, first, (b, c, d) = held.send, held.coalescer, held.first, held.later
    c.cancel()
    with pytest.raises(TimeoutError):  # a caller that times out around submit gives up alike
        async with asyncio.timeout(0):
            await coalescer.submit("late")
    assert coalescer.queued == ("b", "c", "d", "late")
    send.release.set()
    assert list(await asyncio.gather(first, b, d)) == ["FIRST", "B", "D"]
    assert send.batches == [["first"], ["b", "d"]]


async def test_each_call_runs_in_the_trace_context_of_its_first_item() -> None:
    send = Recorder()
    coalescer = Coalescer(send, max_batch=2)

    async def traced(item: str, trace_id: int) -> str:
        span = NonRecordingSpan(SpanContext(trace_id, 1, is_remote=False, trace_flags=TraceFlags(1)))
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            return await coalescer.submit(item)
        finally:
            otel_context.detach(token)

    first = asyncio.create_task(traced("a", 101))
    send.held = True
    await send.called.wait()
    later = [asyncio.create_task(traced(item, trace_id)) for item, trace_id in [("b", 102), ("c", 103), ("d", 104)]]
    await queued(coalescer, 3)
    send.release.set()
    await asyncio.gather(first, *later)
    assert send.batches == [["a"], ["b", "c"], ["d"]]
    assert send.trace_ids == [101, 102, 104]
    assert not trace.get_current_span().get_span_context().is_valid  # nothing leaked into the caller


async def test_drain_sends_what_is_queued_then_the_sender_stops() -> None:
    held = await behind_a_held_call(["b", "c", "d"], max_batch=2)
    send, coalescer, first, later = held.send, held.coalescer, held.first, held.later
    draining = asyncio.create_task(coalescer.drain(None))
    send.release.set()
    await draining
    assert [t.result() for t in (first, *later)] == ["FIRST", "B", "C", "D"]
    assert send.batches == [["first"], ["b", "c"], ["d"]]
    await coalescer.drain(None)  # nothing to wait for
    assert await coalescer.submit("e") == "E"  # a drained coalescer still serves


async def test_a_drain_that_gives_up_cancels_the_sender_and_fails_the_callers_left() -> None:
    held = await behind_a_held_call(["b", "c"], name="settler")  # never released
    send, coalescer, first, later = held.send, held.coalescer, held.first, held.later
    await coalescer.drain(0.01)
    results = await asyncio.gather(first, *later, return_exceptions=True)
    assert all(isinstance(r, CoalescerStopped) for r in results)
    assert "settler: stopped while sending" in str(results[0])
    assert "settler: stopped before this item was sent" in str(results[1])
    assert send.batches == [["first"]]


async def test_close_fails_every_waiting_caller_and_refuses_later_items() -> None:
    held = await behind_a_held_call(["b", "c"])  # never released: close cancels the call
    send, coalescer, first, later = held.send, held.coalescer, held.first, held.later
    closed = ConnectionError("closed for the night")
    await coalescer.close(closed)
    results = await asyncio.gather(first, *later, return_exceptions=True)
    assert results == [closed, closed, closed]
    with pytest.raises(ConnectionError, match="closed for the night"):
        await coalescer.submit("d")
    assert send.batches == [["first"]]


async def test_max_batch_must_be_positive() -> None:
    async def send(batch: list[str]) -> list[str]:
        return batch

    with pytest.raises(ValueError, match="max_batch must be at least 1, got 0"):
        Coalescer(send, max_batch=0)
