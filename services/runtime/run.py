"""A run, step by step, in a fixed order (docs/architecture.md): claim, read, call, decide, post, write, end.

The claim comes first and is never undone. The run's first ledger write, made with its room read,
is the fence: it carries this delivery's token (Run.attempt), and the Room refuses it when another
delivery's run already holds the row. So at most one run of a wake reads the room, and once one
has, whatever happens after it (an error, the time limit, a crash), the wake is not acted on again;
a claim whose run never got that far is taken over by the next delivery's run. The ledger row is
written whole, in the same transaction as each Room write it records, so after a crash it shows
what was posted, written and not written.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import grpc
import httpx
from opentelemetry import trace

from quayutec.errors import InvalidArgument, ResourceExhausted, Unavailable, broken_rule
from quayutec.ledger import continuation_attempt, mark_undone, run_id_for
from quayutec.telemetry import Metrics, annotate, run_outcome, run_span
from quayutec.v1 import claims_pb2, common_pb2, room_pb2, runtime_pb2
from services.runtime.backend import MIN_TRY_SECONDS, retryable, with_retries
from services.runtime.config import RuntimeConfig
from services.runtime.model import (
    DECLARED_ACTIONS,
    Attempt,
    ChatMessage,
    Clock,
    ModelReply,
    ModelRequest,
    ModelTarget,
    RetryPolicy,
    ToolCall,
    call_model,
)

_log = logging.getLogger("quayutec.runtime")

MAX_ID_BYTES = 200
MAX_MEMORY_BYTES = 16 * 1024
MAX_TITLE_BYTES = 500
MAX_BODY_BYTES = 64 * 1024

ACTION_KINDS: dict[str, common_pb2.ActionKind.ValueType] = {
    "remember": common_pb2.ACTION_KIND_REMEMBER,
    "create_task": common_pb2.ACTION_KIND_CREATE_TASK,
    "update_task": common_pb2.ACTION_KIND_UPDATE_TASK,
    "close_task": common_pb2.ACTION_KIND_CLOSE_TASK,
}
# Which right governs each kind of declared action (the AgentRights field is the action's name),
# and what each right makes of it.
RIGHT_FIELDS: dict[common_pb2.ActionKind.ValueType, str] = {kind: name for name, kind in ACTION_KINDS.items()}
RIGHT_ORDER = [common_pb2.ACTION_RIGHT_AUTO, common_pb2.ACTION_RIGHT_HOLD, common_pb2.ACTION_RIGHT_DENY]
RIGHT_OUTCOMES: dict[common_pb2.ActionRight.ValueType, common_pb2.ActionOutcome.ValueType] = {
    common_pb2.ACTION_RIGHT_UNSPECIFIED: common_pb2.ACTION_OUTCOME_PENDING,
    common_pb2.ACTION_RIGHT_AUTO: common_pb2.ACTION_OUTCOME_PENDING,
    common_pb2.ACTION_RIGHT_HOLD: common_pb2.ACTION_OUTCOME_HELD,
    common_pb2.ACTION_RIGHT_DENY: common_pb2.ACTION_OUTCOME_DENIED,
}
PROVIDERS: dict[common_pb2.Provider.ValueType, str] = {
    common_pb2.PROVIDER_ANTHROPIC: "anthropic",
    common_pb2.PROVIDER_OPENAI: "openai",
    common_pb2.PROVIDER_OPENAI_COMPATIBLE: "openai_compatible",
}


def continuation_claim(token: str) -> str:
    """The claim key of a parked run's continuation (claimed like a wake, once)."""
    return f"continue:{token}"


@dataclass(frozen=True)
class Wake:
    """What StartRun was asked to act on."""

    agent_id: str
    wake_id: str
    room_id: str
    kind: common_pb2.WakeKind.ValueType
    source_id: str

    @classmethod
    def from_request(cls, request: runtime_pb2.StartRunRequest) -> Wake:
        for name in ("agent_id", "wake_id", "room_id"):
            value: str = getattr(request, name)
            if not value:
                raise InvalidArgument(f"{name} is required")
            if len(value.encode()) > MAX_ID_BYTES:
                raise InvalidArgument(f"{name} is over {MAX_ID_BYTES} bytes")
        return cls(request.agent_id, request.wake_id, request.room_id, request.wake_kind, request.wake_source_id)


class DecisionError(Exception):
    """A declared action that cannot be decided: the run ends with nothing posted or written."""


class HeldByAnother(Exception):
    """Another delivery's run holds the wake's ledger row: this run stops before any effect."""


def fenced_out(exc: BaseException) -> bool:
    """Whether ``exc`` says the ledger refused this run's write because another run holds the row."""
    if isinstance(exc, HeldByAnother):
        return True
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.ALREADY_EXISTS


# StartRun's answer for one delivery: the result, or the error it fails with.
StartAnswer: TypeAlias = runtime_pb2.StartRunResult.ValueType | BaseException


