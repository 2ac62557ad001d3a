"""The Gateway's side of OpenID Connect sign-in: a company's issuer read and its codes redeemed.

Every call to an issuer goes through the egress guard (quayutec.egress: https to public addresses,
unless the operator's allow-list admits the host), with no redirects followed. The discovery document
and the published keys are kept a few minutes per issuer; a key id the kept set does not know makes
one fresh read (the issuer rotated its keys). The ID token is checked with Authlib: its signature
against the issuer's published keys, then issuer, audience, expiry, nonce, ``azp`` and ``at_hash``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from authlib.jose import JsonWebKey, JsonWebToken
from authlib.jose.errors import (
    BadSignatureError,
    DecodeError,
    ExpiredTokenError,
    InvalidClaimError,
    InvalidTokenError,
    JoseError,
    MissingClaimError,
)
from authlib.oidc.core import CodeIDToken

from quayutec.egress import EgressPolicy, EgressRefused, EgressTransport, ResolutionFailed, Resolver
from services.gateway.store import VerifiedPerson

# Kept this long before the issuer is read again (seconds).
KEEP_SECONDS = 300.0
# Signatures an ID token may carry (never "none", never a symmetric one).
ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
# Clock difference allowed between the issuer and this Gateway when checking expiry (seconds).
LEEWAY_SECONDS = 30
MAX_DOCUMENT_BYTES = 256 * 1024


class IssuerUnreachable(Exception):
    """The issuer could not be read (refused by the egress guard, down, or answering nonsense)."""


class SignInRefused(Exception):
    """The code or the ID token was refused; the message says why in words."""


@dataclass(frozen=True)
class Discovery:
    """What this Gateway and the console use of an issuer's discovery document."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str


def issuer_host(issuer: str) -> str:
    """The issuer as a person reads it ("login.acme.example/realms/acme")."""
    parts = urlsplit(issuer)
    return (parts.netloc + parts.path).rstrip("/") or issuer


