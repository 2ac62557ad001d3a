"""Console sign-in through each company's OpenID Connect provider: registering it, finding it, redeeming.

A company registers its provider with a company key (SetSignInProvider); the client secret is kept
encrypted with the cipher of agents' provider keys. Its sign-ins are session keys made under a
company key the provider row owns and never hands out, so replacing or removing the provider, or
revoking that key, ends them all. SignInService (no API key: nobody is signed in yet) finds a
company's provider by name or email domain, and redeems the code the provider sent back here, in the
Gateway: the console never sees a token, and a session key carries a person only when this Gateway
checked the provider's signed word for it.
"""

from __future__ import annotations

import logging
import re
import uuid
from datetime import UTC, datetime
from typing import Any, NoReturn

from quayutec.crypto import InvalidToken, MultiFernet
from quayutec.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from quayutec.throttle import AuthThrottle, ThrottleConfig, source_of
from quayutec.v1 import gateway_pb2, gateway_pb2_grpc, room_pb2, signin_pb2, signin_pb2_grpc
from services.gateway.auth import (
    SESSION_TTL_SECONDS,
    THROTTLE_SETTINGS,
    CallerContext,
    hash_secret,
    new_secret,
    source_address,
)
from services.gateway.oidc import IssuerUnreachable, OidcClient, SignInRefused, issuer_host
from services.gateway.ratelimit import PostRateLimiter
from services.gateway.store import ApiKeyStore, ProviderNameTaken, ProviderRow, VerifiedPerson

_log = logging.getLogger("quayutec.gateway")

MAX_FIELD_BYTES = 1000
MAX_DOMAINS = 50
_DOMAIN = re.compile(r"^(?=.{1,253}$)([a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$")


def _text(value: str, name: str) -> str:
    value = value.strip()
    if not value:
        raise InvalidArgument(f"{name} is required")
    if len(value.encode("utf-8")) > MAX_FIELD_BYTES:
        raise InvalidArgument(f"{name} must be at most {MAX_FIELD_BYTES} bytes")
    return value


def domains_of(values: list[str]) -> tuple[str, ...]:
    """The allowed email domains, lower-cased; INVALID_ARGUMENT for one that is not a domain name."""
    if len(values) > MAX_DOMAINS:
        raise InvalidArgument(f"at most {MAX_DOMAINS} email domains")
    found: list[str] = []
    for raw in values:
        domain = raw.strip().lower().lstrip("@")
        if not _DOMAIN.match(domain):
            raise InvalidArgument(f"{raw[:100]!r} is not an email domain (e.g. acme.example)")
        if domain not in found:
            found.append(domain)
    return tuple(found)


def provider_proto(row: ProviderRow) -> gateway_pb2.SignInProvider:
    listed = gateway_pb2.SignInProvider(
        issuer=row.issuer,
        client_id=row.client_id,
        email_domains=list(row.email_domains),
        allow_api_key_sign_in=row.allow_api_key_sign_in,
    )
    listed.updated_at.FromDatetime(row.updated_at)
    return listed


