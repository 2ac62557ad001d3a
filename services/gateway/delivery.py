"""The wake delivery loop: lease pending wakes from the Room's outbox and start their runs in Runtime,
one StartRuns call per leased batch (each wake its own item, in its own trace).

At least once in, at most once acted on: a wake is marked delivered only when Runtime answers that
its run holds the wake's ledger row (ACCEPTED) or another delivery's run does (ALREADY_CLAIMED with
``row_held``, its fence having refused the write; from a Runtime without the fence, ALREADY_CLAIMED
once the Room shows the row); anything else (its item's error, the whole call failing, or an
ALREADY_CLAIMED whose run has no row: logged and counted) settles it for a later retry with
backoff, and the next delivery's run takes over a claim whose run never read the room. A replica
that dies holding leases loses nothing: the leases expire and another replica delivers.
Beside it, every ``expire_interval_seconds`` the loop does the housekeeping: the Room expires overdue
waitpoints (whose DECISION wakes it then delivers like any other), ends abandoned runs, and records
NOT_STARTED rows for wakes that wait to be delivered again with no ledger row.

Settling is batched (``quayutec.coalesce.Coalescer``): each delivery queues its settlement and waits
for it; one SettleWakes call is in flight at a time, and the next carries whatever queued meanwhile
(the first goes at once, so an idle loop adds no delay). A call the Room refuses as UNAVAILABLE is
tried again until shortly before the first of its wakes' leases ends, so a Room that comes back
settles them at once; past that the call is logged, those wakes' leases expire and they are
delivered again, which the claim makes harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from quayutec.coalesce import Coalescer
from quayutec.telemetry import Metrics, annotate, batch_span, record_housekeeping, wake_delivery_span
from quayutec.v1 import common_pb2, room_pb2, runtime_pb2
from services.gateway.config import DeliveryConfig

_log = logging.getLogger("quayutec.gateway.delivery")

_DELIVERED_RESULTS = frozenset({runtime_pb2.START_RUN_RESULT_ACCEPTED, runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED})
# Longest wait for the Room during leasing and settling.
_ROOM_TIMEOUT_SECONDS = 10.0
# Jitter added to each retry delay, as a fraction of it.
_JITTER_FRACTION = 0.1
_MAX_ERROR_CHARS = 1000
# Most waitpoints one ExpireWaitpoints call expires; a full batch is followed at once by another.
_EXPIRE_BATCH = 1000
# After a Runtime answered StartRuns UNIMPLEMENTED, how long wakes go in one StartRun each.
_PER_WAKE_SECONDS = 60.0
_propagator = TraceContextTextMapPropagator()
_CODE_NAMES: dict[int, str] = {code.value[0]: code.name for code in grpc.StatusCode}
# Most settlements one SettleWakes call carries (the Room's limit).
_SETTLE_BATCH = 500
# A SettleWakes call that found the Room UNAVAILABLE is tried again until this long (or a tenth of
# the lease, if less) before the first of its wakes' leases ends; the first pause between tries
# doubles up to a second.
_SETTLE_LEASE_MARGIN_SECONDS = 1.0
_SETTLE_RETRY_FIRST_PAUSE = 0.1


@dataclass(frozen=True)
class _Settlement:
    """One wake's settlement and when (event loop time) its lease ends."""

    item: room_pb2.WakeToSettle
    lease_ends: float


@dataclass(frozen=True)
class _Started:
    """One wake's start: the Runtime's answer, or the error that stands for it."""

    response: runtime_pb2.StartRunResponse | None
    error: str


