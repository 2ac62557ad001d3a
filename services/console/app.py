"""The room console: server-rendered pages over the Gateway, as the signed-in company.

It keeps no state of its own beyond counters. The session cookie (signed, HttpOnly, SameSite=Lax,
Secure unless configured off for plain-http development) holds the sign-in's session key (a
short-lived key the Gateway made from the company's API key, ended at sign-out: session.py)
encrypted with a key derived from the session secret, the CSRF token every form carries, and the
person's name last used. Every page is one or a few Gateway calls with that key, so a company sees
exactly what the Gateway shows it. Live updates come from the Gateway's WatchRoom and WatchRooms
streams, relayed to the page as Server-Sent Events (live.py).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import uvicorn
from cryptography.fernet import Fernet
from google.protobuf.timestamp_pb2 import Timestamp
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quayutec.config import ConfigError
from quayutec.httpserve import HttpLimits, server_config
from quayutec.throttle import AuthThrottle
from quayutec.v1 import common_pb2, gateway_pb2
from services.client import ACTION_NAMES, OUTCOME_NAMES, STATUS_NAMES
from services.console.config import ConsoleConfig
from services.console.live import (
    StreamSlots,
    approval_events,
    encode_cursors,
    first_cursor,
    first_cursors,
    room_events,
)
from services.console.session import (
    MAX_MENTIONS,
    SIGNIN_SETTINGS,
    Session,
    SignedOut,
    SignInRefused,
    csrf_token,
    form_of,
    sign_in,
    sign_out,
)

_log = logging.getLogger("quayutec.console")
HERE = Path(__file__).resolve().parent
COOKIE = "quayutec_console"
# Most items one page lists (the Gateway pages further; the console shows the newest).
PAGE = 50
MAX_FIELD_CHARS = 20_000
DECISIONS = {
    common_pb2.DECISION_PENDING: "pending",
    common_pb2.DECISION_APPROVED: "approved",
    common_pb2.DECISION_DENIED: "denied",
}
ENDED = {common_pb2.RUN_STATUS_SUCCEEDED, common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STATUS_TIMED_OUT}

# What each gRPC status means to a person, and the HTTP status the page answers with.
_WORDS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.NOT_FOUND: (404, "Not found, or not visible to your company."),
    grpc.StatusCode.PERMISSION_DENIED: (403, "Your company may not do that."),
    grpc.StatusCode.UNAVAILABLE: (503, "The Gateway cannot be reached right now. Try again in a moment."),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "The Gateway took too long to answer. Try again in a moment."),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "Too many requests just now. Wait a moment and try again."),
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


# -- formatting -------------------------------------------------------------------------------------


def when(ts: Timestamp) -> str:
    if not ts.seconds and not ts.nanos:
        return ""
    return datetime.fromtimestamp(ts.seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def author(a: common_pb2.Author) -> str:
    if a.kind == common_pb2.AUTHOR_KIND_AGENT:
        return f"agent {a.agent_id[:8]}"
    return f"{a.person or 'someone'} ({a.company_id[:8]})"


def pretty_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


def timeline(run: common_pb2.Run) -> list[dict[str, str]]:
    """A run's ledger as the steps a person follows: what happened, in order, with its outcome."""
    items: list[dict[str, str]] = [{"what": "claimed", "detail": f"wake {run.wake_id}", "at": when(run.started_at)}]
    if run.step >= common_pb2.RUN_STEP_ROOM_READ:
        items.append({"what": "room read", "detail": ""})
    for attempt in run.model_attempts:
        parts = [str(attempt.status_code) if attempt.status_code else "no answer"]
        ok = 200 <= attempt.status_code < 300 and attempt.error_class in ("", "ok")
        if not ok and attempt.error_class:
            parts.append(attempt.error_class)
        if attempt.duration_ms:
            parts.append(f"took {attempt.duration_ms} ms")
        if attempt.wait_seconds:
            parts.append(f"waited {attempt.wait_seconds:g} s before the next")
        if attempt.detail and not ok:
            parts.append(attempt.detail)
        items.append(
            {"what": f"model request {attempt.number}", "detail": ", ".join(parts), "state": "" if ok else "bad"}
        )
    if run.step >= common_pb2.RUN_STEP_ACTIONS_DECIDED or run.actions:
        items.append({"what": "decided", "detail": f"{len(run.actions)} action(s)"})
    if run.posted_message_id:
        items.append({"what": "reply posted", "detail": f"message {run.posted_message_id}"})
    for action in run.actions:
        outcome = OUTCOME_NAMES[action.outcome]
        detail = outcome + (f" -> {action.result_id}" if action.result_id else "")
        if action.detail:
            detail += f" ({action.detail})"
        state = {"denied": "bad", "failed": "bad", "not_done": "bad", "held": "wait", "pending": "wait"}.get(
            outcome, ""
        )
        items.append({"what": f"action #{action.index} {ACTION_NAMES[action.kind]}", "detail": detail, "state": state})
    if run.status == common_pb2.RUN_STATUS_PARKED:
        items.append(
            {"what": "parked", "detail": "waiting for your company's decision on held actions", "state": "wait"}
        )
    if run.status in ENDED:
        items.append(
            {
                "what": "ended",
                "detail": STATUS_NAMES[run.status],
                "at": when(run.ended_at),
                "state": "" if run.status == common_pb2.RUN_STATUS_SUCCEEDED else "bad",
            }
        )
    return items


