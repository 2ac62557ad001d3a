"""The Gateway's RPCs about the caller's own keys: session keys (console sign-ins) and company API keys.

Who may do what with a key of the company (docs/api.md, "API keys"):

- make a session key: a company key (a session key cannot make another);
- make a company key: a company key only. A session key cannot, so a copied sign-in never turns into
  lasting access: whatever it could do ends when the session is ended, expires or its company key is
  revoked. The console asks for a company key to confirm, and keeps it for that one call only;
- list keys: any key of the company, session keys too: ids, labels, times and state, never a secret
  or a hash (those are not kept);
- revoke a key: any key of the company, its own keys only (another company's key id is answered as an
  unknown one). Revoking takes access away and grants none, so a session may do it: a key that leaked
  can be stopped from the console at once.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from datetime import UTC, datetime
from typing import Any

from quayutec.crypto import MultiFernet
from quayutec.errors import FailedPrecondition, InvalidArgument, NotFound
from quayutec.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.auth import (
    Caller,
    CallerContext,
    KeyedCreate,
    create_company_key,
    create_session_key,
    end_session,
)
from services.gateway.oidc import issuer_host
from services.gateway.ratelimit import PostRateLimiter
from services.gateway.store import ApiKey, ApiKeyStore

MAX_IDEMPOTENCY_KEY_BYTES = 200
_DEFAULT_PAGE = 50
_MAX_PAGE = 500


def _page_token(key: ApiKey, sessions: bool) -> str:
    micros = int(key.created_at.timestamp() * 1_000_000)
    raw = f"keys{'+sessions' if sessions else ''}:{micros}:{key.key_id}"
    return base64.urlsafe_b64encode(raw.encode("ascii")).decode("ascii")


def _after(token: str, sessions: bool) -> tuple[datetime, uuid.UUID] | None:
    """Where a page of keys continues; INVALID_ARGUMENT for a token not handed out for this listing."""
    if not token:
        return None
    try:
        scope, micros, key_id = base64.b64decode(token, altchars=b"-_", validate=True).decode("ascii").split(":")
        if scope != f"keys{'+sessions' if sessions else ''}" or not micros.isdigit():
            raise ValueError(scope)
        return datetime.fromtimestamp(int(micros) / 1_000_000, UTC), uuid.UUID(key_id)
    except (ValueError, UnicodeError, binascii.Error, OverflowError):
        raise InvalidArgument("page_token is malformed; pass the next_page_token of the previous page") from None


def key_proto(key: ApiKey, caller: Caller) -> gateway_pb2.ApiKey:
    """A key as listed to ``caller``: never a secret or a hash; ``current`` when it is the key the call
    was made with, or the company key of the calling session key."""
    listed = gateway_pb2.ApiKey(
        key_id=key.key_id,
        label=key.label,
        session=key.parent_key_id is not None,
        parent_key_id=key.parent_key_id or "",
        current=key.key_id in (caller.key_id, caller.parent_key_id),
    )
    listed.created_at.FromDatetime(key.created_at)
    if key.revoked_at is not None:
        listed.revoked_at.FromDatetime(key.revoked_at)
    if key.expires_at is not None:
        listed.expires_at.FromDatetime(key.expires_at)
    return listed


class KeyRpcs(gateway_pb2_grpc.GatewayServiceServicer):
    """CreateSessionKey, EndSession, CreateApiKey, ListApiKeys and RevokeApiKey of the GatewayServicer."""

    _caller: CallerContext
    _keys: ApiKeyStore | None
    _limiter: PostRateLimiter
    _max_session_keys: int
    _max_api_keys: int
    _cipher: MultiFernet | None

    def _keyed(self, kind: str, company_id: str, idempotency_key: str) -> KeyedCreate | None:
        """The call's idempotency key, namespaced by the kind of key and the company (None without one)."""
        if not idempotency_key:
            return None
        if len(idempotency_key.encode("utf-8")) > MAX_IDEMPOTENCY_KEY_BYTES:
            raise InvalidArgument(f"idempotency_key must be at most {MAX_IDEMPOTENCY_KEY_BYTES} bytes")
        if self._cipher is None:
            raise NotImplementedError("keys with an idempotency_key are not served by this Gateway (it has no cipher)")
        return KeyedCreate(f"{kind}:{company_id}:{idempotency_key}", self._cipher)

    def _key_store(self, what: str) -> ApiKeyStore:
        if self._keys is None:
            raise NotImplementedError(f"{what} are not served by this Gateway")
        return self._keys

    async def CreateSessionKey(
        self, request: gateway_pb2.CreateSessionKeyRequest, context: Any
    ) -> gateway_pb2.CreateSessionKeyResponse:
        caller = self._caller.caller()
        keys = self._key_store("session keys")
        self._limiter.take(caller.company_id)
        provider = await keys.sign_in_provider(uuid.UUID(caller.company_id)) if not caller.session else None
        if provider is not None and not provider.allow_api_key_sign_in:
            raise FailedPrecondition(
                f"your company signs its people in through {issuer_host(provider.issuer)}, so sign-in with an API "
                "key is off (SetSignInProvider's allow_api_key_sign_in turns it back on, for development)"
            )
        keyed = self._keyed("session", caller.company_id, request.idempotency_key)
        made, secret = await create_session_key(
            keys, caller, request.ttl_seconds, request.label, most=self._max_session_keys, keyed=keyed
        )
        response = gateway_pb2.CreateSessionKeyResponse(key_id=made.key_id, secret=secret)
        if made.expires_at is not None:
            response.expires_at.FromDatetime(made.expires_at)
        return response

    async def EndSession(self, request: gateway_pb2.EndSessionRequest, context: Any) -> gateway_pb2.EndSessionResponse:
        caller = self._caller.caller()
        await end_session(self._key_store("session keys"), caller)
        return gateway_pb2.EndSessionResponse(key_id=caller.key_id)

    async def CreateApiKey(
        self, request: gateway_pb2.CreateApiKeyRequest, context: Any
    ) -> gateway_pb2.CreateApiKeyResponse:
        caller = self._caller.caller()
        keys = self._key_store("API keys")
        self._limiter.take(caller.company_id)
        keyed = self._keyed("api", caller.company_id, request.idempotency_key)
        made, secret = await create_company_key(keys, caller, request.label, most=self._max_api_keys, keyed=keyed)
        return gateway_pb2.CreateApiKeyResponse(key=key_proto(made, caller), secret=secret)

    async def ListApiKeys(
        self, request: gateway_pb2.ListApiKeysRequest, context: Any
    ) -> gateway_pb2.ListApiKeysResponse:
        caller = self._caller.caller()
        keys = self._key_store("API keys")
        if not 0 <= request.page_size <= _MAX_PAGE:
            raise InvalidArgument(f"page_size must be between 1 and {_MAX_PAGE} (0 for the default 50)")
        limit = request.page_size or _DEFAULT_PAGE
        sessions = request.include_sessions
        found = await keys.list_keys_page(
            uuid.UUID(caller.company_id),
            sessions=sessions,
            after=_after(request.page_token, sessions),
            limit=limit + 1,
        )
        page = found[:limit]
        return gateway_pb2.ListApiKeysResponse(
            keys=[key_proto(k, caller) for k in page],
            next_page_token=_page_token(page[-1], sessions) if len(found) > limit else "",
        )

    async def RevokeApiKey(
        self, request: gateway_pb2.RevokeApiKeyRequest, context: Any
    ) -> gateway_pb2.RevokeApiKeyResponse:
        caller = self._caller.caller()
        keys = self._key_store("API keys")
        if not request.key_id:
            raise InvalidArgument("key_id is required")
        # Another company's key is answered exactly as one that does not exist.
        not_found = NotFound(f"key {request.key_id[:64]!r} not found among your company's keys")
        try:
            key_id = uuid.UUID(request.key_id)
        except ValueError:
            raise not_found from None
        revoked = await keys.revoke_company_key(key_id, uuid.UUID(caller.company_id))
        if revoked is None:
            raise not_found
        return gateway_pb2.RevokeApiKeyResponse(key=key_proto(revoked, caller))
