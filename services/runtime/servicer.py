"""RuntimeService: a thin adapter from StartRun to the run executor."""

from __future__ import annotations

from typing import Any

from quayutec.v1 import runtime_pb2, runtime_pb2_grpc
from services.runtime.run import RunExecutor, Wake


class RuntimeServicer(runtime_pb2_grpc.RuntimeServiceServicer):
    def __init__(self, executor: RunExecutor) -> None:
        self._executor = executor

    async def StartRun(self, request: runtime_pb2.StartRunRequest, context: Any) -> runtime_pb2.StartRunResponse:
        result, run_id = await self._executor.start(Wake.from_request(request), time_left=context.time_remaining())
        return runtime_pb2.StartRunResponse(result=result, run_id=run_id)