# -- the session --------------------------------------------------------------------------------------


def field(form: FormData, name: str, what: str, *, required: bool = True, limit: int = MAX_FIELD_CHARS) -> str:
    value = form.get(name)
    text = value.strip() if isinstance(value, str) else ""
    if required and not text:
        raise FormError(f"{what} is required.")
    if len(text) > limit:
        raise FormError(f"{what} is too long (at most {limit} characters).")
    return text


def mentions(form: FormData) -> list[str]:
    """The agents a message wakes: the ticked ones of the company and any ids typed in."""
    ticked = [v.strip() for v in form.getlist("mention") if isinstance(v, str) and v.strip()]
    typed = field(form, "mention_other", "The other agents", required=False, limit=2000)
    found = list(dict.fromkeys([*ticked, *typed.replace(",", " ").split()]))
    if len(found) > MAX_MENTIONS or any(len(x) > 64 for x in found):
        raise FormError(f"Mention at most {MAX_MENTIONS} agents, by their ids.")
    return found


def remember_person(request: Request, person: str) -> None:
    request.session["person"] = person


def page(request: Request, name: str, context: Mapping[str, Any], status: int = 200) -> Response:
    base = {
        "csrf": csrf_token(request),
        "company_name": request.session.get("company_name", ""),
        "company_id": request.session.get("company_id", ""),
        "person": request.session.get("person", ""),
        "signed_in": "key" in request.session,
    }
    templates: Jinja2Templates = request.app.state.templates
    return templates.TemplateResponse(request, name, {**base, **context}, status_code=status)


def error_page(request: Request, status: int, text: str) -> Response:
    return page(request, "error.html", {"title": "Something went wrong", "message": text}, status)


# -- pages --------------------------------------------------------------------------------------------


async def home(request: Request) -> Response:
    return RedirectResponse("/rooms", 303)


async def signin_form(request: Request) -> Response:
    return page(request, "signin.html", {"title": "Sign in"})


async def signin(request: Request) -> Response:
    form = await form_of(request)
    key = field(form, "api_key", "The API key", limit=512) if form.get("api_key") else ""
    if not key:
        return page(request, "signin.html", {"title": "Sign in", "error": "Enter your company's API key."}, 400)
    try:
        await sign_in(request, key)
    except SignInRefused as refused:
        answer = page(request, "signin.html", {"title": "Sign in", "error": refused.text}, refused.status)
        if refused.retry_after_seconds is not None:
            answer.headers["Retry-After"] = str(max(1, refused.retry_after_seconds))
        return answer
    except grpc.aio.AioRpcError as exc:
        status, text = words(exc)
        return page(request, "signin.html", {"title": "Sign in", "error": text}, status)
    return RedirectResponse("/rooms", 303)


