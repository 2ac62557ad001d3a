"""What every console page shares: rendering with the session's facts, form fields, Gateway errors in
words, times and durations as people read them."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response
from starlette.templating import Jinja2Templates

from services.console.session import SignInRefused, csrf_token
from services.gateway.oidc import issuer_host

# Most items one page lists (the Gateway pages further; the console shows the newest).
PAGE = 50
MAX_FIELD_CHARS = 20_000
# Gateway failures after which a write may or may not have happened: its form keeps its idempotency key.
UNSURE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN)

# What each gRPC status means to a person, and the HTTP status the page answers with.
_WORDS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.NOT_FOUND: (404, "Not found, or not visible to your company."),
    grpc.StatusCode.PERMISSION_DENIED: (403, "Your company may not do that."),
    grpc.StatusCode.UNAVAILABLE: (503, "The Gateway cannot be reached right now. Try again in a moment."),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "The Gateway took too long to answer. Try again in a moment."),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "Too many requests just now. Wait a moment and try again."),
}
# The title of an error page, by its HTTP status.
TITLES = {
    400: "That cannot be done",
    403: "Not allowed",
    404: "Not found",
    408: "Too slow",
    413: "Too large",
    429: "Too many requests",
    503: "The Gateway is unavailable",
    504: "The Gateway is slow",
}


class FormError(Exception):
    """A form's input cannot be used; the message says what to fix."""


def words(exc: grpc.aio.AioRpcError) -> tuple[int, str]:
    """The HTTP status and the sentence a person reads for a failed Gateway call."""
    code = exc.code()
    if code in _WORDS:
        status, text = _WORDS[code]
        if (
            code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED)
            and exc.details()
        ):
            text = f"{text} ({exc.details()})"
        return status, text
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
        return 400, exc.details() or "The Gateway refused that request."
    return 502, "The Gateway could not do that just now."


# -- times ---------------------------------------------------------------------------------------------


def when(ts: Timestamp) -> str:
    if not ts.seconds and not ts.nanos:
        return ""
    return datetime.fromtimestamp(ts.seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(ms: float) -> str:
    """A duration as people say it: 0 ms, 840 ms, 1.2 s, 12 s, 3 min 5 s, 2 h 10 min."""
    ms = max(0.0, ms)
    if ms < 1000:
        return f"{ms:.0f} ms"
    seconds = ms / 1000
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


# -- forms ---------------------------------------------------------------------------------------------


def field(form: FormData, name: str, what: str, *, required: bool = True, limit: int = MAX_FIELD_CHARS) -> str:
    value = form.get(name)
    text = value.strip() if isinstance(value, str) else ""
    if required and not text:
        raise FormError(f"{what} is required.")
    if len(text) > limit:
        raise FormError(f"{what} is too long (at most {limit} characters).")
    return text


def typed(form: FormData | None, *names: str) -> dict[str, str]:
    """What was typed into ``names`` of a form, as sent (to give a failed form back as it was)."""
    if form is None:
        return {}
    return {n: v for n in names if isinstance(v := form.get(n), str)}


class Refusal:
    """``with refusal:`` around what a form asks for: a FormError, a refused key confirmation or a
    Gateway refusal is kept as the sentence the page shows (``text``, and the Gateway's ``code``),
    not raised. (An ended sign-in is SignedOut, never an AioRpcError here: it still goes to sign-in.)"""

    def __init__(self) -> None:
        self.text = ""
        self.code: grpc.StatusCode | None = None

    def __enter__(self) -> Refusal:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, FormError):
            self.text = str(exc)
        elif isinstance(exc, SignInRefused):
            self.text = exc.text
        elif isinstance(exc, grpc.aio.AioRpcError):
            self.text, self.code = words(exc)[1], exc.code()
        else:
            return False
        return True


def remember_person(request: Request, person: str) -> None:
    if not request.session.get("verified_by"):  # a verified person's name is the provider's, never typed
        request.session["person"] = person


# -- pages ---------------------------------------------------------------------------------------------


def page(request: Request, name: str, context: Mapping[str, Any], status: int = 200) -> Response:
    base = {
        "csrf": csrf_token(request),
        "company_name": request.session.get("company_name", ""),
        "company_id": request.session.get("company_id", ""),
        "person": request.session.get("person", ""),
        # The provider that verified the signed-in person ("" for an API-key sign-in: names are typed).
        "verified_by": issuer_host(verified) if (verified := request.session.get("verified_by")) else "",
        "signed_in": "key" in request.session,
        "path": request.url.path,
    }
    templates: Jinja2Templates = request.app.state.templates
    return templates.TemplateResponse(request, name, {**base, **context}, status_code=status)


def error_page(request: Request, status: int, text: str) -> Response:
    title = TITLES.get(status, "Something went wrong")
    return page(request, "error.html", {"title": title, "message": text}, status)


def no_store(response: Response) -> Response:
    """A page that shows a secret once: never kept by the browser or a proxy."""
    response.headers["Cache-Control"] = "no-store"
    return response
