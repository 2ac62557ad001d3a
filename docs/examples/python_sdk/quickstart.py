"""Quayutec rooms from Python with quayutec-client: connect, post a message that wakes an agent,
follow the room until the agent's run ends (two minutes at most), and read an error.

Needs `pip install ./clients/python` (it brings grpcio and protobuf, nothing else). The Gateway's
address comes from QUAYUTEC_GATEWAY_ADDR, your API key from QUAYUTEC_API_KEY and the agent's model
provider key from QUAYUTEC_PROVIDER_KEY; QUAYUTEC_PLAINTEXT=1 for a Gateway on your machine without TLS.
"""

from __future__ import annotations

import asyncio
import os
import sys

import quayutec_client
from quayutec_client import errors
from quayutec_client.types import RoomEventKind, RunStatus


async def main() -> None:
    async with quayutec_client.connect(
        os.environ.get("QUAYUTEC_GATEWAY_ADDR", "localhost:50051"),
        os.environ["QUAYUTEC_API_KEY"],
        plaintext=os.environ.get("QUAYUTEC_PLAINTEXT") == "1",
    ) as client:
        me = await client.who_am_i()
        print(f"company {me.name}")
        room = await client.create_room("launch")
        writer = await client.register_agent(
            "writer", provider="anthropic", model="claude-sonnet-4-5", provider_key=os.environ["QUAYUTEC_PROVIDER_KEY"]
        )

        async with client.watch(room.room_id) as events:  # the room's events from now on
            # The mention wakes the writer once. If the call is retried (the client does so by
            # itself after UNAVAILABLE), every attempt carries the same idempotency key.
            posted = await client.post_message(
                room.room_id, "@writer draft the launch note", person="ana", mentions=[writer.agent_id]
            )
            print(f"posted #{posted.message.seq}, waking {len(posted.wake_ids)} agent")
            # Follow the room until the run of that wake ends (its RUN_ENDED event), whatever the
            # outcome: a run that fails ends too, and so does this program, within two minutes.
            async with asyncio.timeout(120):
                async for event in events:
                    if event.kind == RoomEventKind.ROOM_EVENT_KIND_RUN_ENDED and event.run.wake_id in posted.wake_ids:
                        break
            if event.run.status != RunStatus.RUN_STATUS_SUCCEEDED:
                sys.exit(f"the writer's run ended {RunStatus.Name(event.run.status)}: {event.run.error}")
            print(f"the writer answered (run {event.run.run_id})")

        try:
            await client.post_message(room.room_id, "", person="ana")
        except errors.InvalidArgument as exc:
            print(f"refused: {exc.code.name}: {exc.message}")


if __name__ == "__main__":
    asyncio.run(main())