async def signout(request: Request) -> Response:
    await form_of(request)
    if await sign_out(request):
        return RedirectResponse("/signin", 303)
    text = (
        "You are signed out here, but the Gateway could not be reached to end this sign-in everywhere; it "
        "ends when it expires. Tell your administrator if this device is not yours."
    )
    return page(request, "signin.html", {"title": "Sign in", "error": text}, 503)


async def rooms(request: Request) -> Response:
    s = Session(request)
    notice = ""
    if request.method == "POST":
        form = await form_of(request)
        invitation = field(form, "invitation_id", "The invitation", limit=64)
        if form.get("answer") == "accept":
            got = await s.call("AcceptInvitation", gateway_pb2.AcceptInvitationRequest(invitation_id=invitation))
            notice = f"You joined {got.invitation.room_name}."
        else:
            got = await s.call("DeclineInvitation", gateway_pb2.DeclineInvitationRequest(invitation_id=invitation))
            notice = f"You declined the invitation to {got.invitation.room_name}."
    listed = await s.call("ListRooms", gateway_pb2.ListRoomsRequest(page_size=PAGE))
    invited = await s.call(
        "ListInvitations",
        gateway_pb2.ListInvitationsRequest(status=common_pb2.INVITATION_STATUS_PENDING, page_size=PAGE),
    )
    return page(
        request,
        "rooms.html",
        {"title": "Rooms", "rooms": listed.rooms, "invitations": invited.invitations, "notice": notice},
    )


async def room(request: Request) -> Response:
    s = Session(request)
    room_id = request.path_params["room_id"]
    notice = error = ""
    if request.method == "POST":
        form = await form_of(request)
        try:
            person = field(form, "person", "Your name", limit=200)
            remember_person(request, person)
            key = field(form, "idem", "The form's key", limit=64)
            if form.get("what") == "task":
                sent = await s.call(
                    "SendTask",
                    gateway_pb2.SendTaskRequest(
                        room_id=room_id,
                        person=person,
                        to_agent_id=field(form, "to_agent_id", "The agent", limit=64),
                        title=field(form, "title", "The title", limit=500),
                        body=field(form, "body", "The task", required=False),
                        idempotency_key=key,
                    ),
                )
                notice = f"Task “{sent.task.title}” sent."
            else:
                await s.call(
                    "PostMessage",
                    gateway_pb2.PostMessageRequest(
                        room_id=room_id,
                        person=person,
                        body=field(form, "body", "The message"),
                        mention_agent_ids=mentions(form),
                        idempotency_key=key,
                    ),
                )
                return RedirectResponse(f"/rooms/{room_id}", 303)
        except FormError as exc:
            error = str(exc)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise
            error = words(exc)[1]
    cursor = await first_cursor(s, room_id)
    messages, tasks, memory, files, agents, listed = await asyncio.gather(
        s.call("ListMessages", gateway_pb2.ListMessagesRequest(room_id=room_id, page_size=PAGE, newest_first=True)),
        s.call(
            "ListTasks",
            gateway_pb2.ListTasksRequest(room_id=room_id, status=common_pb2.TASK_STATUS_OPEN, page_size=PAGE),
        ),
        s.call("ListMemory", gateway_pb2.ListMemoryRequest(room_id=room_id, page_size=PAGE)),
        s.call("ListFiles", gateway_pb2.ListFilesRequest(room_id=room_id, page_size=PAGE)),
        s.call("ListAgents", gateway_pb2.ListAgentsRequest(page_size=PAGE)),
        s.call("ListRooms", gateway_pb2.ListRoomsRequest(page_size=PAGE)),
    )
    name = next((r.name for r in listed.rooms if r.room_id == room_id), room_id)
    return page(
        request,
        "room.html",
        {
            "title": name,
            "room_id": room_id,
            "cursor": cursor,
            "messages": list(reversed(messages.messages)),
            "tasks": tasks.tasks,
            "memory": memory.lines,
            "files": files.files,
            "agents": agents.agents,
            "idem": str(uuid.uuid4()),
            "notice": notice,
            "error": error,
        },
        400 if error else 200,
    )


