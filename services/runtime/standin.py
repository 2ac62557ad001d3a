"""A stand-in model provider: a real local HTTP server speaking Anthropic Messages
(POST /v1/messages) and OpenAI Chat Completions (POST /v1/chat/completions).

Behaviour is scripted per model name (faults and replies, consumed one per request in order);
with nothing queued it answers at once with a deterministic reply. Every request is recorded, its
key redacted. Another process scripts it over the control API under /_standin/. Run it alone with
`python -m services.runtime.standin --port N`; it serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType, TracebackType
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

Wire = Literal["anthropic", "openai"]

FAULT_KINDS = frozenset(
    {
        "rate_limit",
        "overloaded",
        "server_error",
        "timeout",
        "drop",
        "key_rejected",
        "unknown_model",
        "quota",
        "spend_cap",
        "raw",
        "huge",
    }
)
# A `huge` body goes out in writes of this many bytes.
HUGE_CHUNK = 64 * 1024
REDACTED = "REDACTED"
_SECRET_HEADERS = frozenset({"x-api-key", "authorization", "api-key"})


@dataclass(frozen=True)
class Fault:
    """One scripted failure, shaped as the provider of the path it hits would send it.

    `retry_after` / `retry_after_ms` set those headers; `seconds` is how long `timeout` stalls;
    `raw` sends `status`, `body` (dict/list as JSON, str as text, None as empty) and `headers`.
    `huge` sends `status` with a body of `size` bytes, made as it is sent (the stand-in never holds
    it), chunked or, with `declare_length`, under a content-length; how much of it went out before
    the client hung up is in ``StandinProvider.huge_bytes_sent()``.
    `headers` are added to any fault (e.g. {"x-should-retry": "false"}).
    """

    kind: str
    retry_after: float | str | None = None
    retry_after_ms: float | None = None
    seconds: float = 10.0
    status: int = 500
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    size: int = 0
    declare_length: bool = False

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; known: {sorted(FAULT_KINDS)}")


@dataclass(frozen=True)
class ScriptedReply:
    """A successful answer. `tool_calls` items: {"name", "arguments", optional "id"}; an
    `arguments` string is sent verbatim (to script bad JSON). `delay_seconds` passes before the
    headers; with `slice_seconds` the body trickles in, in BODY_SLICES slices that far apart."""

    text: str
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    delay_seconds: float = 0.0
    slice_seconds: float = 0.0


# How many slices a trickled body (`slice_seconds`) is sent in.
BODY_SLICES = 10


@dataclass(frozen=True)
class RecordedRequest:
    path: str
    model: str | None
    headers: Mapping[str, str]
    body: Any
    time: float
    answer: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"headers": dict(self.headers)}


Script = Fault | ScriptedReply
Responder = Callable[[Mapping[str, Any]], "ScriptedReply | None"]


class _State:
    """Queues and records, shared by the handler threads and the owner of the server."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queues: dict[str | None, deque[Script]] = {}
        self.records: list[RecordedRequest] = []
        self.stopping = threading.Event()
        self.counter = 0
        self.responders: dict[str, Responder] = {}
        self.huge_sent: list[int] = []

    def enqueue(self, item: Script, model: str | None, times: int) -> None:
        if times < 1:
            raise ValueError("times must be at least 1")
        with self.lock:
            self.queues.setdefault(model, deque()).extend([item] * times)

    def take(self, model: str | None) -> Script | None:
        """The model's own queue first, then the any-model queue."""
        with self.lock:
            for key in (model, None) if model is not None else (None,):
                queue = self.queues.get(key)
                if queue:
                    return queue.popleft()
        return None

    def record(self, record: RecordedRequest) -> int:
        with self.lock:
            self.records.append(record)
            self.counter += 1
            return self.counter

    def requests(self, model: str | None) -> list[RecordedRequest]:
        with self.lock:
            return [r for r in self.records if model is None or r.model == model]

    def reset(self) -> None:
        with self.lock:
            self.queues.clear()
            self.records.clear()
            self.huge_sent.clear()