class SignInProviderRpcs(gateway_pb2_grpc.GatewayServiceServicer):
    """SetSignInProvider, GetSignInProvider and RemoveSignInProvider of the GatewayServicer."""

    _caller: CallerContext
    _keys: ApiKeyStore | None
    _room: Any
    _timeout: float
    _cipher: MultiFernet | None
    _oidc: OidcClient | None

    def _providers(self) -> tuple[ApiKeyStore, MultiFernet, OidcClient]:
        if self._keys is None or self._cipher is None or self._oidc is None:
            raise NotImplementedError("sign-in providers are not served by this Gateway")
        return self._keys, self._cipher, self._oidc

    async def SetSignInProvider(
        self, request: gateway_pb2.SetSignInProviderRequest, context: Any
    ) -> gateway_pb2.SetSignInProviderResponse:
        caller = self._caller.caller()
        keys, cipher, oidc = self._providers()
        if caller.session:
            raise PermissionDenied("a session key cannot set the sign-in provider: call with a company API key")
        issuer = _text(request.issuer, "issuer")
        client_id = _text(request.client_id, "client_id")
        secret = _text(request.client_secret, "client_secret")
        domains = domains_of(list(request.email_domains))
        try:
            await oidc.discover(issuer)
        except IssuerUnreachable as exc:
            raise FailedPrecondition(f"the provider was not saved: {exc}") from None
        company = await self._room.GetCompany(
            room_pb2.RoomServiceGetCompanyRequest(company_id=caller.company_id), timeout=self._timeout
        )
        key_id, key_secret = new_secret()
        row = ProviderRow(
            company_id=caller.company_id,
            company_name=company.company.name,
            issuer=issuer,
            client_id=client_id,
            client_secret_sealed=cipher.encrypt(secret.encode("utf-8")),
            email_domains=domains,
            allow_api_key_sign_in=request.allow_api_key_sign_in,
            key_id=str(key_id),
            updated_at=datetime.now(UTC),
        )
        try:
            saved, taken = await keys.set_sign_in_provider(
                row, hash_secret(key_secret), f"sign-ins through {issuer_host(issuer)}"[:200]
            )
        except ProviderNameTaken:
            raise AlreadyExists(
                f"another company's name differs from {row.company_name!r} only in case, and it already signs its "
                "people in through a provider; people find their company's provider by its name, so only one "
                "of the two can have one: ask the operator to rename one of them"
            ) from None
        if saved is None:
            raise AlreadyExists(f"another company's provider already serves {', '.join(taken)}")
        return gateway_pb2.SetSignInProviderResponse(provider=provider_proto(saved))

    async def GetSignInProvider(
        self, request: gateway_pb2.GetSignInProviderRequest, context: Any
    ) -> gateway_pb2.GetSignInProviderResponse:
        caller = self._caller.caller()
        keys, _, _ = self._providers()
        row = await keys.sign_in_provider(uuid.UUID(caller.company_id))
        if row is None:
            return gateway_pb2.GetSignInProviderResponse(found=False)
        return gateway_pb2.GetSignInProviderResponse(found=True, provider=provider_proto(row))

    async def RemoveSignInProvider(
        self, request: gateway_pb2.RemoveSignInProviderRequest, context: Any
    ) -> gateway_pb2.RemoveSignInProviderResponse:
        caller = self._caller.caller()
        keys, _, _ = self._providers()
        if caller.session:
            raise PermissionDenied("a session key cannot remove the sign-in provider: call with a company API key")
        removed = await keys.remove_sign_in_provider(uuid.UUID(caller.company_id))
        return gateway_pb2.RemoveSignInProviderResponse(removed=removed)