class OidcClient:
    """Reads issuers and redeems codes, through one guarded HTTP client."""

    def __init__(
        self, policy: EgressPolicy, *, resolver: Resolver | None = None, timeout_seconds: float = 10.0
    ) -> None:
        self._http = httpx.AsyncClient(
            transport=EgressTransport(policy, resolver=resolver),
            timeout=httpx.Timeout(timeout_seconds),
            follow_redirects=False,
        )
        self._discovery: dict[str, tuple[float, Discovery]] = {}
        self._keys: dict[str, tuple[float, Any]] = {}

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _get_json(self, url: str, what: str) -> dict[str, Any]:
        try:
            response = await self._http.get(url, headers={"accept": "application/json"})
        except EgressRefused as exc:
            raise IssuerUnreachable(f"the {what} at {url} may not be read: {exc}") from None
        except (httpx.HTTPError, ResolutionFailed) as exc:
            raise IssuerUnreachable(f"the {what} at {url} could not be read ({type(exc).__name__})") from None
        return _json_of(response, f"the {what} at {url}")

    async def discover(self, issuer: str) -> Discovery:
        """The issuer's discovery document; IssuerUnreachable when it cannot be read or names another issuer."""
        kept = self._discovery.get(issuer)
        if kept is not None and time.monotonic() - kept[0] < KEEP_SECONDS:
            return kept[1]
        url = issuer.rstrip("/") + "/.well-known/openid-configuration"
        document = await self._get_json(url, "discovery document")
        if document.get("issuer") != issuer:
            raise IssuerUnreachable(
                f"the discovery document at {url} names the issuer {str(document.get('issuer'))[:200]!r}, not "
                f"{issuer!r}: register the issuer exactly as the provider names it"
            )
        try:
            found = Discovery(
                issuer=issuer,
                authorization_endpoint=_url(document, "authorization_endpoint"),
                token_endpoint=_url(document, "token_endpoint"),
                jwks_uri=_url(document, "jwks_uri"),
            )
        except ValueError as exc:
            raise IssuerUnreachable(f"the discovery document at {url} {exc}") from None
        self._discovery[issuer] = (time.monotonic(), found)
        return found

    async def _key_set(self, jwks_uri: str, *, fresh: bool) -> Any:
        kept = self._keys.get(jwks_uri)
        if kept is not None and not fresh and time.monotonic() - kept[0] < KEEP_SECONDS:
            return kept[1]
        document = await self._get_json(jwks_uri, "published keys")
        try:
            keys = JsonWebKey.import_key_set(document)
        except (ValueError, JoseError) as exc:
            raise IssuerUnreachable(f"the published keys at {jwks_uri} cannot be read ({exc})") from None
        self._keys[jwks_uri] = (time.monotonic(), keys)
        return keys

    async def redeem(
        self,
        issuer: str,
        client_id: str,
        client_secret: str,
        *,
        code: str,
        code_verifier: str,
        redirect_uri: str,
        nonce: str,
    ) -> VerifiedPerson:
        """Redeem ``code`` at the issuer's token endpoint and verify the ID token it answers with."""
        found = await self.discover(issuer)
        try:
            response = await self._http.post(
                found.token_endpoint,
                data={
                    "grant_type": "authorization_code",
                    "code": code,
                    "redirect_uri": redirect_uri,
                    "code_verifier": code_verifier,
                },
                auth=httpx.BasicAuth(client_id, client_secret),
                headers={"accept": "application/json"},
            )
        except EgressRefused as exc:
            raise IssuerUnreachable(f"the token endpoint {found.token_endpoint} may not be called: {exc}") from None
        except (httpx.HTTPError, ResolutionFailed) as exc:
            raise IssuerUnreachable(
                f"the token endpoint {found.token_endpoint} could not be reached ({type(exc).__name__})"
            ) from None
        answer = _json_of(response, f"the token endpoint {found.token_endpoint}", errors_too=True)
        if response.status_code != 200:
            error = str(answer.get("error", response.status_code))[:100]
            if error == "invalid_grant":
                raise SignInRefused(
                    "your provider refused the sign-in code: it was already used, has expired, or was not "
                    "made for this sign-in. Start the sign-in again."
                )
            if error in ("invalid_client", "unauthorized_client"):
                raise SignInRefused(
                    f"your provider refused the console's client ({error}): the client id or secret your company "
                    "registered is wrong. Tell your administrator."
                )
            raise SignInRefused(f"your provider refused to redeem the sign-in code ({error}).")
        id_token = answer.get("id_token")
        if not isinstance(id_token, str) or not id_token:
            raise SignInRefused("your provider answered without an ID token (is the openid scope allowed?).")
        access_token = answer.get("access_token")
        claims = await self._verified(found, client_id, id_token, nonce, access_token)
        return _person(issuer, claims)

    async def _verified(
        self, found: Discovery, client_id: str, id_token: str, nonce: str, access_token: Any
    ) -> dict[str, Any]:
        jwt = JsonWebToken(ALGORITHMS)
        params = {"nonce": nonce, "client_id": client_id}
        if isinstance(access_token, str):
            params["access_token"] = access_token
        options = {
            "iss": {"essential": True, "value": found.issuer},
            "aud": {"essential": True, "value": client_id},
            "sub": {"essential": True},
            "exp": {"essential": True},
            "nonce": {"essential": True},
        }
        for fresh in (False, True):
            keys = await self._key_set(found.jwks_uri, fresh=fresh)
            try:
                claims = jwt.decode(
                    id_token, keys, claims_cls=CodeIDToken, claims_options=options, claims_params=params
                )
                break
            except ValueError as exc:  # no published key has the token's key id
                if fresh:
                    raise SignInRefused(
                        "the ID token was signed with a key your provider does not publish, so it cannot be trusted."
                    ) from exc
            except BadSignatureError:
                raise SignInRefused(
                    "the ID token's signature does not match your provider's published keys, so it cannot be trusted."
                ) from None
            except DecodeError:
                raise SignInRefused("the ID token could not be read (it is not a signed token).") from None
            except JoseError as exc:
                raise SignInRefused(f"the ID token could not be checked ({exc.error}).") from None
        try:
            claims.validate(leeway=LEEWAY_SECONDS)
        except ExpiredTokenError:
            raise SignInRefused("the ID token has expired: start the sign-in again.") from None
        except InvalidClaimError as exc:
            claim = exc.claim_name
            if claim == "iss":
                raise SignInRefused(
                    f"the ID token was issued by {str(claims.get('iss'))[:200]!r}, not by your company's provider "
                    f"{found.issuer!r}."
                ) from None
            if claim == "nonce":
                raise SignInRefused("the ID token was not made for this sign-in (its nonce does not match).") from None
            if claim in ("aud", "azp"):
                raise SignInRefused(
                    "the ID token was made for another application (its audience is not the console)."
                ) from None
            raise SignInRefused(f"the ID token's {claim} claim is not valid.") from None
        except MissingClaimError as exc:
            raise SignInRefused(f"the ID token has no {exc.claim_name} claim.") from None
        except InvalidTokenError:
            raise SignInRefused("the ID token is not valid yet or no longer valid.") from None
        return dict(claims)


def _url(document: dict[str, Any], name: str) -> str:
    value = document.get(name)
    if not isinstance(value, str) or urlsplit(value).scheme not in ("https", "http"):
        raise ValueError(f"has no usable {name}")
    return value


def _json_of(response: httpx.Response, what: str, *, errors_too: bool = False) -> dict[str, Any]:
    if response.status_code != 200 and not (errors_too and 400 <= response.status_code < 500):
        raise IssuerUnreachable(f"{what} answered HTTP {response.status_code}")
    if len(response.content) > MAX_DOCUMENT_BYTES:
        raise IssuerUnreachable(f"{what} answered more than {MAX_DOCUMENT_BYTES} bytes")
    try:
        document = json.loads(response.content)
    except ValueError:
        raise IssuerUnreachable(f"{what} did not answer JSON") from None
    if not isinstance(document, dict):
        raise IssuerUnreachable(f"{what} did not answer a JSON object")
    return document


def _person(issuer: str, claims: dict[str, Any]) -> VerifiedPerson:
    named = claims.get("email")
    unverified = isinstance(named, str) and bool(named) and claims.get("email_verified") is False
    email = named if isinstance(named, str) and not unverified else ""
    name = next(
        (str(claims[c]) for c in ("name", "preferred_username") if isinstance(claims.get(c), str) and claims[c]),
        email or str(claims["sub"]),
    )
    return VerifiedPerson(
        issuer=issuer, subject=str(claims["sub"]), name=name[:200], email=email[:320], email_unverified=unverified
    )
