"""Console sign-in, sessions and forms: revocable sessions, a throttle on failed sign-ins, CSRF and Origin.

A sign-in does not keep the company's API key. It asks the Gateway for a *session key*
(CreateSessionKey: a key of the company that expires with the sign-in and is revoked with the
company key) and keeps only that, encrypted, in the signed cookie. Signing out ends the session key
at the Gateway (EndSession), so the sign-in ends on every console and Gateway replica at once: a
cookie copied before sign-out is refused afterwards for pages, posting and live updates (the
Gateway ends the key's open streams within seconds).

Failed sign-ins are throttled per browser address and per key id (quayutec.throttle.AuthThrottle):
beyond the burst a wrong key is answered 429 with Retry-After, one log line per burst; a key is
always checked, so the right one signs in whatever was tried before.

Every POST must carry the session's CSRF token, and its Origin (and Sec-Fetch-Site, where the
browser sends it) must name the console itself.
"""

from __future__ import annotations

import logging
import math
import secrets
from typing import Any
from urllib.parse import urlsplit

import grpc
from cryptography.fernet import Fernet, InvalidToken
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request

from quayutec.throttle import AuthThrottle, source_of
from quayutec.v1 import gateway_pb2
from services.client import GatewayClient
from services.gateway.auth import SESSION_TTL_SECONDS, parse_key_id

_log = logging.getLogger("quayutec.console.session")
CALL_SECONDS = 10.0
MAX_MENTIONS = 20
SIGNIN_SETTINGS = "QUAYUTEC_CONSOLE_SIGNIN_FAILURE_BURST / _RATE"


class SignedOut(Exception):
    """No usable sign-in: the page sends the person to the sign-in form."""


class SignInRefused(Exception):
    """A sign-in that cannot go ahead: the HTTP status, the sentence, and the seconds to wait (429)."""

    def __init__(self, status: int, text: str, retry_after_seconds: int | None = None) -> None:
        super().__init__(text)
        self.status = status
        self.text = text
        self.retry_after_seconds = retry_after_seconds


class Session:
    """The signed-in company of one request: its Gateway client (with the session key) and its id."""

    def __init__(self, request: Request) -> None:
        self.request = request
        box: Fernet = request.app.state.box
        sealed = request.session.get("key")
        if not isinstance(sealed, str):
            raise SignedOut
        try:
            api_key = box.decrypt(sealed.encode(), ttl=request.app.state.config.session_seconds).decode()
        except InvalidToken:
            request.session.clear()
            raise SignedOut from None
        self.client = GatewayClient(request.app.state.channel, api_key)
        # The session key's id: what the console counts this sign-in's open streams by.
        self.session_id: str = request.session.get("sid") or str(parse_key_id(api_key) or "")
        self.company_id: str = request.session.get("company_id", "")
        self.company_name: str = request.session.get("company_name", "")

    async def call(self, name: str, message: Any) -> Any:
        try:
            return await getattr(self.client, name)(message, timeout=CALL_SECONDS)
        except grpc.aio.AioRpcError as exc:
            self.signed_out_if(exc)
            raise

    def signed_out_if(self, exc: grpc.aio.AioRpcError) -> None:
        """A refused key (revoked, expired, ended elsewhere) ends the sign-in here too."""
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            self.request.session.clear()
            raise SignedOut from None


def csrf_token(request: Request) -> str:
    token = request.session.get("csrf")
    if not isinstance(token, str):
        token = secrets.token_urlsafe(32)
        request.session["csrf"] = token
    return token


def check_origin(request: Request) -> None:
    """403 unless the POST comes from the console's own pages: its Origin (when sent) is the console's
    (QUAYUTEC_CONSOLE_ORIGIN, or the request's own host), and Sec-Fetch-Site (when sent) is same-origin."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site != "same-origin":
        raise HTTPException(
            403, f"This form was sent from another site (Sec-Fetch-Site: {site[:40]}); use the console's own pages."
        )
    origin = request.headers.get("origin")
    if origin is None:
        return  # not a browser (browsers send Origin on every POST); the CSRF token still guards
    allowed: str = request.app.state.config.origin
    if allowed:
        ok = origin.rstrip("/") == allowed
    else:
        parsed = urlsplit(origin)
        ok = parsed.scheme in ("http", "https") and parsed.netloc.lower() == request.headers.get("host", "").lower()
    if not ok:
        raise HTTPException(403, f"This form was sent from another site ({origin[:100]}); use the console's own pages.")


async def form_of(request: Request) -> FormData:
    """The posted form, after checking its Origin and its CSRF token against the session's."""
    check_origin(request)
    form = await request.form(max_files=0, max_fields=20 + MAX_MENTIONS)
    sent = form.get("csrf")
    kept = request.session.get("csrf")
    if not isinstance(sent, str) or not isinstance(kept, str) or not secrets.compare_digest(sent, kept):
        raise HTTPException(403, "This form has expired. Reload the page and try again.")
    return form