class SignInServicer(signin_pb2_grpc.SignInServiceServicer):
    """FindSignInProvider and CompleteSignIn: served without an API key."""

    def __init__(
        self,
        keys: ApiKeyStore,
        cipher: MultiFernet,
        oidc: OidcClient,
        *,
        max_session_keys: int,
        limiter: PostRateLimiter | None = None,
        throttle: ThrottleConfig | None = None,
    ) -> None:
        self._keys = keys
        self._cipher = cipher
        self._oidc = oidc
        self._most = max_session_keys
        # Anyone may call CompleteSignIn, and each call reaches the company's provider: the company's
        # rate limit (the one of its posts) bounds how often.
        self._limiter = limiter
        # Failed sign-ins are counted per source address and per company, as failed authentications
        # are (services/gateway/auth.py): every attempt is still checked, so a right code always signs
        # in; past the burst a failure is answered RESOURCE_EXHAUSTED (back off) instead of refused.
        self._throttle = AuthThrottle(throttle or ThrottleConfig(), _log, what="sign-ins", settings=THROTTLE_SETTINGS)

    async def FindSignInProvider(
        self, request: signin_pb2.FindSignInProviderRequest, context: Any
    ) -> signin_pb2.FindSignInProviderResponse:
        name = request.company_name.strip()[:MAX_FIELD_BYTES]
        email = request.email.strip()[:MAX_FIELD_BYTES]
        if name:
            row = await self._keys.find_sign_in_provider(company_name=name)
            missing = f"no company named {name[:100]!r} signs its people in through a provider"
        elif "@" in email:
            domain = email.rpartition("@")[2].lower()
            row = await self._keys.find_sign_in_provider(domain=domain)
            missing = f"no company signs in people of {domain[:100]!r} through a provider"
        else:
            raise InvalidArgument("give company_name, or an email address")
        if row is None:
            raise NotFound(missing)
        try:
            found = await self._oidc.discover(row.issuer)
        except IssuerUnreachable as exc:
            raise FailedPrecondition(f"{row.company_name}'s provider cannot be used now: {exc}") from None
        return signin_pb2.FindSignInProviderResponse(
            company_id=row.company_id,
            company_name=row.company_name,
            issuer=row.issuer,
            client_id=row.client_id,
            authorization_endpoint=found.authorization_endpoint,
            allow_api_key_sign_in=row.allow_api_key_sign_in,
        )

    async def CompleteSignIn(
        self, request: signin_pb2.CompleteSignInRequest, context: Any
    ) -> signin_pb2.CompleteSignInResponse:
        for name in ("company_id", "code", "code_verifier", "redirect_uri", "nonce"):
            _text(getattr(request, name), name)
        low, high = SESSION_TTL_SECONDS
        if not low <= request.ttl_seconds <= high:
            raise InvalidArgument(f"ttl_seconds must be between {low} and {high}, got {request.ttl_seconds}")
        try:
            company = uuid.UUID(request.company_id)
        except ValueError:
            raise InvalidArgument("company_id must be an id (uuid)") from None
        source = f"source:{source_of(source_address(context))}"
        row = await self._keys.sign_in_provider(company)
        if row is None:
            self._counted_failure(
                [source], NotFound("this company has no sign-in provider (it was removed): sign in again")
            )
        if self._limiter is not None:
            self._limiter.take(row.company_id)
        try:
            person = await self._verified_person(row, request)
        except PermissionDenied as exc:
            self._counted_failure([source, f"company:{row.company_id}"], exc)
        key_id, key_secret = new_secret()
        made = await self._keys.insert_person_session_key(
            key_id,
            hash_secret(key_secret),
            f"console sign-in of {person.name}"[:200],
            uuid.UUID(row.key_id),
            request.ttl_seconds,
            self._most,
            person,
        )
        if made is None:
            raise ResourceExhausted(
                f"{row.company_name}'s sign-ins through its provider are ended (its key was revoked) or at the "
                "most allowed (QUAYUTEC_GATEWAY_MAX_SESSION_KEYS): ask your administrator to set the provider again"
            )
        response = signin_pb2.CompleteSignInResponse(
            key_id=made.key_id,
            secret=key_secret,
            company_name=row.company_name,
            person=signin_pb2.VerifiedPerson(
                issuer=person.issuer, subject=person.subject, name=person.name, email=person.email
            ),
        )
        if made.expires_at is not None:
            response.expires_at.FromDatetime(made.expires_at)
        return response

    def _counted_failure(self, subjects: list[str], exc: Exception) -> NoReturn:
        """Counts a failed sign-in against ``subjects`` and raises ``exc``, or RESOURCE_EXHAUSTED once a
        subject is past its burst of failures."""
        refused = self._throttle.failed(subjects)
        if refused is None:
            raise exc
        wait_ms, sentence = refused
        raise ResourceExhausted(sentence, retry_after_ms=wait_ms) from None

    async def _verified_person(self, row: ProviderRow, request: signin_pb2.CompleteSignInRequest) -> VerifiedPerson:
        """The person the provider vouches for with the code, if the company admits them; PERMISSION_DENIED
        saying why when not."""
        try:
            secret = self._cipher.decrypt(row.client_secret_sealed).decode("utf-8")
        except InvalidToken:
            raise FailedPrecondition(
                "the provider's client secret cannot be decrypted with this Gateway's encryption key "
                "(QUAYUTEC_ENCRYPTION_KEY): set the provider again"
            ) from None
        try:
            person = await self._oidc.redeem(
                row.issuer,
                row.client_id,
                secret,
                code=request.code,
                code_verifier=request.code_verifier,
                redirect_uri=request.redirect_uri,
                nonce=request.nonce,
            )
        except SignInRefused as exc:
            raise PermissionDenied(str(exc)) from None
        except IssuerUnreachable as exc:
            raise Unavailable(f"your provider could not be reached: {exc}") from None
        if row.email_domains:
            domains = ", ".join(row.email_domains)
            if person.email_unverified:
                raise PermissionDenied(
                    f"your provider says your email address is not verified, and {row.company_name} lets only "
                    f"people of {domains} sign in here: verify your address with your provider, then sign in again"
                )
            if not person.email:
                raise PermissionDenied(
                    f"your provider sent no email address, and {row.company_name} lets only people of {domains} "
                    "sign in here"
                )
            if person.email.rpartition("@")[2].lower() not in row.email_domains:
                raise PermissionDenied(
                    f"{person.email} is not an email of {row.company_name} ({domains}): your provider vouched "
                    "for you, but your company lets only those domains sign in here"
                )
        return person