@dataclass
class DeliveryRun:
    """One delivery's run of a wake: its token (the claimant token; the ledger's fence) and StartRun's
    answer, given once: ACCEPTED when the run's first ledger write committed, ALREADY_CLAIMED when
    the fence refused it, or the error that stopped the run before it wrote anything."""

    token: str
    # The claim was refused to this delivery: its run takes the wake over if the claim's run never
    # read the room, and is fenced out otherwise.
    taking_over: bool
    answer: asyncio.Future[StartAnswer]

    def give(self, answer: StartAnswer) -> bool:
        """Answer StartRun (the first answer only); whether this was it."""
        if self.answer.done():
            return False
        self.answer.set_result(answer)
        return True


@dataclass
class RoomView:
    """What the agent sees of the room when its run starts."""

    agent: common_pb2.Agent
    provider_key: str
    wake_text: str
    messages: list[common_pb2.Message]
    tasks: list[common_pb2.Task]
    memory: list[common_pb2.MemoryLine]
    passages: list[common_pb2.Passage]
    rights: common_pb2.AgentRights
    room_agents: dict[str, common_pb2.Agent]


# How often the end of a run is written again while the Room is unreachable (Ledger.end_retry_seconds).
END_RETRY_EVERY_SECONDS = 1.0


@dataclass
class Ledger:
    """The run's ledger row, written whole to Room with each write (or alone) at each step a crash must not hide."""

    room: Any  # RoomServiceStub
    run: common_pb2.Run
    timeout: float
    # Monotonic start of the run's active time (time parked on a waitpoint is not counted).
    started: float = field(default_factory=time.monotonic)
    metrics: Metrics | None = None
    # Called once, when this run's first ledger write has committed: the run holds the row.
    on_recorded: Callable[[], None] | None = None
    recorded: bool = False
    # How long the end of the run is written again while the Room is unreachable past its own retries:
    # a run cut off from its database ends in the ledger soon after the database is back, instead of
    # staying open until the Gateway's sweep abandons it.
    end_retry_seconds: float = 0.0

    def snapshot(self) -> common_pb2.Run:
        self.run.active_ms = int((time.monotonic() - self.started) * 1000)
        self.run.updated_at.GetCurrentTime()
        return self.run

    def mark_recorded(self) -> None:
        """A write carrying the row committed (the first one passed the fence)."""
        if not self.recorded:
            self.recorded = True
            if self.on_recorded is not None:
                self.on_recorded()

    async def save(self) -> None:
        await self.room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=self.snapshot()), timeout=self.timeout)
        self.mark_recorded()

    async def step(self, step: common_pb2.RunStep.ValueType) -> None:
        self.run.step = step
        await self.save()

    async def add_attempt(self, attempt: Attempt) -> None:
        """Each attempt joins the row; it is written at once only when a wait follows it, so a run
        that dies while waiting still shows every request it made."""
        recorded = common_pb2.ModelAttempt(
            number=attempt.number,
            status_code=attempt.status_code or 0,
            error_class=attempt.error_class,
            retryable=attempt.retryable,
            wait_seconds=attempt.wait_seconds,
            detail=attempt.detail,
            duration_ms=round(attempt.duration_ms),  # nearest ms (truncating biased it low)
        )
        # When it was sent: now, less how long it took (for the run's timeline on a time axis).
        recorded.started_at.FromNanoseconds(time.time_ns() - round(attempt.duration_ms * 1_000_000))
        self.run.model_attempts.append(recorded)
        if attempt.wait_seconds > 0:
            await self.save()

    def next_row(self, *, final: bool) -> common_pb2.Run:
        """The row to record with the next Room write: as it stands, or as the succeeded run."""
        row = common_pb2.Run()
        row.CopyFrom(self.snapshot())
        if final:
            row.status = common_pb2.RUN_STATUS_SUCCEEDED
            row.step = common_pb2.RUN_STEP_ENDED
            row.ended_at.GetCurrentTime()
        return row

    def accept(self, row: common_pb2.Run) -> None:
        """The write that carried ``row`` committed: the row is now what the ledger holds."""
        newly_ended = row.step == common_pb2.RUN_STEP_ENDED and not self.ended
        self.run.CopyFrom(row)
        self.mark_recorded()
        if newly_ended and self.metrics is not None:
            self.metrics.run_ended(run_outcome(row.status))

    @property
    def ended(self) -> bool:
        return self.run.step == common_pb2.RUN_STEP_ENDED

    async def end(self, status: common_pb2.RunStatus.ValueType, error: str = "") -> None:
        self.run.status = status
        self.run.error = error
        mark_undone(self.run, error or "the run ended first")
        self.run.step = common_pb2.RUN_STEP_ENDED
        self.run.ended_at.GetCurrentTime()
        deadline = time.monotonic() + self.end_retry_seconds
        while True:
            try:
                await self.save()
                break
            except grpc.aio.AioRpcError as exc:
                if not retryable(exc) or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(END_RETRY_EVERY_SECONDS)
        if self.metrics is not None:
            self.metrics.run_ended(run_outcome(status))