def _subjects(request: Request, key: str) -> tuple[list[str], str | None]:
    client = request.client.host if request.client else ""
    key_id = parse_key_id(key)
    subjects = [f"source:{source_of(client)}"]
    if key_id is not None:
        subjects.append(f"key:{key_id}")
    return subjects, str(key_id) if key_id else None


def _too_many(refused: tuple[int, str]) -> SignInRefused:
    wait_ms, sentence = refused
    return SignInRefused(429, f"Too many failed sign-ins: {sentence}.", math.ceil(wait_ms / 1000))


def _throttled(request: Request, key: str) -> tuple[AuthThrottle, list[str]]:
    """The sign-in throttle and this attempt's subjects; SignInRefused (429) while its browser's address
    is throttled and the attempt has no key to check (one that has is always checked)."""
    throttle: AuthThrottle = request.app.state.signin_throttle
    subjects, key_id = _subjects(request, key)
    refused = throttle.refusal(subjects, key_id)
    if refused is not None:
        raise _too_many(refused)
    return throttle, subjects


def _wrong_key(throttle: AuthThrottle, subjects: list[str]) -> SignInRefused:
    """A key that was not accepted: counted, and answered 429 once its subjects are past their burst."""
    refused = throttle.failed(subjects)
    return _too_many(refused) if refused is not None else SignInRefused(401, _NOT_ACCEPTED)


_NOT_ACCEPTED = "That API key was not accepted. Check it, or ask your administrator for a new one."


async def check_confirm_key(s: Session, key: str) -> None:
    """A key typed to confirm what only a company key may do (make an API key): it must be a live key of
    the signed-in company. A wrong one counts against the sign-in throttle, as a sign-in would: this is
    one more place to try keys."""
    throttle, subjects = _throttled(s.request, key)
    try:
        who = await GatewayClient(s.request.app.state.channel, key).WhoAmI(
            gateway_pb2.WhoAmIRequest(), timeout=CALL_SECONDS
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise _wrong_key(throttle, subjects) from None
        raise
    if who.company.company_id != s.company_id:
        raise SignInRefused(403, f"That key is {who.company.name}'s, not {s.company_name}'s: type one of yours.")


async def sign_in(request: Request, key: str) -> None:
    """Make a session key from the company's ``key`` and keep it in the cookie (a fresh session);
    SignInRefused when the key is not accepted, the sign-ins are throttled or the Gateway refuses."""
    throttle, subjects = _throttled(request, key)
    channel = request.app.state.channel
    config = request.app.state.config
    low, high = SESSION_TTL_SECONDS
    try:
        made = await GatewayClient(channel, key).CreateSessionKey(
            gateway_pb2.CreateSessionKeyRequest(
                ttl_seconds=min(max(config.session_seconds, low), high), label="console sign-in"
            ),
            timeout=CALL_SECONDS,
        )
        who = await GatewayClient(channel, made.secret).WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=CALL_SECONDS)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise _wrong_key(throttle, subjects) from None
        if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
            raise SignInRefused(403, "Sign in with your company's API key (that was a session key).") from None
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            trailer = dict(exc.trailing_metadata() or ())
            wait = trailer.get("retry-after-ms")
            seconds = math.ceil(int(wait) / 1000) if isinstance(wait, str) and wait.isdigit() else None
            raise SignInRefused(429, f"The Gateway refused the sign-in for now: {exc.details()}", seconds) from None
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the company signs in through its provider
            raise SignInRefused(403, f"API-key sign-in is off: {exc.details()}. Sign in above.") from None
        raise
    request.session.clear()  # a new session: a fresh CSRF token, nothing of the one before
    request.session["key"] = request.app.state.box.encrypt(made.secret.encode()).decode()
    request.session["sid"] = made.key_id
    request.session["company_id"] = who.company.company_id
    request.session["company_name"] = who.company.name
    csrf_token(request)


async def sign_out(request: Request) -> bool:
    """End the session key at the Gateway (every replica), then forget the cookie's session; False when
    the Gateway could not be told (the key then lives until it expires)."""
    ended = True
    try:
        s = Session(request)
    except SignedOut:
        return True
    try:
        await s.client.EndSession(gateway_pb2.EndSessionRequest(), timeout=CALL_SECONDS)
    except grpc.aio.AioRpcError as exc:
        # UNAUTHENTICATED: already ended; FAILED_PRECONDITION: a sign-in from before session keys.
        if exc.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION):
            _log.warning("ending a console session at the Gateway failed: %s", exc.code().name)
            ended = False
    request.session.clear()
    return ended
