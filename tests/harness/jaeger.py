"""A real Jaeger v2 for the tests, and a reader of its query API.

The binary is the one `make jaeger-bin` builds from tools/jaeger (Jaeger 2.12.0, Go module
github.com/jaegertracing/jaeger v1.75.0): built once into build/, reused after, or taken from
QUAYUTEC_TEST_JAEGER_BIN. It runs with the project's own config (deploy/k8s/base/jaeger-config.yaml,
the same file the cluster mounts) on ephemeral loopback ports given through that file's environment
variables, with in-memory storage bounded by ``max_traces``.

What the tests read is what the Jaeger UI itself calls: the query API ``/api/v3`` (a trace by id, the
search with its required time bounds, the services, the operations) and, for the UI's search by
attributes (its Tags field), ``/api/traces?service=...&tags=...``, which 2.12's ``/api/v3/traces``
search does not offer (it ignores attributes). A trace not yet stored answers 404 "No traces found":
every read polls, with a bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from services.stack import free_port
from tests.harness.otlp import Got

REPO = Path(__file__).resolve().parent.parent.parent
CONFIG = REPO / "deploy" / "k8s" / "base" / "jaeger-config.yaml"
BIN_ENV = "QUAYUTEC_TEST_JAEGER_BIN"
# The longest a trace may take to appear after its spans were flushed (a failsafe, not a timing).
APPEAR_LIMIT = 30.0
START_LIMIT = 60.0
# OTLP's span kinds by their number (the query API answers OTLP JSON).
KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def jaeger_binary() -> Path:
    """The Jaeger v2 binary: QUAYUTEC_TEST_JAEGER_BIN, or `make jaeger-bin` (builds it when missing)."""
    given = os.environ.get(BIN_ENV, "").strip()
    if given:
        path = Path(given)
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"{BIN_ENV}={given} is not an executable file")
        return path
    made = subprocess.run(
        ["make", "-s", "--no-print-directory", "jaeger-bin"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if made.returncode != 0:
        raise RuntimeError(f"`make jaeger-bin` failed ({made.returncode}):\n{made.stdout}\n{made.stderr}")
    return REPO / made.stdout.strip().splitlines()[-1]


def value_of(value: Mapping[str, Any]) -> Any:
    """An OTLP JSON AnyValue as Python (an array as a tuple; 64-bit integers come as strings)."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return tuple(value_of(v) for v in value["arrayValue"].get("values", []))
    if "kvlistValue" in value:
        return {kv["key"]: value_of(kv.get("value", {})) for kv in value["kvlistValue"].get("values", [])}
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def attributes_of(items: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    return {kv["key"]: value_of(kv.get("value", {})) for kv in items or ()}


@dataclass(frozen=True)
class Link:
    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Event:
    name: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class JSpan:
    """One span as Jaeger's query API returned it."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: str
    service: str
    scope: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: tuple[Event, ...]
    links: tuple[Link, ...]
    status_code: int
    start_ns: int
    end_ns: int

    def links_to(self, other: JSpan) -> bool:
        return any((link.trace_id, link.span_id) == (other.trace_id, other.span_id) for link in self.links)

    def attr(self, key: str) -> Any:
        return self.attributes.get(key)


def _any(value: Any) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, tuple):
        return AnyValue(array_value=ArrayValue(values=[_any(v) for v in value]))
    return AnyValue(string_value=str(value))


def _key_values(attributes: Mapping[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=key, value=_any(value)) for key, value in attributes.items()]


def got_of(span: JSpan) -> Got:
    """A span Jaeger returned as the in-process receiver's ``Got`` (the OTLP protobuf it was sent
    as), so the checks written for that receiver (``tests.harness.walk``) read Jaeger's answer too."""
    kind = {name: number for number, name in KINDS.items()}[span.kind]
    return Got(
        scope=span.scope,
        resource=dict(span.resource),
        span=Span(
            trace_id=bytes.fromhex(span.trace_id),
            span_id=bytes.fromhex(span.span_id),
            parent_span_id=bytes.fromhex(span.parent_span_id),
            name=span.name,
            kind=kind,  # type: ignore[arg-type]
            start_time_unix_nano=span.start_ns,
            end_time_unix_nano=span.end_ns,
            attributes=_key_values(span.attributes),
            events=[Span.Event(name=e.name, attributes=_key_values(e.attributes)) for e in span.events],
            links=[
                Span.Link(
                    trace_id=bytes.fromhex(link.trace_id),
                    span_id=bytes.fromhex(link.span_id),
                    attributes=_key_values(link.attributes),
                )
                for link in span.links
            ],
            status=Status(code=span.status_code),  # type: ignore[arg-type]
        ),
    )


