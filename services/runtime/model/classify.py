"""Which provider answers are worth another request, per provider-errors.md.

Classify by status AND body; the final rows are checked before the generic 429 row. Retryable is
an allow-list: anything not named here as retryable is final.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, Literal

import httpx

Wire = Literal["anthropic", "openai"]

_DETAIL_MAX = 160
_SK_TOKEN = re.compile(r"sk-[A-Za-z0-9_\-\*\.]{3,}")

_OPENAI_SPEND_CODES = frozenset(
    {
        "organization_usage_limit_exceeded",
        "organization_spend_limit_exceeded",
        "project_spend_limit_exceeded",
    }
)


@dataclass(frozen=True)
class Verdict:
    """What one answer (or failure to answer) means for the retry loop."""

    error_class: str
    retryable: bool
    named_wait: float | None
    detail: str


def sanitize(text: str, secret: str) -> str:
    """Short, single-line, and without the key (nor anything shaped like a provider key)."""
    if secret:
        text = text.replace(secret, "[redacted]")
    text = _SK_TOKEN.sub("sk-[redacted]", text)
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_MAX else text[: _DETAIL_MAX - 1] + "…"


def classify_exception(exc: Exception, secret: str) -> Verdict:
    """No response at all: timeouts and dropped or refused connections are retryable."""
    name = type(exc).__name__
    detail = sanitize(f"{name}: {exc}", secret)
    if isinstance(exc, httpx.TimeoutException):
        return Verdict("timeout", True, None, detail)
    if isinstance(exc, (httpx.NetworkError, httpx.RemoteProtocolError)):
        return Verdict("connection", True, None, detail)
    if isinstance(exc, httpx.TransportError):
        # Local protocol errors, unsupported schemes, proxies: another try would not help.
        return Verdict("transport", False, None, detail)
    return Verdict("bad_target", False, None, detail)


def classify_response(
    wire: Wire,
    status: int,
    headers: Mapping[str, str] | httpx.Headers,
    body: bytes,
    secret: str,
    *,
    now: datetime | None = None,
) -> Verdict:
    """Classify a non-success HTTP answer from `wire`'s protocol."""
    h = httpx.Headers(headers)
    error = _error_object(wire, body)
    if wire == "anthropic":
        error_class, retryable = _anthropic(status, error)
        named = _seconds(h.get("retry-after"), now) if retryable else None
    else:
        error_class, retryable = _openai(status, error)
        named = _openai_wait(h, now) if retryable else None
    if retryable and h.get("x-should-retry", "").strip().lower() == "false":
        retryable = False
        named = None
    return Verdict(error_class, retryable, named, _detail(status, error, error_class, secret))


def _anthropic(status: int, error: Mapping[str, Any]) -> tuple[str, bool]:
    message = str(error.get("message") or "").lower()
    if status == 400:
        if "credit balance is too low" in message:
            return "credit", False
        if "usage limits" in message:
            return "spend_limit", False
        return "malformed", False
    if status == 401:
        return "key_rejected", False
    if status == 402:
        return "billing", False
    if status == 403:
        return "permission", False
    if status == 404:
        return ("unknown_model" if "model" in message else "not_found"), False
    if status == 413:
        return "too_large", False
    if status == 429:
        details = error.get("details")
        if isinstance(details, dict) and details.get("error_code") == "enforced_spend_limit_reached":
            return "spend_limit", False
        return "rate_limited", True
    if status == 529:
        return "overloaded", True
    if 500 <= status <= 599:
        return "server_error", True
    return "unexpected_status", False


def _openai(status: int, error: Mapping[str, Any]) -> tuple[str, bool]:
    kind = str(error.get("type") or "")
    code = str(error.get("code") or "")
    names = {kind, code}
    message = str(error.get("message") or "")
    if status == 400:
        return "malformed", False
    if status == 401:
        return "key_rejected", False
    if status == 403:
        return "permission", False
    if status == 404:
        return "unknown_model", False
    if status == 413:
        return "too_large", False
    if status == 422:
        return "malformed", False
    if status == 429:
        if "credit_balance_exhausted" in names:
            return "credit", False
        if names & _OPENAI_SPEND_CODES:
            return "spend_limit", False
        if "insufficient_quota" in names:
            return "quota", False
        if "Request too large for" in message:
            return "too_large", False
        return "rate_limited", True
    if status == 408:
        return "timeout", True
    if status == 409:
        return "conflict", True
    if 500 <= status <= 599:
        overloaded = "server_is_overloaded" in names or "overloaded" in message.lower()
        return ("overloaded" if overloaded else "server_error"), True
    return "unexpected_status", False


def _error_object(wire: Wire, body: bytes) -> Mapping[str, Any]:
    """The provider's `error` object when the body has the provider's error shape; empty otherwise.

    Only a provider-shaped error informs the class and the recorded detail: any other body (an
    internal page, a proxy's answer) is never read further nor passed on."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    if not isinstance(parsed, dict):
        return {}
    error = parsed.get("error")
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return {}
    if wire == "anthropic":
        # {"type": "error", "error": {"type": ..., "message": ...}}
        shaped = parsed.get("type") == "error" and isinstance(error.get("type"), str)
    else:
        # {"error": {"message", "type", "param", "code"}}; type and code may be null
        shaped = "type" in error and all(
            error.get(k) is None or isinstance(error.get(k), str) for k in ("type", "code")
        )
    return error if shaped else {}


def _openai_wait(headers: httpx.Headers, now: datetime | None) -> float | None:
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if value >= 0:
            return value / 1000.0
    return _seconds(headers.get("retry-after"), now)


def _seconds(value: str | None, now: datetime | None) -> float | None:
    """`retry-after` as seconds or as an HTTP date (either provider may send one; RFC 9110).
    Unreadable: no wait named."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        current = now or datetime.now(UTC)
        return max(0.0, (when - current).total_seconds())
    return seconds if seconds >= 0 and seconds == seconds else None


def _detail(status: int, error: Mapping[str, Any], error_class: str, secret: str) -> str:
    parts = [str(status), error_class]
    for key in ("type", "code"):
        value = error.get(key)
        if isinstance(value, str) and value and value not in parts:
            parts.append(value)
    text = " ".join(parts)
    message = error.get("message")
    # A rejected-key message echoes part of the key: leave it out altogether.
    if isinstance(message, str) and message and error_class != "key_rejected":
        text += ": " + message
    return sanitize(text, secret)
