"""The run page's trace links: every trace of the run (its first and each continuation's), each
opening in Jaeger when QUAYUTEC_CONSOLE_JAEGER_URL is set, each id shown to copy otherwise."""

from __future__ import annotations

from quayutec.v1 import common_pb2
from services.console.runs import trace_links

JAEGER = "http://127.0.0.1:16686"
FIRST, CONTINUED = "a" * 32, "b" * 32


def test_a_continued_run_links_to_both_of_its_traces() -> None:
    run = common_pb2.Run(trace_id=FIRST, trace_ids=[FIRST, CONTINUED])
    assert trace_links(JAEGER, run) == [
        {"trace_id": FIRST, "label": "the first trace", "href": f"{JAEGER}/trace/{FIRST}"},
        {"trace_id": CONTINUED, "label": "the continuation's trace", "href": f"{JAEGER}/trace/{CONTINUED}"},
    ]


def test_a_run_of_one_trace_and_a_row_from_before_trace_ids() -> None:
    expected = [{"trace_id": FIRST, "label": "the trace", "href": f"{JAEGER}/trace/{FIRST}"}]
    assert trace_links(JAEGER, common_pb2.Run(trace_id=FIRST, trace_ids=[FIRST])) == expected
    assert trace_links(JAEGER, common_pb2.Run(trace_id=FIRST)) == expected  # recorded before trace_ids existed


def test_without_jaeger_each_trace_is_named_not_linked() -> None:
    links = trace_links("", common_pb2.Run(trace_id=FIRST, trace_ids=[FIRST, CONTINUED]))
    assert [(link["trace_id"], link["href"]) for link in links] == [(FIRST, ""), (CONTINUED, "")]
    assert trace_links(JAEGER, common_pb2.Run()) == []  # not traced
