"""Call the Gateway from Python: who am I, a room, a message posted twice with one idempotency key
(posted once), every message page by page, and an error read as a gRPC status.

Needs `pip install grpcio protobuf` and Python code generated from protos/quayutec/v1 (this
repository ships it as the `quayutec.v1` package).
"""

from __future__ import annotations

import asyncio
import os

import grpc

from quayutec.v1 import gateway_pb2, gateway_pb2_grpc


async def main() -> None:
    addr = os.environ.get("QUAYUTEC_GATEWAY_ADDR", "localhost:50051")
    metadata = (("authorization", f"Bearer {os.environ['QUAYUTEC_API_KEY']}"),)
    async with grpc.aio.insecure_channel(addr) as channel:  # grpc.aio.secure_channel(...) for a TLS Gateway
        gw = gateway_pb2_grpc.GatewayServiceStub(channel)

        me = await gw.WhoAmI(gateway_pb2.WhoAmIRequest(), metadata=metadata)
        print(f"company {me.company.company_id} {me.company.name}")

        room = (await gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="from-python"), metadata=metadata)).room
        print(f"room {room.room_id}")

        # A retry with the same idempotency key returns the first message; nothing is posted twice.
        post = gateway_pb2.PostMessageRequest(room_id=room.room_id, person="ana", body="hello", idempotency_key="k1")
        first = (await gw.PostMessage(post, metadata=metadata)).message
        again = (await gw.PostMessage(post, metadata=metadata)).message
        print(f"posted {first.message_id}; the retry returned the same message: {again.message_id == first.message_id}")
        await gw.PostMessage(
            gateway_pb2.PostMessageRequest(room_id=room.room_id, person="ana", body="second"), metadata=metadata
        )

        # Pages: pass next_page_token back until it comes back empty.
        token, bodies = "", []
        while True:
            page = await gw.ListMessages(
                gateway_pb2.ListMessagesRequest(room_id=room.room_id, page_size=1, page_token=token),
                metadata=metadata,
            )
            bodies += [m.body for m in page.messages]
            token = page.next_page_token
            if not token:
                break
        print(f"messages, one page each: {bodies}")

        # Errors are gRPC status codes with a message saying what to fix.
        try:
            await gw.ListMessages(
                gateway_pb2.ListMessagesRequest(room_id="00000000-0000-0000-0000-000000000000"), metadata=metadata
            )
        except grpc.aio.AioRpcError as exc:
            print(f"unknown room: {exc.code().name}")


if __name__ == "__main__":
    asyncio.run(main())