class StandinProvider:
    """Start on 127.0.0.1, port 0 by default; `start()` returns the base URL."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._port = port
        self._state = _State()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("stand-in not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> str:
        if self._server is None:
            self._state.stopping.clear()
            self._server = _Server((self._host, self._port), _Handler, self._state)
            self._thread = threading.Thread(
                target=self._server.serve_forever, args=(0.05,), name="standin-provider", daemon=True
            )
            self._thread.start()
        return self.base_url

    def stop(self) -> None:
        """Stop serving and wake any stalled answer. Safe to call twice."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._state.stopping.set()
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> StandinProvider:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def enqueue_fault(self, fault: Fault | str, model: str | None = None, *, times: int = 1, **params: Any) -> None:
        """Queue a fault (a Fault, or a kind name with Fault's fields as keywords)."""
        item = fault if isinstance(fault, Fault) else Fault(kind=fault, **params)
        self._state.enqueue(item, model, times)

    def enqueue_reply(
        self,
        text: str,
        tool_calls: Sequence[Mapping[str, Any]] = (),
        model: str | None = None,
        *,
        delay_seconds: float = 0.0,
        slice_seconds: float = 0.0,
        times: int = 1,
    ) -> None:
        self._state.enqueue(ScriptedReply(text, tuple(tool_calls), delay_seconds, slice_seconds), model, times)

    def set_responder(self, model: str, responder: Responder | None) -> None:
        """Answer ``model``'s requests with ``responder(request_body)`` when nothing is queued
        (in-process use only, e.g. the demo scripting replies from the prompt)."""
        with self._state.lock:
            if responder is None:
                self._state.responders.pop(model, None)
            else:
                self._state.responders[model] = responder

    def requests(self, model: str | None = None) -> list[RecordedRequest]:
        return self._state.requests(model)

    def huge_bytes_sent(self) -> list[int]:
        """Per `huge` answer, in order: the body bytes written before it ended (all of them, or as
        many as went out before the client closed the connection)."""
        with self._state.lock:
            return list(self._state.huge_sent)

    def reset(self) -> None:
        """Forget queued behaviour and recorded requests."""
        self._state.reset()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Many runs call at once (bench/inflight.py: 2,000): the default listen backlog of 5 drops SYNs.
    request_queue_size = 4096
    block_on_close = False

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], state: _State) -> None:
        self.state = state
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up (timeout test) makes our late write fail; that is expected.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without TCP_NODELAY, Nagle's algorithm and the
    # client's delayed ACK would add ~40 ms to every answer of a kept-alive connection.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # -- routing -------------------------------------------------------------------------------

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/_standin/requests":
            model = parse_qs(url.query).get("model", [None])[0]
            records = [r.to_json() for r in self.server.state.requests(model)]
            self._send_json(200, {"requests": records})
        elif url.path == "/_standin/health":
            self._send_json(200, {"ok": True})
        else:
            self._send_json(404, {"error": f"no route {url.path}"})

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        raw = self._read_body()
        if path.startswith("/_standin/"):
            self._control(path, raw)
        elif path == "/v1/messages":
            self._provider("anthropic", path, raw)
        elif path == "/v1/chat/completions":
            self._provider("openai", path, raw)
        else:
            self._send_json(404, {"error": f"no route {path}"})

    def _control(self, path: str, raw: bytes) -> None:
        state = self.server.state
        try:
            data = json.loads(raw or b"{}")
            if not isinstance(data, dict):
                raise ValueError("expected a JSON object")
            model = data.pop("model", None)
            times = int(data.pop("times", 1))
            if path == "/_standin/faults":
                kind = data.pop("fault")
                state.enqueue(Fault(kind=kind, **data), model, times)
            elif path == "/_standin/replies":
                reply = ScriptedReply(
                    text=str(data.get("text", "")),
                    tool_calls=tuple(data.get("tool_calls") or ()),
                    delay_seconds=float(data.get("delay_seconds", 0.0)),
                    slice_seconds=float(data.get("slice_seconds", 0.0)),
                )
                state.enqueue(reply, model, times)
            elif path == "/_standin/reset":
                state.reset()
            else:
                self._send_json(404, {"error": f"no route {path}"})
                return
        except (ValueError, TypeError, KeyError) as exc:
            self._send_json(400, {"error": str(exc)})
            return
        self._send_json(200, {"ok": True})

    # -- provider ------------------------------------------------------------------------------

    def _provider(self, wire: Wire, path: str, raw: bytes) -> None:
        state = self.server.state
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        model = body.get("model") if isinstance(body, dict) else None
        model = model if isinstance(model, str) else None
        item = state.take(model) if isinstance(body, dict) else None
        answer = "default" if item is None else (f"fault:{item.kind}" if isinstance(item, Fault) else "reply")
        answer = answer if isinstance(body, dict) else "invalid"
        number = state.record(RecordedRequest(path, model, self._redacted_headers(), body, time.time(), answer))
        if not isinstance(body, dict):
            self._send_fault_body(wire, 400, "invalid_request_error", "body is not a JSON object", None, {})
            return
        if isinstance(item, Fault):
            self._fault(wire, item, model or "")
            return
        if isinstance(item, ScriptedReply) and item.delay_seconds > 0:
            if state.stopping.wait(item.delay_seconds):
                return
        if item is None and model is not None and model in state.responders:
            item = state.responders[model](body)
        reply = item if isinstance(item, ScriptedReply) else ScriptedReply(_default_text(wire, body))
        answer_body = _reply_body(wire, reply, model or "", body, number)
        if reply.slice_seconds > 0:
            self._send_trickled(answer_body, reply.slice_seconds)
            return
        self._send_json(200, answer_body)

    def _fault(self, wire: Wire, fault: Fault, model: str) -> None:
        extra: dict[str, str] = dict(fault.headers)
        if fault.retry_after is not None:
            extra["retry-after"] = str(fault.retry_after)
        if fault.retry_after_ms is not None and wire == "openai":
            extra["retry-after-ms"] = str(fault.retry_after_ms)
        kind = fault.kind
        if kind == "drop":
            self.close_connection = True
            return
        if kind == "timeout":
            if not self.server.state.stopping.wait(fault.seconds):
                self._send_fault_body(wire, 504, "timeout_error", "stand-in stalled", None, extra)
            return
        if kind == "raw":
            self._send_raw(fault.status, fault.body, extra)
            return
        if kind == "huge":
            self._send_huge(fault, extra)
            return
        status, etype, message, code = _FAULTS[wire][kind]
        if kind == "unknown_model":
            message = message.format(model=model)
        if kind == "key_rejected" and wire == "openai":
            message = message.format(masked=_masked(self.headers.get("authorization", "")))
        details = {"error_code": "enforced_spend_limit_reached"} if kind == "spend_cap" else None
        if wire == "anthropic" and details is not None:
            self._send_raw(
                status,
                {"type": "error", "error": {"type": etype, "message": message, "details": details}},
                extra,
            )
            return
        self._send_fault_body(wire, status, etype, message, code, extra)

    # -- wire helpers --------------------------------------------------------------------------

    def _send_fault_body(
        self, wire: Wire, status: int, etype: str, message: str, code: str | None, extra: Mapping[str, str]
    ) -> None:
        if wire == "anthropic":
            body: dict[str, Any] = {"type": "error", "error": {"type": etype, "message": message}}
        else:
            body = {"error": {"message": message, "type": etype, "param": None, "code": code}}
        self._send_raw(status, body, extra)

    def _send_raw(self, status: int, body: Any, headers: Mapping[str, str]) -> None:
        if body is None:
            payload, ctype = b"", None
        elif isinstance(body, str):
            payload, ctype = body.encode(), "text/html; charset=utf-8"
        else:
            payload, ctype = json.dumps(body).encode(), "application/json"
        self.send_response(status)
        if ctype:
            self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(payload)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    def _send_trickled(self, body: Any, slice_seconds: float) -> None:
        """A 200 whose headers come at once and whose body comes in slices, `slice_seconds` apart."""
        payload = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        size = -(-len(payload) // BODY_SLICES)
        for start in range(0, len(payload), size):
            if start and self.server.state.stopping.wait(slice_seconds):
                return
            try:
                self.wfile.write(payload[start : start + size])
                self.wfile.flush()
            except OSError:  # the client gave up
                self.close_connection = True
                return

    def _send_huge(self, fault: Fault, headers: Mapping[str, str]) -> None:
        """``fault.size`` bytes of JSON whitespace, written HUGE_CHUNK at a time until done or the client
        hangs up; the bytes that went out are recorded."""
        self.send_response(fault.status)
        self.send_header("content-type", "application/json")
        if fault.declare_length:
            self.send_header("content-length", str(fault.size))
        else:
            self.send_header("transfer-encoding", "chunked")
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        chunk = b" " * HUGE_CHUNK
        sent = 0
        try:
            while sent < fault.size and not self.server.state.stopping.is_set():
                part = chunk[: min(HUGE_CHUNK, fault.size - sent)]
                self.wfile.write(part if fault.declare_length else b"%x\r\n%s\r\n" % (len(part), part))
                sent += len(part)
            if not fault.declare_length:
                self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:  # the client stopped reading and closed the connection
            self.close_connection = True
        with self.server.state.lock:
            self.server.state.huge_sent.append(sent)

    def _send_json(self, status: int, body: Any) -> None:
        self._send_raw(status, body, {})

    def _read_body(self) -> bytes:
        length = int(self.headers.get("content-length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _redacted_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            lower = name.lower()
            if lower in _SECRET_HEADERS:
                scheme = value.split(" ", 1)[0] + " " if lower == "authorization" and " " in value else ""
                headers[lower] = scheme + REDACTED
            else:
                headers[lower] = value
        return headers


# (status, error.type, message, OpenAI code) per fault and wire, as the provider sends them.
_FAULTS: dict[Wire, dict[str, tuple[int, str, str, str | None]]] = {
    "anthropic": {
        "rate_limit": (
            429,
            "rate_limit_error",
            "This request would exceed the rate limit for your organization of 50 requests per minute.",
            None,
        ),
        "overloaded": (529, "overloaded_error", "Overloaded", None),
        "server_error": (500, "api_error", "Internal server error", None),
        "key_rejected": (401, "authentication_error", "invalid x-api-key", None),
        "unknown_model": (404, "not_found_error", "model: {model}", None),
        "quota": (
            400,
            "invalid_request_error",
            "Your credit balance is too low to access the Anthropic API. "
            "Please go to Plans & Billing to upgrade or purchase credits.",
            None,
        ),
        "spend_cap": (
            429,
            "rate_limit_error",
            "Your organization has reached its enforced spend limit.",
            None,
        ),
    },
    "openai": {
        "rate_limit": (
            429,
            "requests",
            "Rate limit reached for requests per min (RPM): Limit 3, Used 3, Requested 1.",
            "rate_limit_exceeded",
        ),
        "overloaded": (
            503,
            "server_error",
            "The server is overloaded, please try again later.",
            "server_is_overloaded",
        ),
        "server_error": (500, "server_error", "The server had an error while processing your request.", None),
        "key_rejected": (
            401,
            "invalid_request_error",
            "Incorrect API key provided: {masked}. You can find your API key at "
            "https://platform.openai.com/account/api-keys.",
            "invalid_api_key",
        ),
        "unknown_model": (
            404,
            "invalid_request_error",
            "The model `{model}` does not exist or you do not have access to it.",
            "model_not_found",
        ),
        "quota": (
            429,
            "insufficient_quota",
            "You exceeded your current quota, please check your plan and billing details.",
            "insufficient_quota",
        ),
        "spend_cap": (
            429,
            "invalid_request_error",
            "Your organization has reached its spend limit.",
            "organization_spend_limit_exceeded",
        ),
    },
}


def _masked(authorization: str) -> str:
    """How OpenAI echoes a rejected key: a few characters each end, the rest starred."""
    key = authorization.split(" ", 1)[-1]
    return key[:3] + "*" * max(0, len(key) - 7) + key[-4:] if len(key) > 10 else "***"


WOKEN_BY = "You were woken by: "
ASK_CHARS = 80


def asked(body: Mapping[str, Any]) -> str:
    """What the request asks: the line that woke the agent (our prompt's last line) when there is
    one, else the last user message's last line; cut at a word, never mid-word or mid-id."""
    last_user = ""
    for message in body.get("messages") or []:
        if isinstance(message, dict) and message.get("role") == "user":
            last_user = _content_text(message.get("content"))
    lines = [line.strip() for line in last_user.splitlines() if line.strip()]
    woken = [line.removeprefix(WOKEN_BY) for line in lines if line.startswith(WOKEN_BY)]
    text = (woken or lines or ["(nothing)"])[-1]
    if len(text) <= ASK_CHARS:
        return text
    cut = text[:ASK_CHARS].rsplit(" ", 1)[0].rstrip(" ,.;:")
    return f"{cut} ..."


def _default_text(wire: Wire, body: Mapping[str, Any]) -> str:
    """A short, deterministic answer that names what it was asked, as an agent would reply."""
    return f'Noted, you asked "{asked(body)}"; I will take it from here and report back in this room.'


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


def _reply_body(wire: Wire, reply: ScriptedReply, model: str, request: Mapping[str, Any], number: int) -> Any:
    prompt_chars = sum(
        len(_content_text(m.get("content"))) for m in request.get("messages") or [] if isinstance(m, dict)
    )
    input_tokens = prompt_chars // 4 + 1
    output_tokens = len(reply.text) // 4 + 1
    if wire == "anthropic":
        content: list[dict[str, Any]] = []
        if reply.text:
            content.append({"type": "text", "text": reply.text})
        for i, call in enumerate(reply.tool_calls):
            content.append(
                {
                    "type": "tool_use",
                    "id": call.get("id", f"toolu_standin_{number}_{i}"),
                    "name": call["name"],
                    "input": call.get("arguments", {}),
                }
            )
        return {
            "id": f"msg_standin_{number}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": "tool_use" if reply.tool_calls else "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
        }
    message: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.get("id", f"call_standin_{number}_{i}"),
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": (
                        call["arguments"]
                        if isinstance(call.get("arguments"), str)
                        else json.dumps(call.get("arguments", {}))
                    ),
                },
            }
            for i, call in enumerate(reply.tool_calls)
        ]
    return {
        "id": f"chatcmpl-standin-{number}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if reply.tool_calls else "stop"}],
        "usage": {
            "prompt_tokens": input_tokens,
            "completion_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stand-in model provider (Anthropic + OpenAI wire formats).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    done = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    standin = StandinProvider(args.host, args.port)
    url = standin.start()
    print(f"STANDIN_URL={url}", flush=True)
    try:
        while not done.wait(0.5):
            pass
    finally:
        standin.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
