"""docs/examples/python_sdk/quickstart.py written against the raw gRPC API, with the same guarantees:
the key on every call, one idempotency key per post reused on its retries, retries with backoff and
jitter on UNAVAILABLE, DEADLINE_EXCEEDED and RESOURCE_EXHAUSTED (honouring retry-after-ms), and a
watch that opens again after its last cursor when the stream drops. bench/clients.py runs both and
counts their lines; it prints the same lines as the quickstart.
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from quayutec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


async def retried(call: Callable[[], Awaitable[Any]], attempts: int = 6, total: float = 60.0) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in RETRYABLE or attempt == attempts:
                raise
            ceiling = min(5.0, 0.2 * 2 ** (attempt - 1))
            wait = random.uniform(ceiling / 2, ceiling)
            for key, value in exc.trailing_metadata() or ():
                if key == "retry-after-ms" and str(value).isdigit():
                    wait = max(wait, int(value) / 1000 * random.uniform(1.0, 1.2))
            if loop.time() + wait >= deadline:
                raise
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")


async def main() -> None:
    addr = os.environ.get("QUAYUTEC_GATEWAY_ADDR", "localhost:50051")
    metadata = (("authorization", f"Bearer {os.environ['QUAYUTEC_API_KEY']}"),)
    if os.environ.get("QUAYUTEC_PLAINTEXT") == "1":
        channel = grpc.aio.insecure_channel(addr)
    else:
        channel = grpc.aio.secure_channel(addr, grpc.ssl_channel_credentials())
    async with channel:
        gw = gateway_pb2_grpc.GatewayServiceStub(channel)

        def unary(method: Any, request: Any) -> Awaitable[Any]:
            return retried(lambda: method(request, metadata=metadata, timeout=15, wait_for_ready=True))

        me = await unary(gw.WhoAmI, gateway_pb2.WhoAmIRequest())
        print(f"company {me.company.name}")
        room = (await unary(gw.CreateRoom, gateway_pb2.CreateRoomRequest(name="launch"))).room
        writer = (
            await unary(
                gw.RegisterAgent,
                gateway_pb2.RegisterAgentRequest(
                    name="writer",
                    provider=common_pb2.PROVIDER_ANTHROPIC,
                    model="claude-sonnet-4-5",
                    provider_key=os.environ["QUAYUTEC_PROVIDER_KEY"],
                ),
            )
        ).agent

        stream = gw.WatchRoom(gateway_pb2.WatchRoomRequest(room_id=room.room_id), metadata=metadata)
        cursor = (await stream.read()).heartbeat.cursor  # from now on: the first answer is a heartbeat
        post = gateway_pb2.PostMessageRequest(
            room_id=room.room_id,
            person="ana",
            body="@writer draft the launch note",
            mention_agent_ids=[writer.agent_id],
            idempotency_key=str(uuid.uuid4()),
        )
        posted = await unary(gw.PostMessage, post)
        print(f"posted #{posted.message.seq}, waking {len(posted.wake_ids)} agent")
        while True:
            try:
                item = await stream.read()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise
                item = grpc.aio.EOF
            if item is grpc.aio.EOF:  # dropped: watch again after the last cursor seen
                await asyncio.sleep(random.uniform(0.1, 0.2))
                request = gateway_pb2.WatchRoomRequest(room_id=room.room_id, after=cursor)
                stream = gw.WatchRoom(request, metadata=metadata)
                continue
            if item.HasField("heartbeat"):
                cursor = max(cursor, item.heartbeat.cursor)
            new = [e for e in item.events if e.cursor > cursor]
            cursor = max([cursor, *(e.cursor for e in new)])
            replies = [
                e for e in new if e.kind == common_pb2.ROOM_EVENT_KIND_MESSAGE_POSTED and e.message.author.agent_id
            ]
            if replies:
                print(f"the writer answered (run {replies[0].message.run_id})")
                break
        stream.cancel()

        try:
            await unary(gw.PostMessage, gateway_pb2.PostMessageRequest(room_id=room.room_id, person="ana", body=""))
        except grpc.aio.AioRpcError as exc:
            print(f"refused: {exc.code().name}: {exc.details()}")


if __name__ == "__main__":
    asyncio.run(main())
