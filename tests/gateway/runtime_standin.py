"""A real grpc.aio RuntimeService standing in for the Runtime (a downstream) in delivery tests.

It claims each wake through a real Claims server and, when this call claimed it, records the
run's first ledger row in a real Room as the Runtime's run would (RUNNING, this call's claimant
token as its attempt; a DECISION wake's parked row is left as it is), then answers ACCEPTED; a wake
claimed before is answered ALREADY_CLAIMED. It runs nothing and takes nothing over. A script per
wake can first answer errors, or hang, so tests can drive the delivery loop's retries, leases and
shutdown. Every call is recorded.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from quayutec.authz import AuthzInterceptor
from quayutec.ledger import run_id_for
from quayutec.v1 import (
    claims_pb2,
    claims_pb2_grpc,
    common_pb2,
    room_pb2,
    room_pb2_grpc,
    runtime_pb2,
    runtime_pb2_grpc,
)
from tests.harness.channels import pki_identity, service_channel

ACCEPTED = runtime_pb2.START_RUN_RESULT_ACCEPTED
ALREADY_CLAIMED = runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED


async def record_first_row(
    room: room_pb2_grpc.RoomServiceStub, request: runtime_pb2.StartRunRequest, token: str
) -> None:
    """The first ledger row of the run of ``request``'s wake, as the Runtime's run records it with its
    room read (RUNNING, the claimed step, ``token`` as its attempt); ``room`` called as "runtime"."""
    row = common_pb2.Run(
        run_id=run_id_for(request.agent_id, request.wake_id),
        agent_id=request.agent_id,
        room_id=request.room_id,
        wake_id=request.wake_id,
        wake_kind=request.wake_kind,
        wake_source_id=request.wake_source_id,
        status=common_pb2.RUN_STATUS_RUNNING,
        step=common_pb2.RUN_STEP_CLAIMED,
        attempt=token,
    )
    await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=row), timeout=10)


@dataclass(frozen=True)
class Call:
    """One StartRun the stand-in received, and what it answered ("ACCEPTED", "UNAVAILABLE", ...)."""

    request: runtime_pb2.StartRunRequest
    answer: str
    peer: str


class StandinRuntime:
    """Answers StartRun by claiming through Claims, after any scripted failures for the wake (and
    has no StartRuns, like a Runtime of before it)."""

    def __init__(self, claims: claims_pb2_grpc.ClaimsServiceStub, room: room_pb2_grpc.RoomServiceStub) -> None:
        self._claims = claims
        self._room = room
        self.calls: list[Call] = []
        # Steps per wake, one used per call, before the normal claim-and-answer:
        # "UNAVAILABLE" or "RESOURCE_EXHAUSTED" (answered without claiming), "HANG" (never answers,
        # claims nothing), "CLAIM_THEN_HANG" (claims, then never answers: a Runtime stopped mid-call),
        # "ROW_HELD" (ALREADY_CLAIMED with row_held, as a fenced Runtime answers; claims and records nothing).
        self._scripts: defaultdict[str, list[str]] = defaultdict(list)
        self.changed = asyncio.Event()

    def script(self, wake_id: str, *answers: str) -> None:
        self._scripts[wake_id].extend(answers)

    def _record(self, request: runtime_pb2.StartRunRequest, answer: str, context: Any) -> None:
        self.calls.append(Call(request=request, answer=answer, peer=context.peer()))
        self.changed.set()

    def answers(self, answer: str) -> Counter[str]:
        """How many times each wake got ``answer``."""
        return Counter(c.request.wake_id for c in self.calls if c.answer == answer)

    async def StartRun(self, request: runtime_pb2.StartRunRequest, context: Any) -> runtime_pb2.StartRunResponse:
        scripted = self._scripts[request.wake_id]
        step = scripted.pop(0) if scripted else ""
        if step == "HANG":
            self._record(request, "HANG", context)
            await asyncio.Event().wait()
        if step in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):
            self._record(request, step, context)
            await context.abort(getattr(grpc.StatusCode, step), f"stand-in runtime scripted {step}")
        if step == "ROW_HELD":
            self._record(request, step, context)
            run_id = run_id_for(request.agent_id, request.wake_id)
            return runtime_pb2.StartRunResponse(result=ALREADY_CLAIMED, run_id=run_id, row_held=True)
        token = uuid.uuid4().hex
        claim = await self._claims.ClaimOnce(
            claims_pb2.ClaimOnceRequest(agent_id=request.agent_id, wake_id=request.wake_id, claimant=token), timeout=10
        )
        run_id = run_id_for(request.agent_id, request.wake_id)
        if claim.claimed and request.wake_kind != common_pb2.WAKE_KIND_DECISION:
            await record_first_row(self._room, request, token)
        if step == "CLAIM_THEN_HANG":
            self._record(request, "CLAIMED_THEN_HANG" if claim.claimed else "ALREADY_CLAIMED_THEN_HANG", context)
            await asyncio.Event().wait()
        result = ACCEPTED if claim.claimed else ALREADY_CLAIMED
        self._record(request, runtime_pb2.StartRunResult.Name(result).removeprefix("START_RUN_RESULT_"), context)
        return runtime_pb2.StartRunResponse(result=result, run_id=run_id)

    async def wait_until(self, predicate: Callable[[], bool], within: float = 60.0) -> None:
        """Wait for ``predicate()`` to hold, re-checking after every call; fails after ``within`` seconds."""
        async with asyncio.timeout(within):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


class BatchingStandinRuntime(StandinRuntime, runtime_pb2_grpc.RuntimeServiceServicer):
    """Also answers StartRuns: each item as StartRun answers it (its scripted errors become the
    item's error; a scripted hang holds the whole call), the items claimed concurrently. Every
    call's wake ids are recorded in ``batches``; its items in ``calls`` like StartRun's."""

    def __init__(self, claims: claims_pb2_grpc.ClaimsServiceStub, room: room_pb2_grpc.RoomServiceStub) -> None:
        super().__init__(claims, room)
        self.batches: list[list[str]] = []
        self.traceparents: dict[str, str] = {}
        # While cleared, every StartRuns call is recorded and then held until it is set.
        self.open = asyncio.Event()
        self.open.set()

    async def StartRuns(self, request: runtime_pb2.StartRunsRequest, context: Any) -> runtime_pb2.StartRunsResponse:
        self.batches.append([item.request.wake_id for item in request.items])
        self.changed.set()
        await self.open.wait()
        for item in request.items:
            self.traceparents[item.request.wake_id] = item.traceparent
        answers = await asyncio.gather(*(self._item(item.request, context) for item in request.items))
        return runtime_pb2.StartRunsResponse(answers=answers)

    async def _item(self, request: runtime_pb2.StartRunRequest, context: Any) -> runtime_pb2.StartRunsAnswer:
        scripted = self._scripts[request.wake_id]
        step = scripted.pop(0) if scripted else ""
        if step in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):
            self._record(request, step, context)
            code = getattr(grpc.StatusCode, step)
            return runtime_pb2.StartRunsAnswer(
                error_code=code.value[0], error_message=f"stand-in runtime scripted {step}"
            )
        if step:  # a hang: StartRun plays it, holding the whole call
            scripted.insert(0, step)
        response = await self.StartRun(request, context)
        return runtime_pb2.StartRunsAnswer(response=response)


@asynccontextmanager
async def running_standin_runtime(
    claims_addr: str, room_addr: str, *, port: int = 0, batching: bool = False
) -> AsyncIterator[tuple[str, StandinRuntime]]:
    """Yields ("127.0.0.1:PORT", servicer) of a started stand-in Runtime: like the real one, it serves
    mutual TLS as "runtime" (admitting callers per quayutec.authz), claims and records as "runtime".
    Without ``batching`` it has no StartRuns (UNIMPLEMENTED, as an older Runtime answers)."""
    async with (
        service_channel(claims_addr, "runtime") as channel,
        service_channel(room_addr, "runtime") as room_channel,
    ):
        stub = claims_pb2_grpc.ClaimsServiceStub(channel)
        room = room_pb2_grpc.RoomServiceStub(room_channel)
        server = grpc.aio.server(interceptors=(AuthzInterceptor(),))
        servicer: StandinRuntime
        if batching:
            servicer = batching_servicer = BatchingStandinRuntime(stub, room)
            runtime_pb2_grpc.add_RuntimeServiceServicer_to_server(batching_servicer, server)
        else:  # only StartRun is registered: StartRuns answers UNIMPLEMENTED ("Method not found!")
            servicer = StandinRuntime(stub, room)
            start_run = grpc.unary_unary_rpc_method_handler(
                servicer.StartRun,
                request_deserializer=runtime_pb2.StartRunRequest.FromString,
                response_serializer=runtime_pb2.StartRunResponse.SerializeToString,
            )
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler("quayutec.v1.RuntimeService", {"StartRun": start_run}),)
            )
        bound = server.add_secure_port(f"127.0.0.1:{port}", pki_identity("runtime").server_credentials())
        await server.start()
        try:
            yield f"127.0.0.1:{bound}", servicer
        finally:
            await server.stop(0)
