"""quayutec-client: the Gateway API of Quayutec rooms from Python.

async with quayutec_client.connect("gateway.example:50051", api_key) as client:
    room = await client.create_room("launch")
    await client.post_message(room.room_id, "hello", person="ana")
    async for event in client.watch(room.room_id, after=0):
        ...
    async for event in client.watch_rooms():  # every room of your company
        ...
"""

from quayutec_client import errors, types
from quayutec_client.client import Client, Pages, Tls, connect, new_idempotency_key
from quayutec_client.errors import (
    AlreadyExists,
    Closed,
    ConnectionFailed,
    CursorExpired,
    CursorOutOfRange,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuayutecError,
    RateLimited,
    Unauthenticated,
    Unavailable,
)
from quayutec_client.retry import NO_RETRY, RetryPolicy
from quayutec_client.watch import RoomsWatch, RoomWatch

__all__ = [
    "NO_RETRY",
    "AlreadyExists",
    "Client",
    "Closed",
    "ConnectionFailed",
    "CursorExpired",
    "CursorOutOfRange",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "Pages",
    "PermissionDenied",
    "QuayutecError",
    "RateLimited",
    "RetryPolicy",
    "RoomWatch",
    "RoomsWatch",
    "Tls",
    "Unauthenticated",
    "Unavailable",
    "connect",
    "errors",
    "new_idempotency_key",
    "types",
]
