"""Follow a room and keep your place: each event is printed once, and the cursor of the last one is
written to a file, so a restart of this program carries on after it, missing and repeating nothing.

QUAYUTEC_ROOM_ID names the room, QUAYUTEC_CURSOR_FILE the file (default room-<id>.cursor), and
QUAYUTEC_MAX_EVENTS stops after that many events (unset: follow until interrupted). The Gateway and
the key as in quickstart.py.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import quayutec_client
from quayutec_client.types import RoomEvent, RoomEventKind


def load_cursor(path: Path) -> int:
    return int(path.read_text()) if path.exists() else 0  # 0: from the oldest event kept


def save_cursor(path: Path, cursor: int) -> None:
    path.write_text(str(cursor))


def handle(event: RoomEvent) -> None:
    """Your work for one event; here, a line of output."""
    what = event.WhichOneof("detail")
    body = event.message.body if what == "message" else what
    print(f"[{event.cursor}] {RoomEventKind.Name(event.kind).removeprefix('ROOM_EVENT_KIND_').lower()}: {body}")


async def main() -> None:
    room_id = os.environ["QUAYUTEC_ROOM_ID"]
    cursor_file = Path(os.environ.get("QUAYUTEC_CURSOR_FILE", f"room-{room_id}.cursor"))
    after = load_cursor(cursor_file)
    limit = int(os.environ.get("QUAYUTEC_MAX_EVENTS", "0"))

    async with (
        quayutec_client.connect(
            os.environ.get("QUAYUTEC_GATEWAY_ADDR", "localhost:50051"),
            os.environ["QUAYUTEC_API_KEY"],
            plaintext=os.environ.get("QUAYUTEC_PLAINTEXT") == "1",
        ) as client,
        client.watch(room_id, after=after) as events,
    ):
        seen = 0
        async for event in events:
            handle(event)
            # Stored once the event is handled: a crash between the two handles it again on restart.
            # Keep the cursor in the same transaction as what handling writes to have it exactly once.
            save_cursor(cursor_file, event.cursor)
            seen += 1
            if seen == limit:
                break


if __name__ == "__main__":
    asyncio.run(main())
