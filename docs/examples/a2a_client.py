"""Hand work to a room's agent with the official A2A SDK over gRPC: read its card, send it a task,
send the same message again (the same task comes back), read the task, cancel it, and read an A2A error.

Needs `pip install "a2a-sdk[grpc]==1.3.0"`; nothing of this repository. The tenant names the room
and the agent: rooms/<room id>/agents/<agent id>.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import grpc
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.client.client_factory import minimal_agent_card
from a2a.types import a2a_pb2
from a2a.utils.errors import TaskNotFoundError


async def main() -> None:
    addr = os.environ.get("QUAYUTEC_GATEWAY_ADDR", "localhost:50051")
    key = ClientCallContext(service_parameters={"authorization": f"Bearer {os.environ['QUAYUTEC_API_KEY']}"})
    card = minimal_agent_card(addr, ["GRPC"])
    card.supported_interfaces[0].tenant = os.environ["QUAYUTEC_A2A_TENANT"]
    # polling=True: SendMessage returns at once (return_immediately); without it, it waits for the agent.
    config = ClientConfig(
        supported_protocol_bindings=["GRPC"],
        streaming=False,
        polling=True,
        grpc_channel_factory=grpc.aio.insecure_channel,
    )
    client = ClientFactory(config).create(card)
    try:
        card = await client.get_extended_agent_card(a2a_pb2.GetExtendedAgentCardRequest(), context=key)
        print(f"agent {card.name} of {card.provider.organization}")

        message = a2a_pb2.Message(
            message_id=str(uuid.uuid4()), role=a2a_pb2.ROLE_USER, parts=[a2a_pb2.Part(text="Summarise the offer")]
        )
        sent = [e.task async for e in client.send_message(a2a_pb2.SendMessageRequest(message=message), context=key)]
        # The messageId is the idempotency key: a retry returns the same task and wakes the agent once.
        again = [e.task async for e in client.send_message(a2a_pb2.SendMessageRequest(message=message), context=key)]
        print(
            f"task {a2a_pb2.TaskState.Name(sent[0].status.state)}; the retry returned it: {again[0].id == sent[0].id}"
        )

        task = await client.get_task(a2a_pb2.GetTaskRequest(id=sent[0].id), context=key)
        canceled = await client.cancel_task(a2a_pb2.CancelTaskRequest(id=task.id), context=key)
        print(f"canceled: {a2a_pb2.TaskState.Name(canceled.status.state)}")

        try:
            await client.get_task(a2a_pb2.GetTaskRequest(id=str(uuid.uuid4())), context=key)
        except TaskNotFoundError as exc:
            print(f"unknown task: {type(exc).__name__}")
    finally:
        await client.close()


if __name__ == "__main__":
    asyncio.run(main())