def _room_names(listed: Any) -> dict[str, str]:
    return {r.room_id: r.name for r in listed.rooms}


async def approvals(request: Request) -> Response:
    s = Session(request)
    notice = error = ""
    if request.method == "POST":
        form = await form_of(request)
        try:
            person = field(form, "person", "Your name", limit=200)
            remember_person(request, person)
            index = field(form, "index", "The action", limit=10)
            if not index.isdigit():
                raise FormError("The action number is not valid.")
            approve = form.get("decision") == "approve"
            got = await s.call(
                "DecideApproval",
                gateway_pb2.DecideApprovalRequest(
                    token=field(form, "token", "The approval", limit=200),
                    index=int(index),
                    person=person,
                    approve=approve,
                ),
            )
            verb = "Approved" if approve else "Denied"
            notice = f"{verb} action #{index}." + (" The run continues." if got.completed else "")
            if got.already_decided:
                notice = f"Action #{index} was already decided that way."
        except FormError as exc:
            error = str(exc)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise
            error = words(exc)[1]
    part = request.query_params.get("part") == "list"
    # The rooms' cursors first, then the lists: the live stream resumes after these cursors, so a run
    # parked between this read and the page's subscription is replayed to it, never lost.
    cursors = None if part else await first_cursors(s)
    pending, listed = await asyncio.gather(
        s.call(
            "ListApprovals",
            gateway_pb2.ListApprovalsRequest(status=common_pb2.WAITPOINT_STATUS_PENDING, page_size=PAGE),
        ),
        s.call("ListRooms", gateway_pb2.ListRoomsRequest(page_size=PAGE)),
    )
    context = {
        "events": f"/approvals/events?after={encode_cursors(cursors)}" if cursors is not None else "",
        "title": "Approvals",
        "waitpoints": pending.waitpoints,
        "room_names": _room_names(listed),
        "decisions": DECISIONS,
        "actions": ACTION_NAMES,
        "pretty": pretty_json,
        "notice": notice,
        "error": error,
    }
    name = "approvals_list.html" if part else "approvals.html"
    return page(request, name, context, 400 if error else 200)


async def runs(request: Request) -> Response:
    s = Session(request)
    listed = await s.call("ListRuns", gateway_pb2.ListRunsRequest(page_size=PAGE))
    return page(request, "runs.html", {"title": "Runs", "runs": listed.runs, "status_names": STATUS_NAMES})


async def run(request: Request) -> Response:
    s = Session(request)
    got = await s.call("GetRun", gateway_pb2.GetRunRequest(run_id=request.path_params["run_id"]))
    cursor = None
    if got.run.status not in ENDED:
        # Read again after taking the room's cursor: a change after this read reaches the page live.
        cursor = await first_cursor(s, got.run.room_id)
        got = await s.call("GetRun", gateway_pb2.GetRunRequest(run_id=request.path_params["run_id"]))
    r: common_pb2.Run = got.run
    jaeger = request.app.state.config.jaeger_url
    return page(
        request,
        "run.html",
        {
            "title": f"Run {r.run_id[:8]}",
            "run": r,
            "status": STATUS_NAMES[r.status],
            "ended": r.status in ENDED,
            "timeline": timeline(r),
            "trace_url": f"{jaeger}/trace/{r.trace_id}" if r.trace_id else "",
            "cursor": cursor,
        },
    )


# -- errors, headers, wiring ----------------------------------------------------------------------


async def on_signed_out(request: Request, exc: Exception) -> Response:
    if request.url.path.endswith("/events"):
        return Response("signed out", status_code=401, media_type="text/plain")
    return RedirectResponse("/signin", 303)


async def on_rpc_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, grpc.aio.AioRpcError)
    status, text = words(exc)
    return error_page(request, status, text)


async def on_form_error(request: Request, exc: Exception) -> Response:
    return error_page(request, 400, str(exc))


async def on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    text = exc.detail if exc.status_code != 404 else "There is no such page."
    return error_page(request, exc.status_code, text)


