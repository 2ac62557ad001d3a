"""A Gateway client for the CLI and the demo: every call carries the company's API key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from quayutec.v1 import common_pb2, gateway_pb2_grpc

API_KEY_ENV = "QUAYUTEC_API_KEY"


class GatewayClient:
    """``client.PostMessage(request)`` and so on, authenticated as one company."""

    def __init__(self, channel: grpc.aio.Channel, api_key: str) -> None:
        self._stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._stub, name)

        def call(request: Any, **kwargs: Any) -> Any:
            return method(request, metadata=self._metadata, **kwargs)

        return call


NOT_TRACED = "(not traced)"
STATUS_NAMES = {v: k.removeprefix("RUN_STATUS_").lower() for k, v in common_pb2.RunStatus.items()}
STEP_NAMES = {v: k.removeprefix("RUN_STEP_").lower() for k, v in common_pb2.RunStep.items()}
OUTCOME_NAMES = {v: k.removeprefix("ACTION_OUTCOME_").lower() for k, v in common_pb2.ActionOutcome.items()}
ACTION_NAMES = {v: k.removeprefix("ACTION_KIND_").lower() for k, v in common_pb2.ActionKind.items()}


def format_run(run: common_pb2.Run) -> str:
    """A run's ledger row as a person reads it: what was posted, written, not written, each request."""
    lines = [
        f"run {run.run_id}  status={STATUS_NAMES[run.status]}  last step={STEP_NAMES[run.step]}",
        f"  agent {run.agent_id}  wake {run.wake_id}  active {run.active_ms} ms",
        f"  trace {run.trace_id or NOT_TRACED}",
        f"  posted: {run.posted_message_id or 'nothing'}",
    ]
    for action in run.actions:
        detail = f" ({action.detail})" if action.detail else ""
        if action.rule:
            detail += f" [rule {action.rule}]"
        result = f" -> {action.result_id}" if action.result_id else ""
        lines.append(
            f"  action #{action.index} {ACTION_NAMES[action.kind]}: {OUTCOME_NAMES[action.outcome]}{result}{detail}"
        )
    for attempt in run.model_attempts:
        wait = f", waited {attempt.wait_seconds:g} s" if attempt.wait_seconds else ""
        lines.append(f"  model request {attempt.number}: {attempt.status_code} {attempt.error_class}{wait}")
    if run.error:
        lines.append(f"  error: {run.error}")
    return "\n".join(lines)
