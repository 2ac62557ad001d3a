"""Runtime's retries of Room calls, against a real Room server stopped and started on one port:
a write with a dedupe key rides out the outage and is written once; one without is tried once."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from quayutec.config import ROOM
from quayutec.v1 import common_pb2, room_pb2, room_pb2_grpc
from services.runtime.backend import RetryingRoom
from services.stack import free_port
from tests.harness.channels import callers_stub, service_channel
from tests.harness.room import running_room

# The channel tries to reconnect often, so a call soon finds the restarted server.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 300)]


async def test_deduped_writes_and_reads_are_retried_and_others_are_not(database_url: str) -> None:
    port = free_port()
    listen = f"127.0.0.1:{port}"
    addr = f"127.0.0.1:{port}"
    async with (
        service_channel(addr, "runtime", options=FAST_RECONNECT) as channel,
        callers_stub(addr, ROOM.grpc_service, room_pb2_grpc.RoomServiceStub) as admin,
    ):
        room = RetryingRoom(room_pb2_grpc.RoomServiceStub(channel), retry_seconds=30.0)
        async with running_room(database_url, QUAYUTEC_ROOM_LISTEN=listen):
            company = (await admin.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name="Acme"))).company
            created = await admin.CreateRoom(
                room_pb2.RoomServiceCreateRoomRequest(company_id=company.company_id, name="launch")
            )
        room_id = created.room.room_id
        author = common_pb2.Author(kind=common_pb2.AUTHOR_KIND_PERSON, company_id=company.company_id, person="ana")

        def message(body: str, dedupe_key: str = "") -> room_pb2.RoomServicePostMessageRequest:
            return room_pb2.RoomServicePostMessageRequest(
                room_id=room_id, author=author, body=body, dedupe_key=dedupe_key
            )

        # Room is down. A write without a dedupe key is tried once and fails at once.
        with pytest.raises(grpc.aio.AioRpcError) as once:
            await room.PostMessage(message("not retried"), timeout=2.0)
        assert once.value.code() == grpc.StatusCode.UNAVAILABLE
        # A deduped write and a read keep trying while Room is down ...
        write = asyncio.create_task(room.PostMessage(message("retried", "key-1"), timeout=2.0))
        read = asyncio.create_task(room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id="run-none"), timeout=2.0))
        await asyncio.sleep(0.5)
        assert not write.done() and not read.done()
        # ... and are answered once Room is back on the same port.
        async with running_room(database_url, QUAYUTEC_ROOM_LISTEN=listen):
            posted = await asyncio.wait_for(write, 30)
            with pytest.raises(grpc.aio.AioRpcError) as answered:
                await asyncio.wait_for(read, 30)
            assert answered.value.code() == grpc.StatusCode.NOT_FOUND  # Room's answer, not the outage
            again = await room.PostMessage(message("retried", "key-1"), timeout=2.0)
            listed = await admin.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=room_id))
    assert again.deduplicated and again.message.message_id == posted.message.message_id
    assert [m.body for m in listed.messages] == ["retried"]