async def on_error(request: Request, exc: Exception) -> Response:
    _log.exception("console page %s failed", request.url.path)
    return HTMLResponse(
        "<!doctype html><title>Error</title><p>Something went wrong on our side. Try again; if it keeps "
        "happening, tell your administrator.</p>",
        status_code=500,
    )


CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)


class SecurityHeaders:
    """Adds the headers every page carries (CSP without inline script, no framing, no sniffing)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"content-security-policy", CSP.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"x-frame-options", b"DENY"),
                    (b"referrer-policy", b"same-origin"),
                ]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)


def session_box(secret: str) -> Fernet:
    """The Fernet key sealing the API key inside the (signed, not encrypted) session cookie."""
    digest = hashlib.sha256(b"quayutec console api key\0" + secret.encode()).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


def gateway_channel(config: ConsoleConfig) -> grpc.aio.Channel:
    """The console's one channel to the Gateway's public port: plaintext, or TLS when configured."""
    if config.gateway_ca is None:
        return grpc.aio.insecure_channel(config.gateway_addr)
    credentials = grpc.ssl_channel_credentials(root_certificates=config.gateway_ca or None)
    options = [("grpc.ssl_target_name_override", config.gateway_tls_name)] if config.gateway_tls_name else []
    return grpc.aio.secure_channel(config.gateway_addr, credentials, options=options)


async def healthz(request: Request) -> Response:
    """For probes: the process serves (it keeps no state; the Gateway's health is the Gateway's)."""
    return Response("ok\n", media_type="text/plain")


def create_app(config: ConsoleConfig, *, channel: grpc.aio.Channel | None = None) -> Starlette:
    """The console app; it opens its Gateway channel at start-up (or uses ``channel``)."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        own = channel is None
        app.state.channel = channel or gateway_channel(config)
        try:
            yield
        finally:
            if own:
                await app.state.channel.close()

    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.filters["when"] = when
    templates.env.filters["author"] = author
    templates.env.globals["actions"] = ACTION_NAMES

    routes = [
        Route("/", home),
        Route("/healthz", healthz),
        Route("/signin", signin_form, methods=["GET"]),
        Route("/signin", signin, methods=["POST"]),
        Route("/signout", signout, methods=["POST"]),
        Route("/rooms", rooms, methods=["GET", "POST"]),
        Route("/rooms/{room_id}", room, methods=["GET", "POST"]),
        Route("/rooms/{room_id}/events", room_events),
        Route("/approvals", approvals, methods=["GET", "POST"]),
        Route("/approvals/events", approval_events),
        Route("/runs", runs),
        Route("/runs/{run_id}", run),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(SecurityHeaders),
            Middleware(
                SessionMiddleware,
                secret_key=config.session_secret,
                session_cookie=COOKIE,
                max_age=config.session_seconds,
                same_site="lax",
                https_only=config.secure_cookie,
            ),
        ],
        exception_handlers={
            SignedOut: on_signed_out,
            grpc.aio.AioRpcError: on_rpc_error,
            FormError: on_form_error,
            HTTPException: on_http_error,
            Exception: on_error,
        },
        lifespan=lifespan,
    )
    app.state.config = config
    app.state.templates = templates
    app.state.box = session_box(config.session_secret)
    app.state.stream_slots = StreamSlots(config.max_streams_per_session)
    app.state.signin_throttle = AuthThrottle(config.signin_throttle, _log, what="sign-ins", settings=SIGNIN_SETTINGS)
    return app


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = ConsoleConfig.from_env()
        host, port = config.host_port
        limits = HttpLimits.from_env()
    except ConfigError as exc:
        print(f"console: {exc}", flush=True)
        return 2
    app = create_app(config)
    server = uvicorn.Server(
        # Slow or silent clients are cut and bodies bounded (quayutec.httpserve).
        server_config(
            app,
            host=host,
            port=port,
            limits=limits,
            log_level="info",
            proxy_headers=False,
            server_header=False,
            # Open event streams would hold a graceful stop forever: they are cut after this long.
            timeout_graceful_shutdown=5,
        )
    )
    server.run()
    return 0
