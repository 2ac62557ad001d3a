"""RuntimeService: a thin adapter from StartRun and StartRuns to the run executor.

StartRuns starts each item exactly as StartRun would (``RunExecutor.start``: claim first, capacity
checked before claiming, the claim asked again within the call's remaining time), all items at
once, so that their claims leave together in one ClaimMany through the Runtime's coalescing
Claims client. Each item is started under the trace context its traceparent names, in a span of
its own ("StartRun"), so the run and its claim stay in the wake's trace. Capacity is taken in
request order (each item checks it before its first wait), so when the Runtime fills up the items
over the limit are the last ones. An item's failure is its answer's error; a cancelled call
cancels the items still claiming, and none of them starts.
"""

from __future__ import annotations

import asyncio
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from quayutec.errors import InvalidArgument, status_logged
from quayutec.telemetry import annotate
from quayutec.v1 import runtime_pb2, runtime_pb2_grpc
from services.runtime.run import RunExecutor, Wake

# Most items one StartRuns call carries (the Gateway's largest leased batch).
MAX_START_RUNS_ITEMS = 500
# The tracer of each StartRuns item's span.
START_TRACER = "quayutec.runtime.start"

_propagator = TraceContextTextMapPropagator()
# Got once (a proxy until a provider is installed): get_tracer per item would build a tracer each time.
_START = trace.get_tracer(START_TRACER)


class RuntimeServicer(runtime_pb2_grpc.RuntimeServiceServicer):
    def __init__(self, executor: RunExecutor) -> None:
        self._executor = executor

    async def StartRun(self, request: runtime_pb2.StartRunRequest, context: Any) -> runtime_pb2.StartRunResponse:
        result, run_id = await self._executor.start(Wake.from_request(request), time_left=context.time_remaining())
        return _answer(result, run_id)

    async def StartRuns(self, request: runtime_pb2.StartRunsRequest, context: Any) -> runtime_pb2.StartRunsResponse:
        count = len(request.items)
        if count == 0 or count > MAX_START_RUNS_ITEMS:
            raise InvalidArgument(
                f"StartRuns takes 1 to {MAX_START_RUNS_ITEMS} items, got {count}: send the wakes in batches of "
                f"at most {MAX_START_RUNS_ITEMS}"
            )
        annotate(wake_ids=[item.request.wake_id for item in request.items])
        time_left = context.time_remaining()
        # gather runs each item in a task of its own, started in request order.
        answers = await asyncio.gather(*(self._start_item(item, time_left) for item in request.items))
        return runtime_pb2.StartRunsResponse(answers=answers)

    async def _start_item(
        self, item: runtime_pb2.StartRunsItem, time_left: float | None
    ) -> runtime_pb2.StartRunsAnswer:
        """One item, as StartRun would start it, in its wake's trace; its error is its answer."""
        carrier = {"traceparent": item.traceparent}
        if item.tracestate:
            carrier["tracestate"] = item.tracestate
        # An empty or malformed traceparent extracts an empty context: the item starts a trace of its own.
        parent = _propagator.extract(carrier, context=otel_context.Context())
        call = trace.get_current_span().get_span_context()  # the StartRuns call's span, linked
        with _START.start_as_current_span(
            "StartRun",
            context=parent,
            kind=SpanKind.INTERNAL,
            links=[Link(call)] if call.is_valid else None,
            record_exception=False,
        ) as span:
            try:
                result, run_id = await self._executor.start(Wake.from_request(item.request), time_left=time_left)
            except Exception as exc:
                code, message = status_logged(exc, f"StartRuns item {item.request.wake_id}")
                span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code.name}: {message}"))
                return runtime_pb2.StartRunsAnswer(error_code=code.value[0], error_message=message)
            return runtime_pb2.StartRunsAnswer(response=_answer(result, run_id))


def _answer(result: runtime_pb2.StartRunResult.ValueType, run_id: str) -> runtime_pb2.StartRunResponse:
    """StartRun's answer. This Runtime answers ALREADY_CLAIMED only when the fence refused the run's first
    ledger write (another delivery's run holds the row), so it says so: the Gateway need not read the row."""
    already = result == runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED
    return runtime_pb2.StartRunResponse(result=result, run_id=run_id, row_held=already)
