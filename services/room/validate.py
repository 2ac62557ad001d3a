"""Request checks of the Room service: ids, text limits, authors, page sizes and page tokens.

A malformed id is INVALID_ARGUMENT; a well-formed id that names nothing is the store's NOT_FOUND.
"""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from urllib.parse import urlsplit

from quayutec.errors import InvalidArgument
from quayutec.v1 import common_pb2
from services.room.store import AuthorRef

KIB = 1024
MAX_NAME_BYTES = 200
MAX_BODY_BYTES = 64 * KIB
MAX_TITLE_BYTES = 500
MAX_MEMORY_BYTES = 16 * KIB
MAX_FILE_BYTES = 10 * KIB * KIB
MAX_MENTIONS = 50
MAX_KEY_BYTES = 200  # run ids, lease owners
# A caller's 200-byte idempotency key with the Gateway's prefix (gw:<company id>:) still fits.
MAX_DEDUPE_KEY_BYTES = 300
MAX_QUERY_BYTES = 1000
MAX_URL_BYTES = 2048
MAX_PROVIDER_KEY_BYTES = 4 * KIB
MAX_RUN_BYTES = 1024 * KIB
MAX_LAST_ERROR_CHARS = 4000
MAX_RETRY_AFTER_MS = 24 * 3600 * 1000
MAX_HELD_ACTIONS = 100
# A run's traces: its first and one per continuation (a run continues once; room to spare).
MAX_TRACE_IDS = 16
MAX_EXPIRES_IN_SECONDS = 30 * 24 * 3600
DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 500
MAX_PAGE_KEY = 2**63 - 1  # page keys are PostgreSQL bigints
# An id already in canonical form (what every caller of ours sends) is returned as it is: matching this
# costs a seventh of the CPU of parsing it into a UUID and printing it back, which gives the same text.
_CANONICAL_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def required_id(value: str, field: str) -> str:
    """The id in canonical form; INVALID_ARGUMENT when missing or not a UUID."""
    if not value:
        raise InvalidArgument(f"{field} is required")
    if _CANONICAL_ID.fullmatch(value):
        return value
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise InvalidArgument(f"{field} is not a valid id: {value[:64]!r}") from None


def optional_id(value: str, field: str) -> str | None:
    return required_id(value, field) if value else None


def text(value: str, field: str, max_bytes: int, *, required: bool = True) -> str:
    """``value`` checked for presence, size in UTF-8 bytes and NUL (PostgreSQL text cannot hold it)."""
    if required and not value.strip():
        raise InvalidArgument(f"{field} is required")
    size = len(value.encode("utf-8"))
    if size > max_bytes:
        raise InvalidArgument(f"{field} is {size} bytes; at most {max_bytes} are allowed")
    if "\x00" in value:
        raise InvalidArgument(f"{field} must not contain a NUL character")
    return value


def optional_key(value: str, field: str) -> str | None:
    """A dedupe key or run id: empty means none."""
    return text(value, field, MAX_KEY_BYTES, required=False) or None


def dedupe_key(value: str) -> str | None:
    """A dedupe key: empty means none. Room up for the Gateway's namespace before a caller's key."""
    return text(value, "dedupe_key", MAX_DEDUPE_KEY_BYTES, required=False) or None


def author(value: common_pb2.Author, field: str = "author") -> AuthorRef:
    if value.kind == common_pb2.AUTHOR_KIND_PERSON:
        return AuthorRef(
            kind="person",
            company_id=required_id(value.company_id, f"{field}.company_id"),
            person=text(value.person, f"{field}.person", MAX_NAME_BYTES),
            verified_by=text(value.verified_by, f"{field}.verified_by", MAX_URL_BYTES, required=False) or None,
        )
    if value.kind == common_pb2.AUTHOR_KIND_AGENT:
        company = optional_id(value.company_id, f"{field}.company_id")
        return AuthorRef(
            kind="agent", company_id=company or "", agent_id=required_id(value.agent_id, f"{field}.agent_id")
        )
    raise InvalidArgument(f"{field}.kind must be AUTHOR_KIND_PERSON or AUTHOR_KIND_AGENT")


def base_url(value: str) -> str | None:
    """An owner-supplied model address: an http(s) URL with a host and no credentials."""
    if not value:
        return None
    text(value, "base_url", MAX_URL_BYTES)
    try:
        parts = urlsplit(value)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise InvalidArgument(f"base_url is not a valid URL: {value[:100]!r}") from None
    if parts.scheme not in ("http", "https") or not host:
        raise InvalidArgument("base_url must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise InvalidArgument("base_url must not contain credentials; pass the key as provider_key")
    if any(c.isspace() for c in value) or parts.fragment:
        raise InvalidArgument("base_url must not contain whitespace or a #fragment")
    return value


def page_size(value: int) -> int:
    if value == 0:
        return DEFAULT_PAGE_SIZE
    if not 1 <= value <= MAX_PAGE_SIZE:
        raise InvalidArgument(f"page_size must be between 1 and {MAX_PAGE_SIZE}, got {value}")
    return value


def encode_page_token(scope: str, key: int | None) -> str:
    """An opaque token: base64 of the list's name and the last key of the page."""
    if key is None:
        return ""
    return base64.urlsafe_b64encode(f"{scope}:{key}".encode("ascii")).decode("ascii")


def decode_page_token(token: str, scope: str) -> int | None:
    """The key to continue after; INVALID_ARGUMENT for a token this list did not hand out."""
    if not token:
        return None
    try:
        raw = base64.b64decode(token.encode("ascii"), altchars=b"-_", validate=True).decode("ascii")
        name, _, key = raw.partition(":")
        if name != scope:
            raise ValueError(name)
        # Digits only (int() would also take signs, spaces and underscores), and a key a bigint holds.
        if not key.isascii() or not key.isdigit():
            raise ValueError(key)
        value = int(key)
        if value > MAX_PAGE_KEY:
            raise ValueError(key)
        return value
    except (ValueError, UnicodeError, binascii.Error):
        raise InvalidArgument("page_token is malformed; pass the next_page_token of the previous page") from None


def in_range(value: int, field: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise InvalidArgument(f"{field} must be between {low} and {high}, got {value}")
    return value
