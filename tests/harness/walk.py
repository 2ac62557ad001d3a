"""The walk: what an operator finds from each wake's trace in what an OTLP receiver got.

A wake's trace is the trace of its ``deliver wake`` span. A span is reached from it when it is in
that trace, or in a trace one of whose spans links to a span of that trace (a batched call that
carried the wake). ``walk`` counts, for the wakes given, the spans of their traces, the links, the
orphan roots (a span whose parent never arrived) and which of claim, start and settlement each
wake reaches; ``tests/test_trace_links.py`` prints the figures and checks them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.harness.otlp import Got

# The server spans of each step a wake's delivery takes, whatever call carried it.
STEPS: dict[str, frozenset[str]] = {
    "claim": frozenset({"quayutec.v1.ClaimsService/ClaimOnce", "quayutec.v1.ClaimsService/ClaimMany"}),
    "start": frozenset({"quayutec.v1.RuntimeService/StartRun", "quayutec.v1.RuntimeService/StartRuns"}),
    "settle": frozenset({"quayutec.v1.RoomService/SettleWakes"}),
}


@dataclass
class Walk:
    wakes: int
    spans: int  # every span received
    spans_in_wake_traces: int
    links: int  # every span link received
    orphans: list[str]  # names of spans whose parent never arrived
    traces: int
    missing: dict[str, list[str]] = field(default_factory=dict)  # step -> wake ids that do not reach it
    calls: dict[str, int] = field(default_factory=dict)  # server spans of each step's calls, by name
    exception_events: int = 0  # exception events on any span (with a stack trace each)

    def figures(self) -> str:
        missing = ", ".join(f"{step} {len(ids)}" for step, ids in self.missing.items())
        return (
            f"wakes {self.wakes}: spans {self.spans} in {self.traces} traces, "
            f"{self.spans_in_wake_traces / max(self.wakes, 1):.1f} spans per wake trace, links {self.links}, "
            f"orphan roots {len(self.orphans)}, exception events {self.exception_events}; "
            f"wakes not reaching their step: {missing}; calls {self.calls}"
        )


def _normalised(name: str) -> str:
    return name.lstrip("/")


def walk(spans: Sequence[Got], wake_ids: Iterable[str]) -> Walk:
    """The walk's figures for ``wake_ids`` over every span received."""
    by_trace: dict[str, list[Got]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    span_ids = {(s.span.trace_id, s.span.span_id) for s in spans}
    orphans = [
        s.name for s in spans if s.span.parent_span_id and (s.span.trace_id, s.span.parent_span_id) not in span_ids
    ]
    children: dict[tuple[bytes, bytes], list[Got]] = defaultdict(list)
    for s in spans:
        children[(s.span.trace_id, s.span.parent_span_id)].append(s)
    by_id = {(s.span.trace_id, s.span.span_id): s for s in spans}

    def subtree(root: Got) -> list[Got]:
        found, todo = [], [root]
        while todo:
            s = todo.pop()
            found.append(s)
            todo.extend(children[(s.span.trace_id, s.span.span_id)])
        return found

    wakes = list(wake_ids)
    missing: dict[str, list[str]] = {step: [] for step in STEPS}
    in_wake_traces = 0
    for wake_id in wakes:
        deliveries = [s for s in spans if s.name == "deliver wake" and s.attr("quayutec.wake_id") == wake_id]
        traces = {d.span.trace_id for d in deliveries}
        in_wake_traces += sum(len(by_trace[t.hex()]) for t in traces)
        reached = [s for t in traces for s in by_trace[t.hex()]]
        for s in spans:  # a span linking into the wake's trace, and what it called
            if any(link.trace_id in traces for link in s.span.links):
                reached.extend(subtree(s))
        for s in list(reached):  # a span the wake's trace links to, and what it called
            for link in s.span.links:
                target = by_id.get((link.trace_id, link.span_id))
                if target is not None and target.span.trace_id not in traces:
                    reached.extend(subtree(target))
        names = {_normalised(s.name) for s in reached if s.span.kind == Span.SPAN_KIND_SERVER}
        for step, wanted in STEPS.items():
            if not names & wanted:
                missing[step].append(wake_id)
    return Walk(
        wakes=len(wakes),
        spans=len(spans),
        spans_in_wake_traces=in_wake_traces,
        links=sum(len(s.span.links) for s in spans),
        orphans=orphans,
        traces=len(by_trace),
        missing=missing,
        exception_events=sum(1 for s in spans for e in s.span.events if e.name == "exception"),
        calls={
            name.rsplit("/", 1)[-1]: sum(
                1 for s in spans if _normalised(s.name) == name and s.span.kind == Span.SPAN_KIND_SERVER
            )
            for names in STEPS.values()
            for name in sorted(names)
        },
    )
