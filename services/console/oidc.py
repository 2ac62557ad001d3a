"""Console sign-in through the company's OpenID Connect provider (authorization code with PKCE).

1. The person names their company or types their work email; the Gateway finds the company's
   provider (FindSignInProvider).
2. The console keeps a fresh ``state``, ``nonce`` and PKCE verifier in the signed session cookie and
   sends the browser to the provider's authorization endpoint with the S256 challenge.
3. The provider sends the browser back to /signin/callback. The console checks ``state`` against the
   one it kept (once: it is forgotten on use), then hands code, verifier, nonce and redirect URI to
   the Gateway (CompleteSignIn), which redeems the code at the provider with the company's client
   secret, verifies the ID token and makes a session key carrying the person. The console never sees
   a token, only that session key, kept as an API-key sign-in's is (session.py).

Each refusal answers a page that says what went wrong in words.
"""

from __future__ import annotations

import secrets
from urllib.parse import urlencode

import grpc
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from quayutec.v1 import signin_pb2, signin_pb2_grpc
from services.console.session import CALL_SECONDS, csrf_token, form_of
from services.console.web import field, page, words
from services.gateway.auth import SESSION_TTL_SECONDS
from services.gateway.oidc import issuer_host

PENDING = "oidc"
SCOPES = "openid email profile"


def _signin_page(request: Request, error: str, status: int) -> Response:
    return page(request, "signin.html", {"title": "Sign in", "error": error}, status)


def _redirect_uri(request: Request) -> str:
    origin: str = request.app.state.config.origin
    if origin:
        return f"{origin}/signin/callback"
    return str(request.url_for("signin_callback"))


async def signin_provider(request: Request) -> Response:
    """POST /signin/provider: find the company's provider and send the person there."""
    form = await form_of(request)
    who = field(form, "who", "Your company or work email", limit=320)
    by_email = "@" in who
    stub = signin_pb2_grpc.SignInServiceStub(request.app.state.channel)
    try:
        found = await stub.FindSignInProvider(
            signin_pb2.FindSignInProviderRequest(email=who if by_email else "", company_name="" if by_email else who),
            timeout=CALL_SECONDS,
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            text = (
                f"{exc.details()}. Check the spelling, or sign in with your company's API key below if your "
                "company has not set up a provider."
            )
            return _signin_page(request, text, 404)
        status, text = words(exc)
        return _signin_page(request, text, status)
    state = secrets.token_urlsafe(32)
    nonce = secrets.token_urlsafe(32)
    verifier = secrets.token_urlsafe(64)
    redirect_uri = _redirect_uri(request)
    request.session[PENDING] = {
        "state": state,
        "nonce": nonce,
        "verifier": verifier,
        "company_id": found.company_id,
        "redirect_uri": redirect_uri,
    }
    query = {
        "response_type": "code",
        "client_id": found.client_id,
        "redirect_uri": redirect_uri,
        "scope": SCOPES,
        "state": state,
        "nonce": nonce,
        "code_challenge": create_s256_code_challenge(verifier),
        "code_challenge_method": "S256",
    }
    if by_email:
        query["login_hint"] = who
    separator = "&" if "?" in found.authorization_endpoint else "?"
    # A page that moves on by itself rather than a redirect: the sign-in form's CSP (form-action 'self')
    # would stop a form's redirect to another site.
    return page(
        request,
        "signin_away.html",
        {
            "title": "Signing in",
            "target": f"{found.authorization_endpoint}{separator}{urlencode(query)}",
            "found": found,
            "issuer": issuer_host(found.issuer),
        },
    )


async def signin_callback(request: Request) -> Response:
    """GET /signin/callback: where the provider sends the person back, with a code or an error."""
    params = request.query_params
    pending = request.session.pop(PENDING, None)
    if not isinstance(pending, dict):
        return _signin_page(
            request,
            "This sign-in did not start in this browser, or it was already used. Start again from this page.",
            400,
        )
    sent_state = params.get("state", "")
    if not secrets.compare_digest(sent_state.encode(), str(pending.get("state", "")).encode()):
        return _signin_page(
            request,
            "The answer from your provider does not belong to the sign-in started here (its state does not "
            "match), so it was refused. Start again from this page.",
            400,
        )
    if params.get("error"):
        described = params.get("error_description") or params["error"]
        return _signin_page(request, f"Your provider did not sign you in: {described[:300]}.", 401)
    code = params.get("code", "")
    if not code:
        return _signin_page(request, "Your provider sent no sign-in code back. Start again from this page.", 400)
    config = request.app.state.config
    low, high = SESSION_TTL_SECONDS
    stub = signin_pb2_grpc.SignInServiceStub(request.app.state.channel)
    try:
        done = await stub.CompleteSignIn(
            signin_pb2.CompleteSignInRequest(
                company_id=pending["company_id"],
                code=code,
                code_verifier=pending["verifier"],
                redirect_uri=pending["redirect_uri"],
                nonce=pending["nonce"],
                ttl_seconds=min(max(config.session_seconds, low), high),
            ),
            timeout=CALL_SECONDS,
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
            return _signin_page(request, f"You were not signed in: {exc.details()}", 403)
        status, text = words(exc)
        return _signin_page(request, text, status)
    request.session.clear()  # a new session: a fresh CSRF token, nothing of the one before
    request.session["key"] = request.app.state.box.encrypt(done.secret.encode()).decode()
    request.session["sid"] = done.key_id
    request.session["company_id"] = pending["company_id"]
    request.session["company_name"] = done.company_name
    request.session["person"] = done.person.name
    request.session["verified_by"] = done.person.issuer
    request.session["email"] = done.person.email
    csrf_token(request)
    return RedirectResponse("/rooms", 303)
