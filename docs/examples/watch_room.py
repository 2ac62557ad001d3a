"""Watch a room with WatchRoom, stop, and resume where the stream left off: the messages posted
while nobody watched arrive once each, none twice, none missed.

Needs `pip install grpcio protobuf` and Python code generated from protos/quayutec/v1 (this
repository ships it as the `quayutec.v1` package).
"""

from __future__ import annotations

import asyncio
import os

import grpc

from quayutec.v1 import gateway_pb2, gateway_pb2_grpc


async def watch_until_caught_up(
    gw: gateway_pb2_grpc.GatewayServiceStub, room_id: str, after: int, metadata: tuple[tuple[str, str], ...]
) -> tuple[list[str], int]:
    """The bodies of the messages after cursor ``after``, and the cursor to resume after. The first
    heartbeat says the replay has caught up; a real watcher would go on reading the live events."""
    bodies, cursor = [], after
    stream = gw.WatchRoom(gateway_pb2.WatchRoomRequest(room_id=room_id, after=after), metadata=metadata)
    async for item in stream:
        for event in item.events:
            cursor = event.cursor  # remember the last cursor received, event or heartbeat
            if event.HasField("message"):
                bodies.append(event.message.body)
        if item.HasField("heartbeat"):
            cursor = item.heartbeat.cursor
            break
    stream.cancel()  # as a dropped connection would end it
    return bodies, cursor


async def main() -> None:
    addr = os.environ.get("QUAYUTEC_GATEWAY_ADDR", "localhost:50051")
    metadata = (("authorization", f"Bearer {os.environ['QUAYUTEC_API_KEY']}"),)
    async with grpc.aio.insecure_channel(addr) as channel:  # grpc.aio.secure_channel(...) for a TLS Gateway
        gw = gateway_pb2_grpc.GatewayServiceStub(channel)
        room = (await gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="watched"), metadata=metadata)).room
        print(f"room {room.room_id}")

        async def post(body: str) -> None:
            request = gateway_pb2.PostMessageRequest(room_id=room.room_id, person="ana", body=body)
            await gw.PostMessage(request, metadata=metadata)

        await post("one")
        # after=0: from the oldest event kept (unset: from now).
        seen, cursor = await watch_until_caught_up(gw, room.room_id, 0, metadata)
        print(f"watched: {seen}")

        # Nobody watches while these are posted; resuming after the last cursor delivers them.
        await post("two")
        await post("three")
        seen, cursor = await watch_until_caught_up(gw, room.room_id, cursor, metadata)
        print(f"resumed: {seen}")

        # A room your company is not a member of ends the stream with NOT_FOUND.
        try:
            async for _ in gw.WatchRoom(
                gateway_pb2.WatchRoomRequest(room_id="00000000-0000-0000-0000-000000000000"), metadata=metadata
            ):
                pass
        except grpc.aio.AioRpcError as exc:
            print(f"unknown room: {exc.code().name}")


if __name__ == "__main__":
    asyncio.run(main())
