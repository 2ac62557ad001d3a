"""What the Gateway checks of a request that the client can check before sending it, refused with the
Gateway's own messages (as ``InvalidArgument`` with ``attempts == 0``): required ids and text, sizes,
page sizes, idempotency keys, mentions, watch cursors. What needs the Gateway's state (does it exist,
may you) is left to the Gateway. tests/clients compares these messages with the Gateway's answers."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf.message import Message

from quayutec_client.errors import InvalidArgument

# The Gateway's limits (services/gateway/servicer.py).
MAX_NAME_BYTES = 200
MAX_BODY_BYTES = 64 * 1024
MAX_TITLE_BYTES = 500
MAX_FILE_NAME_BYTES = 255
MAX_QUERY_BYTES = 1000
MAX_IDEMPOTENCY_KEY_BYTES = 200
MAX_MENTIONS = 50
MAX_PAGE_SIZE = 500
MAX_FILE_BYTES = 10 * 1024 * 1024
SESSION_TTL_SECONDS = (60, 7 * 86_400)

# Per RPC, in the Gateway's order: (field, what it must be, its limit in UTF-8 bytes). "id": not
# empty; "text": not blank and within the limit; "optional": within the limit.
FIELDS: Mapping[str, tuple[tuple[str, str, int], ...]] = {
    "CreateRoom": (("name", "text", MAX_NAME_BYTES),),
    "RenameRoom": (("name", "text", MAX_NAME_BYTES), ("room_id", "id", 0)),
    "ArchiveRoom": (("room_id", "id", 0),),
    "RenameAgent": (("agent_id", "id", 0), ("name", "text", MAX_NAME_BYTES)),
    "RetireAgent": (("agent_id", "id", 0),),
    "InviteCompany": (("company_id", "id", 0), ("room_id", "id", 0)),
    "AcceptInvitation": (("invitation_id", "id", 0),),
    "DeclineInvitation": (("invitation_id", "id", 0),),
    "LeaveRoom": (("room_id", "id", 0),),
    "RemoveMember": (("company_id", "id", 0), ("room_id", "id", 0)),
    "ListMembers": (("room_id", "id", 0),),
    "RegisterAgent": (("name", "text", MAX_NAME_BYTES), ("model", "text", MAX_NAME_BYTES)),
    "PostMessage": (("person", "text", MAX_NAME_BYTES), ("body", "text", MAX_BODY_BYTES), ("room_id", "id", 0)),
    "ListMessages": (("room_id", "id", 0),),
    "GetMessage": (("message_id", "id", 0), ("room_id", "id", 0)),
    "SendTask": (
        ("person", "text", MAX_NAME_BYTES),
        ("to_agent_id", "id", 0),
        ("title", "text", MAX_TITLE_BYTES),
        ("body", "optional", MAX_BODY_BYTES),
        ("room_id", "id", 0),
    ),
    "UpdateTask": (
        ("task_id", "id", 0),
        ("person", "text", MAX_NAME_BYTES),
        ("note", "optional", MAX_BODY_BYTES),
        ("room_id", "id", 0),
    ),
    "ListTasks": (("room_id", "id", 0),),
    "GetTask": (("task_id", "id", 0), ("room_id", "id", 0)),
    "ListMemory": (("query", "optional", MAX_QUERY_BYTES), ("room_id", "id", 0)),
    "UploadFile": (("person", "text", MAX_NAME_BYTES), ("name", "text", MAX_FILE_NAME_BYTES), ("room_id", "id", 0)),
    "ListFiles": (("room_id", "id", 0),),
    "SearchPassages": (("query", "text", MAX_QUERY_BYTES), ("room_id", "id", 0)),
    "GetRun": (("run_id", "id", 0),),
    "RevokeApiKey": (("key_id", "id", 0),),
    "WatchRoom": (("room_id", "id", 0),),
}


def invalid(method: str, message: str) -> InvalidArgument:
    return InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, message, method=method, attempts=0)


def _over(value: str, limit: int) -> bool:
    """Whether ``value`` is longer than ``limit`` bytes in UTF-8 (encoded only when its length in
    characters cannot tell: a character is 1 to 4 bytes)."""
    if len(value) * 4 <= limit:
        return False
    return len(value) > limit or len(value.encode("utf-8")) > limit


# Per request type: whether it has a page size, an idempotency key, mentions (read from its
# descriptor once, not on every call).
_SHAPES: dict[Any, tuple[bool, bool, bool]] = {}


def _shape(request: Message) -> tuple[bool, bool, bool]:
    shape = _SHAPES.get(type(request))
    if shape is None:
        fields = request.DESCRIPTOR.fields_by_name
        shape = _SHAPES[type(request)] = (
            "page_size" in fields,
            "idempotency_key" in fields,
            "mention_agent_ids" in fields,
        )
    return shape


def check_request(method: str, request: Message) -> None:
    """InvalidArgument (never sent) when ``request`` breaks a rule the Gateway would refuse it for."""
    for field, kind, limit in FIELDS.get(method, ()):
        value: str = getattr(request, field)
        if kind == "id":
            if not value:
                raise invalid(method, f"{field} is required")
            continue
        if kind == "text" and (not value or value.isspace()):  # blank: what value.strip() leaves empty
            raise invalid(method, f"{field} is required")
        if _over(value, limit):
            more = " (64 KiB)" if field == "body" and method == "PostMessage" else ""
            raise invalid(method, f"{field} must be at most {limit} bytes{more}")
    if method == "CreateSessionKey":
        low, high = SESSION_TTL_SECONDS
        ttl: int = getattr(request, "ttl_seconds")  # noqa: B009
        if not low <= ttl <= high:
            raise invalid(method, f"ttl_seconds must be between {low} and {high} (7 days), got {ttl}")
    elif method == "UploadFile":
        content: bytes = getattr(request, "content")  # noqa: B009
        if len(content) > MAX_FILE_BYTES:
            raise invalid(method, f"content must be at most {MAX_FILE_BYTES} bytes (10 MiB), got {len(content)}")
        try:
            content.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise invalid(method, f"content must be UTF-8 text (invalid byte at offset {exc.start})") from None
    has_page_size, has_key, has_mentions = _shape(request)
    if has_page_size:
        size: int = getattr(request, "page_size")  # noqa: B009 - not every request has it
        if size != 0 and not 1 <= size <= MAX_PAGE_SIZE:
            raise invalid(method, f"page_size must be between 1 and {MAX_PAGE_SIZE} (0 for the default 50), got {size}")
    if has_key:
        key: str = getattr(request, "idempotency_key")  # noqa: B009
        if _over(key, MAX_IDEMPOTENCY_KEY_BYTES):
            raise invalid(method, f"idempotency_key must be at most {MAX_IDEMPOTENCY_KEY_BYTES} bytes")
    if has_mentions:
        mentions: Any = getattr(request, "mention_agent_ids")  # noqa: B009
        if len(mentions) > MAX_MENTIONS:
            raise invalid(method, f"mention_agent_ids may name at most {MAX_MENTIONS} agents")
        if not all(mentions):
            raise invalid(method, "mention_agent_ids is required")


def sequence_of_str(value: Any, name: str) -> list[str]:
    """``value`` as a list of str; TypeError for a str (a list of its characters) or other types."""
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of ids (str), not {type(value).__name__}")
    items = list(value)
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"{name} must be a list of ids (str); it holds a {type(item).__name__}")
    return items


def _is_uuid(value: str) -> bool:
    """As the Gateway reads an id: a uuid in its canonical text (any case)."""
    try:
        return str(uuid.UUID(value)) == value.lower()
    except ValueError:
        return False


def watch_cursor(after: Any) -> int | None:
    """WatchRoom's ``after``: None (from now) or a cursor of 0 or more."""
    if after is None:
        return None
    if isinstance(after, bool) or not isinstance(after, int):
        raise TypeError(f"after must be a cursor (int) or None, not {type(after).__name__}")
    if after < 0:
        raise invalid("WatchRoom", f"after must be a cursor (0 or more) or unset (from now), got {after}")
    return after


def watch_cursors(after: Any) -> dict[str, int] | None:
    """WatchRooms' ``after``: None, or room id -> cursor of 0 or more."""
    if after is None:
        return None
    if not isinstance(after, Mapping):
        raise TypeError(f"after must be a mapping of room id to cursor, not {type(after).__name__}")
    cursors: dict[str, int] = {}
    for index, (room_id, cursor) in enumerate(after.items()):
        if not isinstance(room_id, str) or isinstance(cursor, bool) or not isinstance(cursor, int):
            raise TypeError(f"after maps room ids (str) to cursors (int), not {room_id!r} to {cursor!r}")
        if not _is_uuid(room_id):
            raise invalid("WatchRooms", f"after[{index}].room_id must be a room id (uuid), got {room_id[:64]!r}")
        if cursor < 0:
            raise invalid("WatchRooms", f"after[{index}].cursor must be 0 or more, got {cursor}")
        cursors[room_id] = cursor
    return cursors
