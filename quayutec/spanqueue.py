"""The span export path when the collector (Jaeger) is slow or gone: a bounded queue, every lost
span counted and said, and a shutdown that gives up on time.

The SDK's BatchSpanProcessor keeps ended spans in a queue of ``OTEL_BSP_MAX_QUEUE_SIZE`` and one
thread exports them in batches; its OTLP/gRPC exporter tries a batch for at most
``OTEL_EXPORTER_OTLP_TIMEOUT`` seconds (retrying UNAVAILABLE and DEADLINE_EXCEEDED with a doubling
backoff, 1, 2, 4 s, while it fits in that time) and then drops it. A wake never waits on any of it: ``on_end`` only
appends to the queue. What the SDK does not do is say how much it lost (one deduplicated "Queue
full" line, no count) or bound its shutdown (it waits up to 30 s for the queue to drain). So, with
the SDK's own extension points and nothing patched:

* ``CountingExporter`` wraps the exporter: it counts the spans handed to it and, for a batch that
  failed, the spans dropped (``export_failed``); ``abandon()`` stops it (a batch under way is
  cancelled, later ones are dropped at once as ``shutdown``).
* ``BoundedSpanQueue`` wraps the BatchSpanProcessor: it counts the spans it queues and refuses one
  when the queue already holds ``max_queue_size`` (``queue_full``), so what it holds stays within
  the bound and each refused span is counted (the SDK's own overflow would drop silently).
* ``SpanLosses`` adds each loss to ``quayutec.telemetry.spans_dropped{reason}`` (and the queue's
  length is the gauge ``quayutec.telemetry.spans_queued``) and writes one
  warning at most every ``LOG_EVERY_SECONDS`` with the counts since the last one, the totals and
  the settings to change.
* ``BoundedSpanQueue.shutdown_within(seconds)`` flushes what is queued for at most ``seconds``
  (QUAYUTEC_TELEMETRY_SHUTDOWN_SECONDS), then abandons the rest and says how many spans it left.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics
from opentelemetry.metrics import Observation
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

_log = logging.getLogger("quayutec.telemetry")

# At most one "spans dropped" line per this many seconds (each names the count since the last one).
LOG_EVERY_SECONDS = 10.0
REASONS = ("queue_full", "export_failed", "shutdown")
DROPPED_METRIC = "quayutec.telemetry.spans_dropped"
QUEUED_METRIC = "quayutec.telemetry.spans_queued"
# Room in the batch processor's own deque beyond the bound we keep (see BoundedSpanQueue).
_SLACK = 256
# How long the worker may take to finish once the exporter is abandoned (its batches drop at once).
_AFTER_ABANDON_SECONDS = 2.0


class SpanLosses:
    """Spans lost, by reason: a counter metric and a rate-limited warning naming what to change."""

    def __init__(
        self,
        *,
        endpoint: str,
        max_queue_size: int,
        export_timeout_seconds: float,
        meter: metrics.Meter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._endpoint = endpoint
        self._max_queue_size = max_queue_size
        self._export_timeout = export_timeout_seconds
        meter = meter or metrics.get_meter("quayutec")
        self.meter = meter
        self._counter = meter.create_counter(
            DROPPED_METRIC,
            unit="{span}",
            description="Spans never exported: the queue was full, the export failed, or shutdown gave up",
        )
        self._clock = clock
        self._lock = threading.Lock()
        self.totals = dict.fromkeys(REASONS, 0)
        self._since_line = dict.fromkeys(REASONS, 0)
        self._line_at = clock() - LOG_EVERY_SECONDS

    def drop(self, count: int, reason: str) -> None:
        if count <= 0:
            return
        self._counter.add(count, {"reason": reason})
        with self._lock:
            self.totals[reason] += count
            self._since_line[reason] += count
            now = self._clock()
            if now - self._line_at < LOG_EVERY_SECONDS:
                return
            since = self._line_at
            self._line_at = now
            counts = {r: n for r, n in self._since_line.items() if n}
            self._since_line = dict.fromkeys(REASONS, 0)
            totals = sum(self.totals.values())
        self._warn(counts, now - since, totals)

    def flush_line(self) -> None:
        """Write the counts not yet said (at shutdown), if any."""
        with self._lock:
            counts = {r: n for r, n in self._since_line.items() if n}
            self._since_line = dict.fromkeys(REASONS, 0)
            since = self._line_at
            self._line_at = self._clock()
            totals = sum(self.totals.values())
        if counts:
            self._warn(counts, self._line_at - since, totals)

    def _warn(self, counts: dict[str, int], seconds: float, totals: int) -> None:
        _log.warning(
            "telemetry: %d spans dropped (%s) in the last %.0f s, %d since start: the exporter to %s "
            "keeps at most OTEL_BSP_MAX_QUEUE_SIZE=%d spans waiting and gives a batch up after "
            "OTEL_EXPORTER_OTLP_TIMEOUT=%g s; raise OTEL_BSP_MAX_QUEUE_SIZE to ride out a longer outage",
            sum(counts.values()),
            ", ".join(f"{reason} {n}" for reason, n in counts.items()),
            min(seconds, 1e6),
            totals,
            self._endpoint,
            self._max_queue_size,
            self._export_timeout,
        )


class CountingExporter(SpanExporter):
    """Counts the spans handed to ``inner`` and those it failed to export; ``abandon()`` stops it."""

    def __init__(self, inner: SpanExporter, losses: SpanLosses, endpoint: str) -> None:
        self._inner = inner
        self._losses = losses
        self._endpoint = endpoint
        # Written by the processor's one worker thread (and force_flush's caller, under its lock).
        self.handed = 0
        self._abandoned = False
        self._failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.handed += len(spans)
        if self._abandoned:
            self._losses.drop(len(spans), "shutdown")
            return SpanExportResult.FAILURE
        try:
            result = self._inner.export(spans)
        except Exception:  # the SDK logs an exporter's exception the same way; count the batch
            _log.exception("telemetry: exporting %d spans raised", len(spans))
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            if self._failing:
                self._failing = False
                _log.warning("telemetry: exporting spans to %s again", self._endpoint)
            return result
        self._failing = True
        self._losses.drop(len(spans), "shutdown" if self._abandoned else "export_failed")
        return result

    def abandon(self) -> None:
        """Stop: a batch under way is cancelled (the gRPC exporter's shutdown closes its channel and
        ends its backoff), every later batch is dropped at once."""
        if self._abandoned:
            return
        self._abandoned = True
        self._inner.shutdown()

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.abandon()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._inner.force_flush(timeout_millis)


class BoundedSpanQueue(SpanProcessor):
    """A BatchSpanProcessor whose queue never holds more than ``max_queue_size`` spans: a span that
    would overflow it is refused and counted (``queue_full``). ``on_end`` stays an append."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        losses: SpanLosses,
        endpoint: str,
        max_queue_size: int,
        shutdown_seconds: float,
        schedule_delay_millis: float | None = None,
    ) -> None:
        self.losses = losses
        self.exporter = CountingExporter(exporter, losses, endpoint)
        self.max_queue_size = max_queue_size
        self.shutdown_seconds = shutdown_seconds
        # The delay and the batch size are the SDK's (OTEL_BSP_SCHEDULE_DELAY, _MAX_EXPORT_BATCH_SIZE).
        # Its deque gets room beyond ours for the spans two threads may admit at once (``on_end``
        # takes no lock): the bound is kept here, and the deque never drops one silently.
        self._batch = BatchSpanProcessor(
            self.exporter, max_queue_size=max_queue_size + _SLACK, schedule_delay_millis=schedule_delay_millis
        )
        self._lock = threading.Lock()
        self.queued = 0  # spans given to the batch processor
        self._closed = False
        losses.meter.create_observable_gauge(
            QUEUED_METRIC,
            callbacks=[lambda options: [Observation(self.waiting())]],
            unit="{span}",
            description="Spans waiting for export (at most OTEL_BSP_MAX_QUEUE_SIZE)",
        )

    def waiting(self) -> int:
        """Spans queued and not yet handed to the exporter (at most ``max_queue_size``)."""
        return self.queued - self.exporter.handed

    def on_start(self, span: Span, parent_context: otel_context.Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context is None or not context.trace_flags.sampled:
            return  # the batch processor exports sampled spans only
        if self._closed or self.queued - self.exporter.handed >= self.max_queue_size:
            self.losses.drop(1, "shutdown" if self._closed else "queue_full")
            return
        self.queued += 1
        self._batch.on_end(span)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._batch.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.shutdown_within(self.shutdown_seconds)

    def shutdown_within(self, seconds: float) -> int:
        """Export what is queued for at most ``seconds``, then abandon the rest; the number of spans
        left unexported (also counted as ``shutdown``)."""
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
        started = time.monotonic()
        dropped_before = self.losses.totals["shutdown"]
        worker = threading.Thread(target=self._batch.shutdown, name="quayutec-span-shutdown", daemon=True)
        worker.start()
        worker.join(seconds)
        left = 0
        if worker.is_alive():
            self.exporter.abandon()
            worker.join(_AFTER_ABANDON_SECONDS)
            left = self.losses.totals["shutdown"] - dropped_before
            _log.warning(
                "telemetry: gave up exporting spans after %.1f s (QUAYUTEC_TELEMETRY_SHUTDOWN_SECONDS=%g): "
                "%d spans left unexported; dropped since start: %s",
                time.monotonic() - started,
                seconds,
                left,
                ", ".join(f"{reason} {n}" for reason, n in self.losses.totals.items()),
            )
        self.losses.flush_line()
        return left