class RunExecutor:
    """Starts runs (claim first) and executes them in the background, a bounded number at once."""

    def __init__(
        self,
        *,
        config: RuntimeConfig,
        claims: Any,  # ClaimsServiceStub
        room: Any,  # RoomServiceStub
        http: httpx.AsyncClient,
        owner_http: httpx.AsyncClient,
        policy: RetryPolicy,
        clock: Clock,
        metrics: Metrics | None = None,
    ) -> None:
        self._config = config
        self._claims = claims
        self._room = room
        self._http = http
        self._owner_http = owner_http
        self._policy = policy
        self._clock = clock
        self._metrics = metrics or Metrics()
        self._active = 0
        self._tasks: set[asyncio.Task[None]] = set()
        # Set by release_failpoints (SIGUSR1 in tests): runs paused at a failpoint go on.
        self._failpoints_released = asyncio.Event()
        self._failpoints_passed: Counter[str] = Counter()

    async def start(
        self, wake: Wake, *, time_left: float | None = None
    ) -> tuple[runtime_pb2.StartRunResult.ValueType, str]:
        """Claim the wake, start its run and answer once the run holds the wake's ledger row; refuse
        before claiming when full.

        A claim refused to this delivery is run too: its run's first ledger write takes the wake over
        when the claim's own run never read the room (no row, or a NOT_STARTED one), and is refused
        otherwise (ALREADY_CLAIMED). The run goes on if this call is cancelled. ``time_left`` is what
        remains of the StartRun deadline: the claim is asked again (with this delivery's one claimant
        token) on UNAVAILABLE or DEADLINE_EXCEEDED until shortly before it."""
        continuation = wake.kind == common_pb2.WAKE_KIND_DECISION
        if continuation and not wake.source_id:
            raise InvalidArgument("a DECISION wake needs wake_source_id (the waitpoint token)")
        run_id = "" if continuation else run_id_for(wake.agent_id, wake.wake_id)
        annotate(agent_id=wake.agent_id, room_id=wake.room_id, wake_id=wake.wake_id, run_id=run_id)
        if self._active >= self._config.max_runs:
            raise ResourceExhausted(
                f"{self._active} runs are executing (limit {self._config.max_runs}); deliver the wake again later",
                retry_after_ms=1000,
            )
        self._active += 1
        handed_off = False
        # Claims are asked until a tenth of the caller's deadline is left, to answer it in.
        loop = asyncio.get_running_loop()
        claim_until = None if time_left is None else loop.time() + time_left * 0.9
        try:
            waitpoint = None
            if continuation:  # read before claiming: a read that fails costs nothing
                waitpoint = await self._get_waitpoint(wake.source_id)
                run_id = waitpoint.run_id
                annotate(run_id=run_id)
            # A decision continues its run once, however many wakes or replicas deliver it.
            claim_key = continuation_claim(wake.source_id) if continuation else wake.wake_id
            bound = self._config.room_retry_seconds if claim_until is None else claim_until - loop.time()
            token = uuid.uuid4().hex
            claim = await self._claim(wake.agent_id, claim_key, token, bound)
            if not claim.claimed:
                self._metrics.claim_refused()
            attempt = DeliveryRun(token, taking_over=not claim.claimed, answer=loop.create_future())
            work = self.run(wake, run_id, attempt) if waitpoint is None else self.continue_run(waitpoint, attempt)
            # A continuation's run links to the span that parked it (the parked run's trace).
            continues = "" if waitpoint is None else waitpoint.traceparent
            task = asyncio.create_task(
                self._run_and_release(work, run_id, attempt, wake, continues), name=f"run {run_id}"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            handed_off = True
        finally:
            if not handed_off:
                self._active -= 1
        answer = await asyncio.shield(attempt.answer)
        if isinstance(answer, BaseException):
            raise answer
        return answer, run_id

    async def _claim(self, agent_id: str, claim_key: str, token: str, bound: float) -> claims_pb2.ClaimOnceResponse:
        """ClaimOnce with this delivery's token, asked again for up to ``bound`` seconds while it
        may have committed unseen: a late commit is then answered claimed=true to us (and to no
        other delivery)."""
        request = claims_pb2.ClaimOnceRequest(agent_id=agent_id, wake_id=claim_key, claimant=token)
        response: claims_pb2.ClaimOnceResponse = await with_retries(
            lambda t: self._claims.ClaimOnce(request, timeout=t),
            call_timeout=min(self._config.backend_timeout_seconds, max(MIN_TRY_SECONDS, bound)),
            retry_seconds=bound,
            what="Claims ClaimOnce",
        )
        return response

    async def _run_and_release(
        self, work: Coroutine[Any, Any, None], run_id: str, attempt: DeliveryRun, wake: Wake, continues: str = ""
    ) -> None:
        """Run ``work``; answer StartRun from what it did if its first ledger write did not already."""
        try:
            # The same wake and run ids as its "deliver wake" and "StartRun" spans, continuation or not.
            ids = {"agent_id": wake.agent_id, "room_id": wake.room_id, "wake_id": wake.wake_id}
            with run_span(run_id=run_id, continues=continues, **ids):
                await work
        except asyncio.CancelledError:
            attempt.give(Unavailable("the Runtime stopped before the run read the room; deliver the wake again"))
            raise
        except Exception as exc:
            if fenced_out(exc):
                if attempt.give(runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED) and not attempt.taking_over:
                    _log.info("run %s was taken over by another delivery before it read the room", run_id)
            elif attempt.give(exc):  # StartRun's error: nothing was recorded or done; delivered again
                _log.info("run %s stopped before its first ledger write (nothing was done): %s", run_id, exc)
            else:
                self._metrics.run_ended("error")
                _log.exception("run %s failed outside its ledger", run_id)
        finally:
            self._active -= 1
            attempt.give(runtime_pb2.START_RUN_RESULT_ACCEPTED)  # ended without a ledger write of its own

    def _recorded(self, attempt: DeliveryRun, run_id: str) -> Callable[[], None]:
        """What happens when the run's first ledger write commits: StartRun answers ACCEPTED."""

        def recorded() -> None:
            attempt.give(runtime_pb2.START_RUN_RESULT_ACCEPTED)
            self._metrics.run_started()
            if attempt.taking_over:
                self._metrics.run_taken_over()
                _log.info("run %s taken over: its wake's claim was made by a run that never read the room", run_id)

        return recorded

    def release_failpoints(self) -> None:
        """Runs paused at a failpoint go on (crash tests only)."""
        self._failpoints_released.set()

    async def run(self, wake: Wake, run_id: str, attempt: DeliveryRun) -> None:
        """One claimed run, step by step in the fixed order. Nothing here is ever redone."""
        annotate(agent_id=wake.agent_id, room_id=wake.room_id, wake_id=wake.wake_id)
        row = self._new_run_row(wake, run_id)
        row.attempt = attempt.token
        ledger = Ledger(
            self._room,
            row,
            self._config.backend_timeout_seconds,
            metrics=self._metrics,
            on_recorded=self._recorded(attempt, run_id),
            end_retry_seconds=self._config.run_seconds,
        )
        active_time = asyncio.timeout(self._config.run_seconds)
        try:
            async with active_time:
                # 1. claimed (by start) before anything else; 2. read the room, recording the claimed
                # row: the fence, refused when another delivery's run holds the row
                await self._failpoint("before_room_read", run_id)
                view = await self.read_room(wake, ledger)
                await self._failpoint("claimed", run_id)
                ledger.run.company_id = view.agent.company_id
                annotate(company_id=view.agent.company_id)
                ledger.run.step = common_pb2.RUN_STEP_ROOM_READ

                reply = await self.call_model(view, ledger)  # 3. call the model
                if reply is None:
                    return
                ledger.run.step = common_pb2.RUN_STEP_MODEL_CALLED
                await self._failpoint("model_called", run_id)

                try:  # 4. decide each declared action by the owning company's rights
                    ledger.run.actions.extend(self.decide(view, reply.tool_calls))
                except DecisionError as exc:
                    await ledger.end(common_pb2.RUN_STATUS_FAILED, f"declared actions refused: {exc}")
                    return
                if ledger.run.actions:
                    await ledger.step(common_pb2.RUN_STEP_ACTIONS_DECIDED)
                else:  # nothing declared: the reply (or the end) that follows at once records the row
                    ledger.run.step = common_pb2.RUN_STEP_ACTIONS_DECIDED

                await self.post_reply(wake.room_id, view.agent, reply, ledger)  # 5. post the reply first
                await self._failpoint("reply_posted", run_id)

                await self.write_actions(wake.room_id, agent_author(view.agent), ledger)  # 6. then the writes

                if any(a.outcome == common_pb2.ACTION_OUTCOME_HELD for a in ledger.run.actions):
                    await self.park(ledger)  # held actions wait on a waitpoint; nothing stays in memory
                    return
        except TimeoutError:
            if not active_time.expired():
                raise
            seconds = self._config.run_seconds
            await ledger.end(common_pb2.RUN_STATUS_TIMED_OUT, f"stopped after {seconds:g} s of active time")
            return
        except asyncio.CancelledError:
            if ledger.recorded:  # before its first write the run did nothing: the next delivery takes it over
                ledger.end_retry_seconds = 0.0  # shutting down: the Room's own retries only
                await asyncio.shield(ledger.end(common_pb2.RUN_STATUS_FAILED, "the runtime shut down during the run"))
            raise
        except grpc.aio.AioRpcError as exc:
            await self._end_after_room_error(ledger, exc)
            return
        if not ledger.ended:
            await ledger.end(common_pb2.RUN_STATUS_SUCCEEDED)  # 7. end (unless the last write recorded it)

    @staticmethod
    async def _end_after_room_error(ledger: Ledger, exc: grpc.aio.AioRpcError) -> None:
        """End the run FAILED after a Room call failed, unless it must stop without a write: fenced
        out (another run holds the row), or not recorded yet and the failure may pass (the Room
        unreachable past the retries): then nothing was done and the error is StartRun's answer."""
        if fenced_out(exc) or (not ledger.recorded and retryable(exc)):
            raise exc
        await ledger.end(common_pb2.RUN_STATUS_FAILED, f"room call failed: {exc.code().name}: {exc.details()}")

    async def park(self, ledger: Ledger) -> None:
        """Store the held actions on a waitpoint token (and the PARKED row, in one transaction)."""
        ledger.run.status = common_pb2.RUN_STATUS_PARKED
        ledger.run.step = common_pb2.RUN_STEP_PARKED
        held = [
            common_pb2.HeldAction(
                index=a.index, kind=a.kind, arguments_json=a.arguments_json, decision=common_pb2.DECISION_PENDING
            )
            for a in ledger.run.actions
            if a.outcome == common_pb2.ACTION_OUTCOME_HELD
        ]
        await self._room.CreateWaitpoint(
            room_pb2.RoomServiceCreateWaitpointRequest(
                run_id=ledger.run.run_id,
                held=held,
                expires_in_seconds=self._config.waitpoint_ttl_seconds,
                run=ledger.snapshot(),
            ),
            timeout=self._config.backend_timeout_seconds,
        )

    async def continue_run(self, waitpoint: common_pb2.Waitpoint, attempt: DeliveryRun) -> None:
        """The decided continuation of a parked run: approved held actions are done, denied ones
        recorded, undecided ones (expired token) end undone. Claimed once, like a wake; its first
        write (the RUNNING row) is the fence, so a continuation that died before it is taken over."""
        t = self._config.backend_timeout_seconds
        await self._failpoint("continuation_claimed", waitpoint.run_id)
        run = (await self._room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id=waitpoint.run_id), timeout=t)).run
        if run.status != common_pb2.RUN_STATUS_PARKED:
            if attempt.taking_over:  # the claim's own continuation got past its first write
                raise HeldByAnother(run.run_id)
            _log.warning("run %s is %s, not parked; its decision is not acted on", run.run_id, run.status)
            return
        # The run span names this continuation's wake (the decision's), as its delivery does.
        annotate(company_id=run.company_id)
        trace_id = current_trace_id()
        if trace_id and trace_id not in run.trace_ids:  # the ledger keeps every trace of the run
            if not run.trace_ids and run.trace_id:
                run.trace_ids.append(run.trace_id)
            run.trace_ids.append(trace_id)
        run.attempt = continuation_attempt(waitpoint.token, attempt.token)
        ledger = Ledger(
            self._room,
            run,
            t,
            started=time.monotonic() - run.active_ms / 1000,
            metrics=self._metrics,
            on_recorded=self._recorded(attempt, run.run_id),
            end_retry_seconds=self._config.run_seconds,
        )
        run.status = common_pb2.RUN_STATUS_RUNNING
        decisions = {h.index: h for h in waitpoint.held}
        for action in run.actions:
            if action.outcome != common_pb2.ACTION_OUTCOME_HELD:
                continue
            held = decisions.get(action.index)
            if held is None or held.decision not in (common_pb2.DECISION_APPROVED, common_pb2.DECISION_DENIED):
                action.outcome = common_pb2.ACTION_OUTCOME_NOT_DONE
                action.detail = "the approval expired before a decision"
            elif held.decision == common_pb2.DECISION_APPROVED:
                action.outcome = common_pb2.ACTION_OUTCOME_PENDING
                action.detail = f"approved by {held.decided_by}"
            else:
                action.outcome = common_pb2.ACTION_OUTCOME_DENIED
                action.detail = f"denied by {held.decided_by}"
        remaining = self._config.run_seconds - run.active_ms / 1000
        active_time = asyncio.timeout(max(0.0, remaining))
        author = common_pb2.Author(kind=common_pb2.AUTHOR_KIND_AGENT, company_id=run.company_id, agent_id=run.agent_id)
        try:
            async with active_time:
                # Recorded RUNNING before anything is done, so a continuation that dies from here on
                # is a RUNNING row that housekeeping ends, like any other run.
                await ledger.save()
                await self._failpoint("continued", run.run_id)
                await self.write_actions(run.room_id, author, ledger)
                if ledger.ended:
                    return
        except TimeoutError:
            if not active_time.expired():
                raise
            seconds = self._config.run_seconds
            await ledger.end(common_pb2.RUN_STATUS_TIMED_OUT, f"stopped after {seconds:g} s of active time")
            return
        except grpc.aio.AioRpcError as exc:
            await self._end_after_room_error(ledger, exc)
            return
        await ledger.end(common_pb2.RUN_STATUS_SUCCEEDED)

    async def _get_waitpoint(self, token: str) -> common_pb2.Waitpoint:
        got: room_pb2.RoomServiceGetWaitpointResponse = await self._room.GetWaitpoint(
            room_pb2.RoomServiceGetWaitpointRequest(token=token), timeout=self._config.backend_timeout_seconds
        )
        return got.waitpoint

    def decide(self, view: RoomView, calls: tuple[ToolCall, ...]) -> list[common_pb2.DeclaredAction]:
        """Validate each declared action and apply the owning company's rights to it."""
        actions = validate_actions(calls)
        rights = view.rights
        for action in actions:
            right = getattr(rights, RIGHT_FIELDS[action.kind]) or common_pb2.ACTION_RIGHT_AUTO
            if action.kind == common_pb2.ACTION_KIND_CREATE_TASK:
                # An agent the run does not see in the room is the Room's to refuse, by its rules; until
                # then it counts as another company's (the stricter right).
                target = view.room_agents.get(json.loads(action.arguments_json)["to_agent_id"])
                if target is None or target.company_id != view.agent.company_id:
                    cross = rights.cross_company_task or common_pb2.ACTION_RIGHT_AUTO
                    right = max(right, cross, key=RIGHT_ORDER.index)
            action.outcome = RIGHT_OUTCOMES[right]
            if right == common_pb2.ACTION_RIGHT_DENY:
                action.detail = "denied by the company's agent rights"
        return actions

    def _new_run_row(self, wake: Wake, run_id: str) -> common_pb2.Run:
        run = common_pb2.Run(
            run_id=run_id,
            agent_id=wake.agent_id,
            room_id=wake.room_id,
            wake_id=wake.wake_id,
            wake_kind=wake.kind,
            wake_source_id=wake.source_id,
            status=common_pb2.RUN_STATUS_RUNNING,
            trace_id=current_trace_id(),
        )
        if run.trace_id:
            run.trace_ids.append(run.trace_id)
        run.started_at.GetCurrentTime()
        return run

    async def _failpoint(self, name: str, run_id: str) -> None:
        """Crash tests name step boundaries at which a run pauses, to be killed there (or let go on
        by ``release_failpoints``)."""
        let_through = self._config.failpoints.get(name)
        if let_through is None or self._failpoints_released.is_set():
            return
        if self._failpoints_passed[name] < let_through:
            self._failpoints_passed[name] += 1
            return
        print(f"failpoint {name} reached by run {run_id}", file=sys.stderr, flush=True)
        await self._failpoints_released.wait()

    async def read_room(self, wake: Wake, ledger: Ledger) -> RoomView:
        """Everything the run sees of the room, read in one call that also records the claimed row."""
        ledger.run.step = common_pb2.RUN_STEP_CLAIMED
        got: room_pb2.RoomServiceReadRunContextResponse = await self._room.ReadRunContext(
            room_pb2.RoomServiceReadRunContextRequest(
                agent_id=wake.agent_id,
                room_id=wake.room_id,
                wake_kind=wake.kind,
                wake_source_id=wake.source_id,
                recent_messages=self._config.recent_messages,
                max_passages=5,
                run=ledger.snapshot(),
            ),
            timeout=self._config.backend_timeout_seconds,
        )
        ledger.mark_recorded()
        return RoomView(
            agent=got.agent,
            provider_key=got.provider_key,
            wake_text=got.wake_text,
            messages=list(got.messages),
            tasks=list(got.open_tasks),
            memory=list(got.memory),
            passages=list(got.passages),
            rights=got.rights,
            room_agents={a.agent_id: a for a in got.room_agents},
        )

    async def call_model(self, view: RoomView, ledger: Ledger) -> ModelReply | None:
        """The model call with bounded retries; a final failure ends the run with nothing posted."""
        agent = view.agent
        provider = PROVIDERS.get(agent.provider)
        if provider is None:
            await ledger.end(common_pb2.RUN_STATUS_FAILED, f"agent {agent.agent_id} has no known provider")
            return None
        owner_supplied = bool(agent.base_url)
        base_url = agent.base_url or (
            self._config.anthropic_base_url if provider == "anthropic" else self._config.openai_base_url
        )
        target = ModelTarget(
            provider=provider,  # type: ignore[arg-type]
            model=agent.model,
            api_key=view.provider_key,
            base_url=base_url,
            owner_supplied=owner_supplied,
        )

        async def on_attempt(attempt: Attempt) -> None:
            self._metrics.model_request(provider, attempt.error_class)
            await ledger.add_attempt(attempt)

        outcome = await call_model(
            # An owner's address goes through the egress guard; our own configured ones do not.
            self._owner_http if owner_supplied else self._http,
            target,
            build_request(view),
            policy=self._policy,
            clock=self._clock,
            on_attempt=on_attempt,
            max_response_bytes=self._config.model_max_response_bytes,
        )
        if outcome.reply is None:
            await ledger.end(common_pb2.RUN_STATUS_FAILED, f"model call failed: {outcome.error}")
            return None
        return outcome.reply

    async def post_reply(self, room_id: str, agent: common_pb2.Agent, reply: ModelReply, ledger: Ledger) -> None:
        """Post the reply with its ledger row in one transaction (the ended row when nothing follows)."""
        final = not any(
            a.outcome in (common_pb2.ACTION_OUTCOME_PENDING, common_pb2.ACTION_OUTCOME_HELD) for a in ledger.run.actions
        )
        ledger.run.step = common_pb2.RUN_STEP_REPLY_POSTED
        if not reply.text.strip():
            await (ledger.end(common_pb2.RUN_STATUS_SUCCEEDED) if final else ledger.save())
            return
        row = ledger.next_row(final=final)
        posted = await self._room.PostMessage(
            room_pb2.RoomServicePostMessageRequest(
                room_id=room_id,
                author=agent_author(agent),
                body=clip(reply.text, MAX_BODY_BYTES),
                run_id=row.run_id,
                dedupe_key=f"run:{row.run_id}:reply",
                run=row,
            ),
            timeout=self._config.backend_timeout_seconds,
        )
        ledger.accept(row)
        ledger.run.posted_message_id = posted.message.message_id

    async def write_actions(self, room_id: str, author: common_pb2.Author, ledger: Ledger) -> None:
        """Do each decided action once, its ledger row in the same transaction (dedupe keys make a
        retried call harmless); the last write records the ended row when nothing is held."""
        pending = [a.index for a in ledger.run.actions if a.outcome == common_pb2.ACTION_OUTCOME_PENDING]
        held = any(a.outcome == common_pb2.ACTION_OUTCOME_HELD for a in ledger.run.actions)
        for number, index in enumerate(pending, start=1):
            row = ledger.next_row(final=number == len(pending) and not held)
            if row.step != common_pb2.RUN_STEP_ENDED:
                row.step = common_pb2.RUN_STEP_WRITES_DONE if number == len(pending) else row.step
            action = next(a for a in row.actions if a.index == index)
            try:
                result_id = await self._write(
                    action.kind,
                    room_id,
                    author,
                    json.loads(action.arguments_json),
                    row,
                    f"run:{row.run_id}:action:{index}",
                    index,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                # Not done, and the run goes on with its other actions: refused by a rule of the room
                # (REFUSED, in the rule's words), or rejected for what it names (FAILED). The next
                # ledger write (the next action's, or the run's end) records it.
                mine = next(a for a in ledger.run.actions if a.index == index)
                rule = broken_rule(exc)
                if rule is not None:
                    mine.outcome = common_pb2.ACTION_OUTCOME_REFUSED
                    mine.rule = rule
                    mine.detail = exc.details() or rule
                else:
                    mine.outcome = common_pb2.ACTION_OUTCOME_FAILED
                    mine.detail = f"{exc.code().name}: {exc.details()}"
                continue
            action.outcome = common_pb2.ACTION_OUTCOME_DONE
            action.result_id = result_id
            ledger.accept(row)
            await self._failpoint("action_written", row.run_id)

    async def _write(
        self,
        kind: common_pb2.ActionKind.ValueType,
        room_id: str,
        author: common_pb2.Author,
        args: dict[str, Any],
        row: common_pb2.Run,
        key: str,
        index: int,
    ) -> str:
        """One declared action's write, recording ``row`` with it; returns the id of what was written."""
        t = self._config.backend_timeout_seconds
        run_id = row.run_id
        if kind == common_pb2.ACTION_KIND_REMEMBER:
            visibility = common_pb2.MEMORY_VISIBILITY_COMPANY if args["private"] else common_pb2.MEMORY_VISIBILITY_ROOM
            written = await self._room.WriteMemory(
                room_pb2.RoomServiceWriteMemoryRequest(
                    room_id=room_id,
                    author=author,
                    text=args["text"],
                    visibility=visibility,
                    run_id=run_id,
                    dedupe_key=key,
                    run=row,
                    run_action_index=index,
                ),
                timeout=t,
            )
            return str(written.line.memory_id)
        if kind == common_pb2.ACTION_KIND_CREATE_TASK:
            request = room_pb2.RoomServiceCreateTaskRequest(
                room_id=room_id,
                to_agent_id=args["to_agent_id"],
                title=args["title"],
                body=args["body"],
                run_id=run_id,
                dedupe_key=key,
                run=row,
                run_action_index=index,
            )
            getattr(request, "from").CopyFrom(author)  # `from` is a Python keyword
            created = await self._room.CreateTask(request, timeout=t)
            return str(created.task.task_id)
        status = {
            "done": common_pb2.TASK_STATUS_DONE,
            "cancelled": common_pb2.TASK_STATUS_CANCELLED,
        }.get(args.get("status", ""), common_pb2.TASK_STATUS_UNSPECIFIED)
        updated = await self._room.UpdateTask(
            room_pb2.RoomServiceUpdateTaskRequest(
                task_id=args["task_id"],
                room_id=room_id,
                author=author,
                note=args.get("note", ""),
                status=status,
                run_id=run_id,
                dedupe_key=key,
                run=row,
                run_action_index=index,
            ),
            timeout=t,
        )
        return str(updated.update.update_id)

    async def shutdown(self, grace: float) -> None:
        """Let running runs finish within ``grace`` seconds, then stop them (the ledger says so)."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(set(self._tasks), timeout=grace)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def agent_author(agent: common_pb2.Agent) -> common_pb2.Author:
    return common_pb2.Author(kind=common_pb2.AUTHOR_KIND_AGENT, company_id=agent.company_id, agent_id=agent.agent_id)


def clip(text: str, max_bytes: int) -> str:
    data = text.encode()
    return text if len(data) <= max_bytes else data[:max_bytes].decode(errors="ignore")


def current_trace_id() -> str:
    """The trace this run is recorded in, or "" when this process exports no traces."""
    span = trace.get_current_span()
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid and span.is_recording() else ""


def _require_str(call: ToolCall, name: str, max_bytes: int, *, allow_empty: bool = False) -> str:
    value = call.arguments.get(name)
    if not isinstance(value, str):
        raise DecisionError(f"{call.name} #{call.id}: {name} must be a string")
    if not allow_empty and not value.strip():
        raise DecisionError(f"{call.name} #{call.id}: {name} must not be empty")
    if len(value.encode()) > max_bytes:
        raise DecisionError(f"{call.name} #{call.id}: {name} is over {max_bytes} bytes")
    return value


def validate_actions(calls: tuple[ToolCall, ...]) -> list[common_pb2.DeclaredAction]:
    """Validate every declared action. Any error refuses them all (nothing posted)."""
    decided: list[common_pb2.DeclaredAction] = []
    for index, call in enumerate(calls):
        kind = ACTION_KINDS.get(call.name)
        if kind is None:
            raise DecisionError(f"unknown action {call.name!r}")
        args: dict[str, Any]
        if call.name == "remember":
            private = call.arguments.get("private", False)
            if not isinstance(private, bool):
                raise DecisionError(f"remember #{call.id}: private must be true or false")
            args = {"text": _require_str(call, "text", MAX_MEMORY_BYTES), "private": private}
        elif call.name == "create_task":
            args = {
                "to_agent_id": _require_str(call, "to_agent_id", MAX_ID_BYTES),
                "title": _require_str(call, "title", MAX_TITLE_BYTES),
                "body": _require_str(call, "body", MAX_BODY_BYTES, allow_empty=True),
            }
        elif call.name == "update_task":
            args = {
                "task_id": _require_str(call, "task_id", MAX_ID_BYTES),
                "note": _require_str(call, "note", MAX_BODY_BYTES),
            }
        else:
            status = call.arguments.get("status")
            if status not in ("done", "cancelled"):
                raise DecisionError(f"close_task #{call.id}: status must be 'done' or 'cancelled'")
            args = {
                "task_id": _require_str(call, "task_id", MAX_ID_BYTES),
                "status": status,
                "note": _require_str(call, "note", MAX_BODY_BYTES, allow_empty=True),
            }
        decided.append(
            common_pb2.DeclaredAction(
                index=index,
                kind=kind,
                arguments_json=json.dumps(args, sort_keys=True),
                outcome=common_pb2.ACTION_OUTCOME_PENDING,
            )
        )
    return decided


def build_request(view: RoomView) -> ModelRequest:
    """The prompt: the agent's own system prompt, then the room as it stands."""
    agent = view.agent
    system = (
        f"{agent.system_prompt}\n\n"
        f"You are agent {agent.name} (id {agent.agent_id}) of company {agent.company_id} in a shared room. "
        "Reply in plain text; use the tools to remember a line or to create, update or close tasks."
    ).strip()
    parts: list[str] = []
    others = [a for a in view.room_agents.values() if a.agent_id != agent.agent_id]
    if others:
        parts.append("Agents in this room (create_task takes their id):")
        parts.extend(f"- {a.name} (id {a.agent_id}) of company {a.company_id}" for a in others)
    if view.messages:
        parts.append("Recent messages:")
        parts.extend(f"- [{_author_label(m.author)}] {m.body}" for m in view.messages)
    if view.tasks:
        parts.append("Open tasks for you:")
        parts.extend(f"- task {t.task_id}: {t.title}: {t.body}" for t in view.tasks)
    if view.memory:
        parts.append("Shared memory:")
        parts.extend(f"- {line.text}" for line in view.memory)
    if view.passages:
        parts.append("Passages from the room's files:")
        parts.extend(f"- ({p.file_name} #{p.ordinal}) {p.text}" for p in view.passages)
    parts.append(f"You were woken by: {view.wake_text}" if view.wake_text else "You were woken.")
    return ModelRequest(
        system=system,
        messages=(ChatMessage(role="user", content="\n".join(parts)),),
        tools=DECLARED_ACTIONS,
        max_tokens=1024,
    )


def _author_label(author: common_pb2.Author) -> str:
    if author.kind == common_pb2.AUTHOR_KIND_AGENT:
        return f"agent {author.agent_id}"
    return f"{author.person} ({author.company_id})"