class _BatchStart:
    """The one StartRuns call of a leased batch of ``size`` wakes.

    Each wake's delivery adds its item with ``start`` (inside its own delivery span, whose context
    becomes the item's traceparent) and waits for its own answer. The call leaves when the last
    wake has added its item, in a span linked to every wake's delivery (like a SettleWakes call). When every
    delivery waiting on it is cancelled (the Gateway stopping), the call is cancelled too.
    """

    def __init__(
        self, size: int, send: Callable[[list[runtime_pb2.StartRunsItem]], Awaitable[list[_Started] | None]]
    ) -> None:
        self._size = size
        self._send = send
        self._items: list[runtime_pb2.StartRunsItem] = []
        self._contexts: list[otel_context.Context] = []
        self._answers: asyncio.Future[list[_Started] | None] = asyncio.get_running_loop().create_future()
        self._call: asyncio.Task[None] | None = None
        self._waiting = 0

    def when_answered(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the call has answered, failed or been cancelled."""
        self._answers.add_done_callback(lambda _: callback())

    async def start(self, request: runtime_pb2.StartRunRequest) -> _Started | None:
        """This wake's answer from the call; None when the Runtime has no StartRuns."""
        carrier: dict[str, str] = {}
        _propagator.inject(carrier)
        index = len(self._items)
        self._items.append(
            runtime_pb2.StartRunsItem(
                request=request,
                traceparent=carrier.get("traceparent", ""),
                tracestate=carrier.get("tracestate", ""),
            )
        )
        self._contexts.append(otel_context.get_current())
        if len(self._items) == self._size:
            self._call = asyncio.create_task(self._run(), name="start-runs")
        self._waiting += 1
        try:
            answers = await asyncio.shield(self._answers)
        except asyncio.CancelledError:
            self._waiting -= 1
            if self._waiting == 0 and self._call is not None:
                self._call.cancel()
            raise
        return None if answers is None else answers[index]

    async def _run(self) -> None:
        traced: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if len(self._items) > 1:  # linked to every wake it starts; a batch of one is in its wake's trace
            wake_ids = [item.request.wake_id for item in self._items]
            traced = batch_span("StartRuns batch", self._contexts, wake_ids=wake_ids)
        token = otel_context.attach(self._contexts[0])
        try:
            with traced:
                answers = await self._send(self._items)
        except BaseException:
            self._answers.cancel()
            raise
        finally:
            otel_context.detach(token)
        self._answers.set_result(answers)


class WakeDelivery:
    """Leases wakes (as this replica's ``lease_owner``) and delivers each leased batch with one
    StartRuns call, the wakes of all batches in flight at most ``concurrency``.

    Against a Runtime without StartRuns (UNIMPLEMENTED: an older Runtime during a rolling upgrade)
    the batch's wakes go in one StartRun each, and so do the batches leased in the next
    ``_PER_WAKE_SECONDS`` (a minute); then StartRuns is asked again.
    """

    def __init__(
        self,
        room: Any,
        runtime: Any,
        config: DeliveryConfig,
        *,
        lease_owner: str | None = None,
        random_fraction: Callable[[], float] = random.random,
        metrics: Metrics | None = None,
    ) -> None:
        self._room = room
        self._runtime = runtime
        self._config = config
        self.lease_owner = lease_owner or str(uuid.uuid4())
        self._random = random_fraction
        self._metrics = metrics or Metrics(observe_wakes=True)
        self._task: asyncio.Task[None] | None = None
        self._expiry_task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._nudged = asyncio.Event()
        self._in_flight: set[asyncio.Task[None]] = set()
        # Places of the cap held for posts whose wakes the Room leases to us in the post (``reserve``),
        # until their wakes are adopted or the places released; set when places are released.
        self._reserved = 0
        self._released = asyncio.Event()
        # Places asked for by the LeaseWakes call in flight (its wakes are not yet tasks).
        self._leasing = 0
        # Wakes leased by posts while the StartRuns call of earlier such wakes is in flight, each with when
        # its lease ends: they go together in the next call, in their places (still in ``_reserved``).
        self._adopted: list[tuple[common_pb2.Wake, float]] = []
        self._adopted_call: _BatchStart | None = None
        # Settlements, answered True when the Room settled the wake. A settlement queued by a delivery
        # cancelled meanwhile is still sent; a batch's call links to every wake it settles.
        self._settler: Coalescer[_Settlement, bool] = Coalescer(
            self._send_settlements,
            max_batch=_SETTLE_BATCH,
            name=f"wake-settling-{self.lease_owner}",
            span_name="SettleWakes batch",
            wake_id=lambda settlement: settlement.item.wake_id,
        )
        # Until when (event loop time) each wake goes in its own StartRun: the Runtime had no StartRuns.
        self._per_wake_until = 0.0
        # Counters for tests and logs.
        self.delivered = 0
        self.retried = 0
        self.expired = 0
        self.abandoned = 0
        self.not_started = 0
        self.unrecorded_claims = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"wake-delivery-{self.lease_owner}")
            self._expiry_task = asyncio.create_task(self._expire_until_stopped(), name="waitpoint-expiry")

    async def stop(self) -> None:
        """Stop leasing; let in-flight deliveries finish within the grace, then cancel them. Idempotent."""
        self._stopping.set()
        if self._task is None:
            return
        tasks = [t for t in (self._task, self._expiry_task) if t is not None]
        self._task = self._expiry_task = None
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        try:
            await self._poll_until_stopped()
        finally:
            await self._drain()

    async def _poll_until_stopped(self) -> None:
        room_failures = 0
        while not self._stopping.is_set():
            free = self._free_places()
            if free <= 0:
                self._released.clear()
                stopping = asyncio.ensure_future(self._stopping.wait())
                released = asyncio.ensure_future(self._released.wait())
                await asyncio.wait({*self._in_flight, stopping, released}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                released.cancel()
                continue
            want = min(self._config.batch_size, free)
            self._leasing = want
            try:
                wakes = await self._lease(want)
            except Exception as exc:
                self._leasing = 0
                room_failures += 1
                delay = self._config.retry_delay_seconds(room_failures)
                _log.warning("leasing wakes failed (%s); retrying in %.2f s", _describe(exc), delay)
                await self._sleep(delay)
                continue
            room_failures = 0
            self._leasing = 0
            self._start_deliveries(wakes)
            # After the deliveries are under way: the backlog gauges' Room call is not on their path.
            await self._metrics.refresh_wake_backlog(self._room, rpc_timeout_seconds=_ROOM_TIMEOUT_SECONDS)
            if len(wakes) < want:
                await self._idle(self._config.poll_interval_seconds)

    def _start_deliveries(
        self, wakes: list[common_pb2.Wake], lease_ends: float | None = None
    ) -> tuple[_BatchStart | None, list[asyncio.Task[None]]]:
        """Deliver wakes leased to us: one StartRuns call for the batch; each wake still has its own task
        (the cap counts wakes). Their leases end at ``lease_ends`` (default: a lease from now)."""
        batch = self._new_batch(len(wakes)) if wakes else None
        if lease_ends is None:
            lease_ends = asyncio.get_running_loop().time() + self._config.lease_seconds
        tasks = []
        for wake in wakes:
            task = asyncio.create_task(self._deliver(wake, lease_ends, batch))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)
            tasks.append(task)
        return batch, tasks

    @property
    def lease_seconds(self) -> int:
        """How long the leases this loop takes last."""
        return self._config.lease_seconds

    def _free_places(self) -> int:
        """Places of the cap not taken by deliveries, posts' reservations or the LeaseWakes call in flight."""
        return self._config.concurrency - len(self._in_flight) - self._reserved - self._leasing

    def reserve(self, wakes: int) -> bool:
        """Hold ``wakes`` places of the cap for a post whose wakes the Room is to lease to us; False (nothing
        held) when the loop is not running or has not that many free places. Every place held is given
        back by ``adopt`` or ``release``."""
        if self._task is None or self._stopping.is_set() or wakes <= 0:
            return False
        if self._free_places() < wakes:
            return False
        self._reserved += wakes
        return True

    def release(self, wakes: int) -> None:
        """Give back ``wakes`` places held by ``reserve`` and not used."""
        if wakes > 0:
            self._reserved -= wakes
            self._released.set()

    def adopt(self, wakes: list[common_pb2.Wake], reserved: int) -> None:
        """Deliver wakes the Room leased to us in a post, as if LeaseWakes had returned them, in the
        ``reserved`` places held for them (the places not used are given back). A loop stopping by then
        leaves them: their leases expire and another replica delivers them."""
        taken = wakes[:reserved]
        self.release(reserved - len(taken))
        if len(taken) < len(wakes):  # more wakes than places: the rest wait for their leases to expire
            _log.warning("a post leased %d wakes to %d places; the rest wait for their leases", len(wakes), reserved)
        lease_ends = asyncio.get_running_loop().time() + self._config.lease_seconds
        self._adopted.extend((wake, lease_ends) for wake in taken)
        if self._adopted_call is None:
            self._start_adopted()

    def _start_adopted(self) -> None:
        """Start the wakes adopted so far in one StartRuns call; those adopted while it is in flight wait
        for its answer and go together in the next (as settlements do: an idle loop adds no delay, a busy
        one sends fewer, larger calls)."""
        gathered, self._adopted = self._adopted, []
        self._adopted_call = None
        self.release(len(gathered))
        if not gathered:
            return
        if self._task is None or self._stopping.is_set():
            _log.info("stopping: %d wakes leased by posts are left to expire and be delivered again", len(gathered))
            return
        batch, tasks = self._start_deliveries([w for w, _ in gathered], min(ends for _, ends in gathered))
        if batch is None:  # one StartRun per wake: nothing to gather behind
            return
        self._adopted_call = batch
        unfinished = set(tasks)

        def ended() -> None:
            if self._adopted_call is batch:
                self._start_adopted()

        def task_done(task: asyncio.Task[None]) -> None:
            unfinished.discard(task)
            if not unfinished:  # every delivery ended, even one that never reached the call
                ended()

        batch.when_answered(ended)
        for task in tasks:
            task.add_done_callback(task_done)

    async def _drain(self) -> None:
        if self._in_flight:
            _, pending = await asyncio.wait(set(self._in_flight), timeout=self._config.stop_grace_seconds)
            for task in pending:
                task.cancel()
            if pending:
                _log.info("stopped with %d deliveries in flight; their leases will expire", len(pending))
                await asyncio.gather(*pending, return_exceptions=True)
        await self._settler.drain(self._config.stop_grace_seconds)  # settlements of cancelled deliveries

    @property
    def _settle_queue(self) -> tuple[room_pb2.WakeToSettle, ...]:
        """The settlements waiting for the next SettleWakes call."""
        return tuple(s.item for s in self._settler.queued)

    def nudge(self) -> None:
        """New wakes were committed: poll now rather than at the end of the interval."""
        self._nudged.set()

    async def _idle(self, seconds: float) -> None:
        """Wait for a nudge, the stop or ``seconds``, whichever comes first."""
        nudged = asyncio.ensure_future(self._nudged.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({nudged, stopping}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            nudged.cancel()
            stopping.cancel()
            self._nudged.clear()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    async def _expire_until_stopped(self) -> None:
        """Every interval: expire overdue waitpoints, end abandoned runs and record the runs of wakes
        that never started (at once again after a full batch); failures wait a turn."""
        while not self._stopping.is_set():
            started_ns = time.time_ns()
            try:
                response = await self._room.ExpireWaitpoints(
                    room_pb2.RoomServiceExpireWaitpointsRequest(limit=_EXPIRE_BATCH), timeout=_ROOM_TIMEOUT_SECONDS
                )
                abandoned = await self._room.AbandonStaleRuns(
                    room_pb2.RoomServiceAbandonStaleRunsRequest(
                        older_than_seconds=self._config.abandon_after_seconds, limit=_EXPIRE_BATCH
                    ),
                    timeout=_ROOM_TIMEOUT_SECONDS,
                )
                not_started = await self._room.RecordNotStartedRuns(
                    room_pb2.RoomServiceRecordNotStartedRunsRequest(
                        older_than_seconds=self._config.not_started_after_seconds, limit=_EXPIRE_BATCH
                    ),
                    timeout=_ROOM_TIMEOUT_SECONDS,
                )
            except Exception as exc:
                _log.warning(
                    "housekeeping (expiry, abandoned runs, runs not started) failed (%s); trying again next interval",
                    _describe(exc),
                )
            else:
                self.expired += response.expired
                self.abandoned += abandoned.abandoned
                self.not_started += not_started.recorded
                if not_started.recorded:
                    _log.warning(
                        "recorded %d runs as not started: their wakes were delivered, no run read the room, "
                        "and they are delivered again",
                        not_started.recorded,
                    )
                # Not traced while idle: a pass that changed something is recorded as one span.
                counts = {
                    "expired": response.expired,
                    "abandoned": abandoned.abandoned,
                    "not_started": not_started.recorded,
                }
                record_housekeeping("housekeeping", started_ns, counts, run_ids=response.run_ids)
                full = (response.expired, abandoned.abandoned, not_started.checked)
                if max(full) >= _EXPIRE_BATCH:
                    continue
            await self._sleep(self._config.expire_interval_seconds)

    async def _lease(self, max_wakes: int) -> list[common_pb2.Wake]:
        response = await self._room.LeaseWakes(
            room_pb2.RoomServiceLeaseWakesRequest(
                lease_owner=self.lease_owner, max_wakes=max_wakes, lease_seconds=self._config.lease_seconds
            ),
            timeout=_ROOM_TIMEOUT_SECONDS,
        )
        return list(response.wakes)

    async def _deliver(self, wake: common_pb2.Wake, lease_ends: float, batch: _BatchStart | None = None) -> None:
        """One wake, one trace: its delivery span is the root of StartRun, the run and the settling."""
        with wake_delivery_span(wake):
            await self._start_and_settle(wake, lease_ends, batch)

    async def _start_and_settle(
        self, wake: common_pb2.Wake, lease_ends: float, batch: _BatchStart | None = None
    ) -> None:
        """Start the wake's run (its item of ``batch``'s StartRuns call, else its own StartRun);
        settle DELIVERED when a run holds the wake's ledger row (this one, or an earlier delivery's),
        RETRY otherwise."""
        request = runtime_pb2.StartRunRequest(
            agent_id=wake.agent_id,
            wake_id=wake.wake_id,
            room_id=wake.room_id,
            wake_kind=wake.kind,
            wake_source_id=wake.source_id,
        )
        started = None if batch is None else await batch.start(request)
        if started is None:  # delivered alone: no batch, or a Runtime without StartRuns
            started = await self._start_one(request)
        error = started.error
        response = started.response
        if response is not None:
            annotate(run_id=response.run_id)  # "deliver wake" names the run StartRun started
            if response.result == runtime_pb2.START_RUN_RESULT_ALREADY_CLAIMED and not response.row_held:
                # A Runtime without the fence: whether the claim's run holds the row is read from the Room.
                error = await self._unrecorded_claim(wake, response.run_id)
            elif response.result not in _DELIVERED_RESULTS:
                error = f"unexpected StartRun result {response.result}"
            if not error:
                _log.info(
                    "wake %s delivered (attempt %d): StartRun answered %s",
                    wake.wake_id,
                    wake.delivery_attempts,
                    runtime_pb2.StartRunResult.Name(response.result).removeprefix("START_RUN_RESULT_"),
                )
                await self._settle(wake, lease_ends, room_pb2.WAKE_SETTLEMENT_DELIVERED)
                return
        await self._settle(wake, lease_ends, room_pb2.WAKE_SETTLEMENT_RETRY, error=error)

    async def _unrecorded_claim(self, wake: common_pb2.Wake, run_id: str) -> str:
        """After ALREADY_CLAIMED: "" when the wake's run has its ledger row; otherwise why the wake is
        delivered again (logged and counted: a claim whose run stopped before it read the room)."""
        try:
            got = await self._room.GetRun(
                room_pb2.RoomServiceGetRunRequest(run_id=run_id), timeout=_ROOM_TIMEOUT_SECONDS
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                return f"StartRun answered ALREADY_CLAIMED and run {run_id} could not be read ({_describe(exc)})"
            status = "no ledger row"
        else:
            if got.run.status != common_pb2.RUN_STATUS_NOT_STARTED:
                return ""
            status = "only a NOT_STARTED ledger row"
        self.unrecorded_claims += 1
        self._metrics.unrecorded_claim()
        _log.warning(
            "wake %s (attempt %d): StartRun answered ALREADY_CLAIMED but its run %s has %s: the claim's run "
            "stopped before it read the room and nothing was done; delivering it again",
            wake.wake_id,
            wake.delivery_attempts,
            run_id,
            status,
        )
        return f"ALREADY_CLAIMED, but run {run_id} has {status}: no run has read the room"

    async def _start_one(self, request: runtime_pb2.StartRunRequest) -> _Started:
        """One wake's own StartRun call."""
        try:
            response = await self._runtime.StartRun(request, timeout=self._config.start_run_timeout_seconds)
        except Exception as exc:
            return _Started(None, _describe(exc))
        return _Started(response, "")

    def _new_batch(self, size: int) -> _BatchStart | None:
        """The StartRuns call of a leased batch of ``size`` wakes; None while the Runtime is known to
        have no StartRuns (each wake then goes in its own StartRun)."""
        if asyncio.get_running_loop().time() < self._per_wake_until:
            return None
        return _BatchStart(size, self._start_batch)

    async def _start_batch(self, items: list[runtime_pb2.StartRunsItem]) -> list[_Started] | None:
        """One StartRuns call: each item's answer, or None when the Runtime has no StartRuns (each
        wake is then started with its own StartRun, and so are the next batches for a while)."""
        try:
            response: runtime_pb2.StartRunsResponse = await self._runtime.StartRuns(
                runtime_pb2.StartRunsRequest(items=items), timeout=self._config.start_run_timeout_seconds
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                if asyncio.get_running_loop().time() >= self._per_wake_until:
                    _log.warning(
                        "the Runtime has no StartRuns (%s); starting one wake per StartRun for %g s",
                        exc.details(),
                        _PER_WAKE_SECONDS,
                    )
                self._per_wake_until = asyncio.get_running_loop().time() + _PER_WAKE_SECONDS
                return None
            return [_Started(None, _describe(exc))] * len(items)
        except Exception as exc:
            return [_Started(None, _describe(exc))] * len(items)
        answers = response.answers
        if len(answers) != len(items):
            error = f"StartRuns answered {len(answers)} items of {len(items)}"
            return [_Started(None, error)] * len(items)
        return [
            _Started(None, f"{_code_name(a.error_code)}: {a.error_message}")
            if a.error_code
            else _Started(a.response, "")
            for a in answers
        ]

    async def _settle(
        self,
        wake: common_pb2.Wake,
        lease_ends: float,
        settlement: room_pb2.WakeSettlement.ValueType,
        *,
        error: str = "",
    ) -> None:
        """Queue the wake's settlement for the next SettleWakes call and wait until it is answered."""
        retry_after_ms = 0
        if settlement == room_pb2.WAKE_SETTLEMENT_RETRY:
            delay = self._config.retry_delay_seconds(wake.delivery_attempts)
            retry_after_ms = int(delay * (1.0 + _JITTER_FRACTION * self._random()) * 1000)
        item = room_pb2.WakeToSettle(
            wake_id=wake.wake_id,
            lease_owner=self.lease_owner,
            settlement=settlement,
            retry_after_ms=retry_after_ms,
            last_error=error[:_MAX_ERROR_CHARS],
        )
        try:
            settled = await self._settler.submit(_Settlement(item, lease_ends))
        except Exception:
            settled = False  # logged for its whole batch by _send_settlements
        if not settled:
            return  # logged; the lease will expire and the wake be delivered again
        if settlement == room_pb2.WAKE_SETTLEMENT_DELIVERED:
            self.delivered += 1
        else:
            self.retried += 1
            _log.info("wake %s not delivered (%s); retry in %d ms", wake.wake_id, error, retry_after_ms)

    async def _send_settlements(self, batch: list[_Settlement]) -> list[bool]:
        """One batch of settlements: settled or not, one per item. A call that fails is logged and raised."""
        try:
            response = await self._settle_batch([s.item for s in batch], min(s.lease_ends for s in batch))
        except Exception as exc:
            # The leases will expire and the wakes be delivered again; the claim makes that harmless.
            _log.warning(
                "settling %d wakes failed (%s); their leases will expire and they will be delivered again",
                len(batch),
                _describe(exc),
            )
            raise
        for result in response.results:
            if not result.settled:
                _log.warning("settling wake %s failed: %s", result.wake_id, result.error)
        settled = [r.settled for r in response.results][: len(batch)]
        return settled + [False] * (len(batch) - len(settled))

    async def _settle_batch(
        self, batch: list[room_pb2.WakeToSettle], lease_ends: float
    ) -> room_pb2.RoomServiceSettleWakesResponse:
        """One SettleWakes call, tried again on UNAVAILABLE until shortly before ``lease_ends`` (the
        first of the batch's leases to end), so a Room back from an outage settles the wakes at once
        rather than after their leases (settling twice is harmless: a repeated DELIVERED answers
        settled, a repeated RETRY refused)."""
        request = room_pb2.RoomServiceSettleWakesRequest(wakes=batch)
        loop = asyncio.get_running_loop()
        give_up = lease_ends - min(_SETTLE_LEASE_MARGIN_SECONDS, self._config.lease_seconds / 10)
        pause = _SETTLE_RETRY_FIRST_PAUSE
        while True:
            try:
                response: room_pb2.RoomServiceSettleWakesResponse = await self._room.SettleWakes(
                    request, timeout=_ROOM_TIMEOUT_SECONDS
                )
                return response
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or loop.time() + pause > give_up:
                    raise
            await asyncio.sleep(pause)
            pause = min(1.0, pause * 2)


def _code_name(code: int) -> str:
    return _CODE_NAMES.get(code, f"status {code}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
