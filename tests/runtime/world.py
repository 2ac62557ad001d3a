"""A small world for run tests: two companies, a room, an agent each, on real servers."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import grpc

from quayutec.config import ROOM
from quayutec.v1 import claims_pb2_grpc, common_pb2, room_pb2, room_pb2_grpc, runtime_pb2, runtime_pb2_grpc
from services.runtime.standin import ScriptedReply, StandinProvider
from tests.harness.channels import open_callers_stub, service_channel
from tests.harness.room import add_member

ENDED = (
    common_pb2.RUN_STATUS_SUCCEEDED,
    common_pb2.RUN_STATUS_FAILED,
    common_pb2.RUN_STATUS_TIMED_OUT,
)


# How long a held reply waits at most when a test never lets it go (a failsafe, not a timing).
HELD_REPLY_FAILSAFE_SECONDS = 120.0


@contextmanager
def held_replies(standin: StandinProvider, model: str, text: str = "slow") -> Iterator[threading.Event]:
    """The stand-in holds every reply to ``model`` until the test sets the yielded event, so a run
    stays in its model call exactly as long as the test needs (and no longer: leaving lets go)."""
    release = threading.Event()

    def reply(_: Mapping[str, object]) -> ScriptedReply:
        release.wait(HELD_REPLY_FAILSAFE_SECONDS)
        return ScriptedReply(text)

    standin.set_responder(model, reply)
    try:
        yield release
    finally:
        release.set()
        standin.set_responder(model, None)


@dataclass
class FakeClock:
    """A Runtime's clock that records waits instead of sleeping; with each wait it also notes what
    ``witness()`` answers then (e.g. how many model requests were made before it)."""

    sleeps: list[float] = field(default_factory=list)
    witness: Callable[[], object] | None = None
    witnessed: list[object] = field(default_factory=list)

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        if self.witness is not None:
            self.witnessed.append(self.witness())

    def monotonic(self) -> float:
        return 0.0


@dataclass
class World:
    room: room_pb2_grpc.RoomServiceAsyncStub
    claims: claims_pb2_grpc.ClaimsServiceAsyncStub
    company_a: str
    company_b: str
    room_id: str
    agent_a: common_pb2.Agent
    agent_b: common_pb2.Agent

    @property
    def model_a(self) -> str:
        return self.agent_a.model

    async def post(self, body: str, mention: list[str], person: str = "ana") -> room_pb2.RoomServicePostMessageResponse:
        author = common_pb2.Author(kind=common_pb2.AUTHOR_KIND_PERSON, company_id=self.company_a, person=person)
        posted: room_pb2.RoomServicePostMessageResponse = await self.room.PostMessage(
            room_pb2.RoomServicePostMessageRequest(
                room_id=self.room_id, author=author, body=body, mention_agent_ids=mention
            )
        )
        return posted

    async def register_own_model(self, base_url: str, model: str = "own-model-1") -> common_pb2.Agent:
        """An agent of company A on an OpenAI-compatible model at an owner-supplied ``base_url``."""
        got = await self.room.RegisterAgent(
            room_pb2.RoomServiceRegisterAgentRequest(
                company_id=self.company_a,
                name="own-model",
                provider=common_pb2.PROVIDER_OPENAI_COMPATIBLE,
                model=model,
                base_url=base_url,
                provider_key="own-secret",
            )
        )
        agent: common_pb2.Agent = got.agent
        return agent

    async def messages_by(self, agent_id: str) -> list[common_pb2.Message]:
        got = await self.room.ListMessages(room_pb2.RoomServiceListMessagesRequest(room_id=self.room_id, page_size=500))
        return [m for m in got.messages if m.author.agent_id == agent_id]

    async def memory(self, company_id: str) -> list[common_pb2.MemoryLine]:
        got = await self.room.ListMemory(
            room_pb2.RoomServiceListMemoryRequest(room_id=self.room_id, reader_company_id=company_id, page_size=500)
        )
        return list(got.lines)

    async def tasks_for(self, agent_id: str) -> list[common_pb2.Task]:
        got = await self.room.ListTasks(
            room_pb2.RoomServiceListTasksRequest(room_id=self.room_id, to_agent_id=agent_id, page_size=500)
        )
        return list(got.tasks)

    async def run(self, run_id: str) -> common_pb2.Run:
        got: room_pb2.RoomServiceGetRunResponse = await self.room.GetRun(
            room_pb2.RoomServiceGetRunRequest(run_id=run_id)
        )
        return got.run

    async def wait_for_run(self, run_id: str, statuses: tuple[int, ...] = ENDED, limit: float = 60.0) -> common_pb2.Run:
        """Poll the ledger until the run reaches one of ``statuses`` (bounded; not a timing assertion)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while True:
            try:
                run = await self.run(run_id)
                if run.status in statuses:
                    return run
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
            if loop.time() > deadline:
                raise AssertionError(f"run {run_id} did not reach {statuses} within {limit} s")
            await asyncio.sleep(0.05)


async def make_world(room_addr: str, claims_addr: str, channels: list[grpc.aio.Channel]) -> World:
    room_stub, room_channels = open_callers_stub(room_addr, ROOM.grpc_service, room_pb2_grpc.RoomServiceStub)
    claims_channel = service_channel(claims_addr, "runtime")
    channels.extend([*room_channels, claims_channel])
    room = cast("room_pb2_grpc.RoomServiceAsyncStub", room_stub)
    tag = uuid.uuid4().hex[:8]
    a = (await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name=f"Acme {tag}"))).company
    b = (await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name=f"Bolt {tag}"))).company
    r = (await room.CreateRoom(room_pb2.RoomServiceCreateRoomRequest(company_id=a.company_id, name="launch"))).room
    await add_member(room, r.room_id, b.company_id, invited_by=a.company_id)
    agent_a = (
        await room.RegisterAgent(
            room_pb2.RoomServiceRegisterAgentRequest(
                company_id=a.company_id,
                name="planner",
                provider=common_pb2.PROVIDER_ANTHROPIC,
                model=f"claude-test-{tag}",
                provider_key=f"sk-ant-secret-{tag}",
                system_prompt="You plan launches.",
            )
        )
    ).agent
    agent_b = (
        await room.RegisterAgent(
            room_pb2.RoomServiceRegisterAgentRequest(
                company_id=b.company_id,
                name="writer",
                provider=common_pb2.PROVIDER_OPENAI,
                model=f"gpt-test-{tag}",
                provider_key=f"sk-openai-secret-{tag}",
                system_prompt="You write copy.",
            )
        )
    ).agent
    return World(
        room=room,
        claims=cast("claims_pb2_grpc.ClaimsServiceAsyncStub", claims_pb2_grpc.ClaimsServiceStub(claims_channel)),
        company_a=a.company_id,
        company_b=b.company_id,
        room_id=r.room_id,
        agent_a=agent_a,
        agent_b=agent_b,
    )


def start_request(wake: common_pb2.Wake) -> runtime_pb2.StartRunRequest:
    return runtime_pb2.StartRunRequest(
        agent_id=wake.agent_id,
        wake_id=wake.wake_id,
        room_id=wake.room_id,
        wake_kind=wake.kind,
        wake_source_id=wake.source_id,
    )


def runtime_stub(addr: str, channels: list[grpc.aio.Channel]) -> Any:
    channel = service_channel(addr, "gateway")
    channels.append(channel)
    return runtime_pb2_grpc.RuntimeServiceStub(channel)
