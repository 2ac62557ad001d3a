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

import base64
import errno
import hashlib
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import uvicorn
from cryptography.fernet import Fernet
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quayutec.channels import internal_channel
from quayutec.config import GATEWAY, ConfigError
from quayutec.httpserve import HttpLimits, server_config
from quayutec.server import PORT_IN_USE_EXIT, port_in_use
from quayutec.throttle import AuthThrottle
from services.client import ACTION_NAMES, STATUS_NAMES
from services.console import company, oidc, rooms, runs
from services.console.config import ConsoleConfig
from services.console.forward import BrowserAddress, ForwardBrowser
from services.console.live import StreamSlots, approval_events, room_events
from services.console.names import vouched
from services.console.session import SIGNIN_SETTINGS, SignedOut, SignInRefused, form_of, sign_in, sign_out
from services.console.timeline import arguments, error_class, shown, summary
from services.console.web import FormError, duration, error_page, field, page, when, words

_log = logging.getLogger("quayutec.console")
HERE = Path(__file__).resolve().parent
COOKIE = "quayutec_console"
FAVICON = (HERE / "static" / "favicon.ico").read_bytes()


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
    text = exc.detail if exc.status_code != 404 else f"There is no page at {request.url.path[:200]}."
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
    """The console's one channel to the Gateway: its console port as the console identity, passing on
    each browser's address (services/console/forward.py), when configured; else its public port,
    plaintext or TLS."""
    if config.gateway_console_addr and config.identity is not None:
        return internal_channel(
            config.gateway_console_addr,
            identity=config.identity,
            server=GATEWAY.name,
            retry_unavailable=False,  # a post must not be sent twice
            interceptors=[ForwardBrowser()],
        )
    if config.gateway_ca is None:
        return grpc.aio.insecure_channel(config.gateway_addr)
    credentials = grpc.ssl_channel_credentials(root_certificates=config.gateway_ca or None)
    options = [("grpc.ssl_target_name_override", config.gateway_tls_name)] if config.gateway_tls_name else []
    return grpc.aio.secure_channel(config.gateway_addr, credentials, options=options)


async def favicon(request: Request) -> Response:
    return Response(FAVICON, media_type="image/x-icon", headers={"Cache-Control": "public, max-age=86400"})


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
    templates.env.globals.update(
        actions=ACTION_NAMES,
        status_names=STATUS_NAMES,
        duration=duration,
        arguments=arguments,
        shown=shown,
        error_class=error_class,
        summary=summary,
        vouched=vouched,
    )

    routes = [
        Route("/", home),
        Route("/healthz", healthz),
        Route("/signin", signin_form, methods=["GET"]),
        Route("/signin", signin, methods=["POST"]),
        Route("/signin/provider", oidc.signin_provider, methods=["POST"]),
        Route("/signin/callback", oidc.signin_callback, methods=["GET"], name="signin_callback"),
        Route("/signout", signout, methods=["POST"]),
        Route("/favicon.ico", favicon),
        Route("/rooms", rooms.rooms, methods=["GET", "POST"]),
        Route("/rooms/{room_id}", rooms.room, methods=["GET", "POST"]),
        Route("/rooms/{room_id}/events", room_events),
        Route("/rooms/{room_id}/messages/{message_id}", rooms.message),
        Route("/approvals", runs.approvals, methods=["GET", "POST"]),
        Route("/approvals/events", approval_events),
        Route("/runs", runs.runs),
        Route("/runs/{run_id}", runs.run),
        Route("/agents", company.agents, methods=["GET", "POST"]),
        Route("/rights", company.rights, methods=["GET", "POST"]),
        Route("/keys", company.keys, methods=["GET", "POST"]),
        Route("/invitations", company.invitations, methods=["GET", "POST"]),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(BrowserAddress),
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
    try:
        sock = listening_socket(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            print(f"console: {port_in_use(config.listen, 'QUAYUTEC_CONSOLE_LISTEN')}", flush=True)
            return PORT_IN_USE_EXIT
        print(f"console: cannot listen on {config.listen} (QUAYUTEC_CONSOLE_LISTEN): {exc.strerror}", flush=True)
        return 2
    server.run(sockets=[sock])
    return 0


def listening_socket(host: str, port: int) -> socket.socket:
    """The console's socket, bound alone as our gRPC servers bind theirs (no ``SO_REUSEPORT``): a port
    in use is refused (EADDRINUSE), never shared."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
    except BaseException:
        sock.close()
        raise
    return sock