def spans_of(answer: Mapping[str, Any]) -> list[JSpan]:
    """Every span of a ``/api/v3/traces...`` answer (``{"result": {"resourceSpans": [...]}}``)."""
    found: list[JSpan] = []
    for resource_spans in answer.get("result", {}).get("resourceSpans", []):
        resource = attributes_of(resource_spans.get("resource", {}).get("attributes"))
        for scope_spans in resource_spans.get("scopeSpans", []):
            scope = scope_spans.get("scope", {}).get("name", "")
            for s in scope_spans.get("spans", []):
                found.append(
                    JSpan(
                        trace_id=s["traceId"],
                        span_id=s["spanId"],
                        parent_span_id=s.get("parentSpanId", ""),
                        name=s["name"],
                        kind=KINDS.get(int(s.get("kind", 0)), "unspecified"),
                        service=str(resource.get("service.name", "")),
                        scope=scope,
                        attributes=attributes_of(s.get("attributes")),
                        resource=resource,
                        events=tuple(
                            Event(e.get("name", ""), attributes_of(e.get("attributes"))) for e in s.get("events", [])
                        ),
                        links=tuple(
                            Link(link["traceId"], link["spanId"], attributes_of(link.get("attributes")))
                            for link in s.get("links", [])
                        ),
                        status_code=int(s.get("status", {}).get("code", 0) or 0),
                        start_ns=int(s.get("startTimeUnixNano", 0)),
                        end_ns=int(s.get("endTimeUnixNano", 0)),
                    )
                )
    return found


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Jaeger:
    """A Jaeger v2 process on ephemeral loopback ports, from the project's config file."""

    binary: Path
    ports: dict[str, int] = field(default_factory=dict)
    max_traces: int = 20_000
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def otlp_grpc(self) -> str:
        """The OTLP/gRPC endpoint, as OTEL_EXPORTER_OTLP_ENDPOINT takes it."""
        return f"http://127.0.0.1:{self.ports['otlp_grpc']}"

    @property
    def otlp_http(self) -> str:
        return f"http://127.0.0.1:{self.ports['otlp_http']}"

    @property
    def query(self) -> str:
        """The query API's (and the UI's) base address."""
        return f"http://127.0.0.1:{self.ports['query_http']}"

    @property
    def health(self) -> str:
        return f"http://127.0.0.1:{self.ports['health']}/status"

    def env(self) -> dict[str, str]:
        """The config file's variables: every listener on loopback, on this Jaeger's ports."""
        p = self.ports
        return {
            **os.environ,
            "JAEGER_OTLP_GRPC_ADDR": f"127.0.0.1:{p['otlp_grpc']}",
            "JAEGER_OTLP_HTTP_ADDR": f"127.0.0.1:{p['otlp_http']}",
            "JAEGER_QUERY_HTTP_ADDR": f"127.0.0.1:{p['query_http']}",
            "JAEGER_QUERY_GRPC_ADDR": f"127.0.0.1:{p['query_grpc']}",
            "JAEGER_HEALTH_ADDR": f"127.0.0.1:{p['health']}",
            "JAEGER_METRICS_HOST": "127.0.0.1",
            "JAEGER_METRICS_PORT": str(p["metrics"]),
            "JAEGER_MAX_TRACES": str(self.max_traces),
        }

    def start(self) -> None:
        """Start (again, on the same ports after ``stop``) and wait until its health says ready."""
        if not self.ports:
            names = ("otlp_grpc", "otlp_http", "query_http", "query_grpc", "health", "metrics")
            self.ports = {name: free_port() for name in names}
        if self.log_path is None:
            self.log_path = Path(tempfile.mkdtemp(prefix="qy-jaeger-")) / "jaeger.log"
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), "--config", str(CONFIG)],
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_LIMIT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jaeger exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.health, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"jaeger did not become healthy in {START_LIMIT:g} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    # The query API.

    async def _get(self, path: str, params: Mapping[str, str] | None = None) -> httpx.Response:
        async with httpx.AsyncClient(base_url=self.query, timeout=10.0) as client:
            return await client.get(path, params=params)

    async def trace(
        self, trace_id: str, until: Callable[[list[JSpan]], bool] | None = None, limit: float = APPEAR_LIMIT
    ) -> list[JSpan]:
        """``GET /api/v3/traces/{trace_id}``'s spans, polled until the trace is stored and ``until``
        holds of its spans (a failsafe bound: then the last answer, or an error naming what was seen)."""
        deadline = time.monotonic() + limit
        spans: list[JSpan] = []
        while True:
            answer = await self._get(f"/api/v3/traces/{trace_id}")
            if answer.status_code == 200:
                spans = spans_of(answer.json())
                if until is None or until(spans):
                    return spans
            elif answer.status_code != 404:
                raise AssertionError(f"GET /api/v3/traces/{trace_id}: {answer.status_code} {answer.text[:500]}")
            if time.monotonic() > deadline:
                if not spans:
                    raise AssertionError(f"trace {trace_id} not in Jaeger after {limit:g} s: {answer.text[:300]}")
                return spans
            await asyncio.sleep(0.2)

    async def raw_trace(self, trace_id: str) -> dict[str, Any]:
        """The answer of ``GET /api/v3/traces/{trace_id}`` as JSON (for the docs' excerpt, the scans)."""
        answer = await self._get(f"/api/v3/traces/{trace_id}")
        answer.raise_for_status()
        data: dict[str, Any] = answer.json()
        return data

    async def services(self) -> list[str]:
        answer = await self._get("/api/v3/services")
        answer.raise_for_status()
        return list(answer.json().get("services", []))

    async def operations(self, service: str, span_kind: str = "") -> list[tuple[str, str]]:
        """``/api/v3/operations``: (name, span kind) of every operation of ``service``."""
        params = {"service": service, **({"span_kind": span_kind} if span_kind else {})}
        answer = await self._get("/api/v3/operations", params)
        answer.raise_for_status()
        return [(op["name"], op.get("spanKind", "")) for op in answer.json().get("operations", [])]

    async def find(
        self,
        service: str,
        *,
        operation: str = "",
        since: timedelta = timedelta(hours=1),
        num_traces: int = 100,
    ) -> list[JSpan]:
        """The ``/api/v3/traces`` search: its time bounds (``query.start_time_min``/``_max``) are
        required, and 2.12 refuses a search depth (``query.num_traces``) of 0, its default."""
        now = datetime.now(UTC)
        params = {
            "query.service_name": service,
            "query.start_time_min": rfc3339(now - since),
            "query.start_time_max": rfc3339(now + timedelta(minutes=1)),
            "query.num_traces": str(num_traces),
        }
        if operation:
            params["query.operation_name"] = operation
        answer = await self._get("/api/v3/traces", params)
        if answer.status_code == 404:
            return []
        if answer.status_code != 200:
            raise AssertionError(f"GET /api/v3/traces {params}: {answer.status_code} {answer.text[:500]}")
        return spans_of(answer.json())

    async def search_tags(
        self, service: str, tags: Mapping[str, str], *, lookback: str = "1h", limit: int = 20
    ) -> list[str]:
        """The UI's search by attributes (its Tags field): the trace ids ``/api/traces`` finds for
        ``service`` with every one of ``tags``."""
        params = {"service": service, "tags": json.dumps(dict(tags)), "lookback": lookback, "limit": str(limit)}
        answer = await self._get("/api/traces", params)
        if answer.status_code == 404:
            return []
        if answer.status_code != 200:
            raise AssertionError(f"GET /api/traces {params}: {answer.status_code} {answer.text[:500]}")
        return [t["traceID"] for t in answer.json().get("data") or []]

    async def search_tags_until(
        self, service: str, tags: Mapping[str, str], want: str, limit: float = APPEAR_LIMIT
    ) -> list[str]:
        """``search_tags`` polled until it finds the trace ``want`` (bounded): what it found last."""
        deadline = time.monotonic() + limit
        while True:
            found = await self.search_tags(service, tags)
            if want in found or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.2)

    # Jaeger's own metrics.

    async def span_counters(self) -> dict[str, float]:
        """Jaeger's counters of spans (its Prometheus metrics, summed over their labels): ``accepted``
        and ``refused`` by the OTLP receiver, ``sent`` (written) and ``failed`` by the storage exporter."""
        names = {
            "otelcol_receiver_accepted_spans_total": "accepted",
            "otelcol_receiver_refused_spans_total": "refused",
            "otelcol_exporter_sent_spans_total": "sent",
            "otelcol_exporter_send_failed_spans_total": "failed",
        }
        async with httpx.AsyncClient(timeout=10.0) as client:
            answer = await client.get(f"http://127.0.0.1:{self.ports['metrics']}/metrics")
        answer.raise_for_status()
        counts = dict.fromkeys(names.values(), 0.0)
        for line in answer.text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in names:
                counts[names[name]] += float(line.rsplit(" ", 1)[1])
        return counts

    async def stored_all(self, limit: float = APPEAR_LIMIT) -> dict[str, float]:
        """Wait (bounded) until every span the OTLP receiver accepted is written to storage or failed
        (Jaeger's batch processor holds spans a moment): then every span sent to it so far can be read.
        Returns the counters."""
        deadline = time.monotonic() + limit
        while True:
            counts = await self.span_counters()
            if counts["accepted"] <= counts["sent"] + counts["failed"] or time.monotonic() > deadline:
                return counts
            await asyncio.sleep(0.1)


def running_jaeger(max_traces: int = 20_000) -> Iterator[Jaeger]:
    """A started Jaeger, stopped at the end (the body of the session fixture)."""
    jaeger = Jaeger(jaeger_binary(), max_traces=max_traces)
    jaeger.start()
    try:
        yield jaeger
    finally:
        jaeger.stop()


@contextmanager
def black_hole() -> Iterator[str]:
    """A "Jaeger" on 127.0.0.1 that accepts TCP connections (the kernel completes them into the
    listening socket's backlog) and never reads or answers: its OTLP/gRPC endpoint."""
    hole = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hole.bind(("127.0.0.1", 0))
    hole.listen(128)
    try:
        yield f"http://127.0.0.1:{hole.getsockname()[1]}"
    finally:
        hole.close()
