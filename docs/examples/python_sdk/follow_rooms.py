"""Follow every room of your company in one stream and keep your place: each event is printed once,
and the cursors (room id -> cursor) are written to a file after each, so a restart of this program
carries on after them, missing and repeating nothing; a room your company joined meanwhile is followed
from its joining.

QUAYUTEC_CURSOR_FILE names the file (default rooms.cursors.json), and QUAYUTEC_MAX_EVENTS stops after
that many events (unset: follow until interrupted). The Gateway and the key as in quickstart.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import quayutec_client
from quayutec_client.types import RoomEvent, RoomEventKind


def load_cursors(path: Path) -> dict[str, int]:
    # No file yet: {} (every room from your company's joining; None would mean from now).
    return json.loads(path.read_text()) if path.exists() else {}


def save_cursors(path: Path, cursors: dict[str, int]) -> None:
    path.write_text(json.dumps(cursors))


def handle(event: RoomEvent) -> None:
    """Your work for one event; here, a line of output."""
    what = event.WhichOneof("detail")
    body = event.message.body if what == "message" else what
    kind = RoomEventKind.Name(event.kind).removeprefix("ROOM_EVENT_KIND_").lower()
    print(f"{event.room_id} [{event.cursor}] {kind}: {body}")


async def main() -> None:
    cursor_file = Path(os.environ.get("QUAYUTEC_CURSOR_FILE", "rooms.cursors.json"))
    limit = int(os.environ.get("QUAYUTEC_MAX_EVENTS", "0"))

    async with (
        quayutec_client.connect(
            os.environ.get("QUAYUTEC_GATEWAY_ADDR", "localhost:50051"),
            os.environ["QUAYUTEC_API_KEY"],
            plaintext=os.environ.get("QUAYUTEC_PLAINTEXT") == "1",
        ) as client,
        client.watch_rooms(after=load_cursors(cursor_file)) as events,
    ):
        seen = 0
        async for event in events:
            handle(event)
            # Stored once the event is handled, as in follow.py: every room's cursor, so rooms joined
            # since are told apart from rooms already followed.
            save_cursors(cursor_file, events.cursors)
            seen += 1
            if seen == limit:
                break


if __name__ == "__main__":
    asyncio.run(main())
