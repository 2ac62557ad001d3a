"""A run as people read a trace: its steps on a time axis with their durations, its error in words, and
what it posted and wrote and what it did not.

Everything comes from the run's ledger row and the approval it parked on (GetRun). Measured: each model
request (sent at, took), the wait after it, when the run parked, when each held action was decided.
The rest is the time between them: before the first request (the claim and the room read), after the
last (the reply and the writes), after the decision (the decided writes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from quayutec.v1 import common_pb2
from services.client import ACTION_NAMES, OUTCOME_NAMES, STATUS_NAMES
from services.console.web import duration, when
from services.gateway.oidc import issuer_host

ENDED = {common_pb2.RUN_STATUS_SUCCEEDED, common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STATUS_TIMED_OUT}
# The width of the time axis, in the SVG's own units.
AXIS = 1000

# A model request's error class (services/runtime/model/classify.py) in words.
CLASS_WORDS = {
    "rate_limited": "the model provider kept refusing it for too many requests (HTTP 429)",
    "overloaded": "the model provider was overloaded",
    "server_error": "the model provider failed on its side",
    "timeout": "the model provider did not answer in time",
    "connection": "the model provider could not be reached",
    "transport": "the connection to the model provider failed",
    "bad_target": "the model address is not usable",
    "key_rejected": "the model provider rejected the agent's key: register the agent again with a valid key",
    "permission": "the agent's key may not use its model",
    "unknown_model": "the model provider does not know the agent's model",
    "not_found": "the model provider answered 'not found'",
    "quota": "the provider account has no quota left",
    "credit": "the provider account has no credit left",
    "spend_limit": "the provider account reached its spending limit",
    "billing": "the provider account has a billing problem",
    "malformed": "the model provider refused the request as malformed",
    "too_large": "the request was too large for the model",
    "conflict": "the model provider answered 'conflict'",
    "response_too_large": "the provider's answer was longer than the Runtime reads "
    "(QUAYUTEC_RUNTIME_MODEL_MAX_RESPONSE_BYTES)",
    "egress_refused": "the agent's own model address is not allowed (it must be https, to a public address)",
    "unexpected_status": "the model provider gave an unexpected answer",
}
# A run's error (its ledger's words, by how they start) as a class and in words.
RUN_ERRORS = (
    ("model call failed", "model", ""),
    ("stopped after", "time_limit", "it reached its limit of active time (QUAYUTEC_RUNTIME_RUN_SECONDS)"),
    ("room call failed", "room", "a call to the Room failed (the room may have been left, or was unreachable)"),
    ("declared actions refused", "bad_actions", "the model declared actions that cannot be carried out"),
    ("the runtime shut down", "shutdown", "the Runtime shut down during the run"),
    ("abandoned", "abandoned", "it made no progress for too long and was ended by housekeeping"),
)
OUTCOME_WORDS = {
    common_pb2.ACTION_OUTCOME_PENDING: "decided, not done yet",
    common_pb2.ACTION_OUTCOME_DONE: "done",
    common_pb2.ACTION_OUTCOME_HELD: "held for your company's decision",
    common_pb2.ACTION_OUTCOME_DENIED: "denied",
    common_pb2.ACTION_OUTCOME_NOT_DONE: "not done",
    common_pb2.ACTION_OUTCOME_FAILED: "failed",
    common_pb2.ACTION_OUTCOME_REFUSED: "refused by a rule of the room",
}
OUTCOME_STATE = {
    common_pb2.ACTION_OUTCOME_DONE: "ok",
    common_pb2.ACTION_OUTCOME_HELD: "wait",
    common_pb2.ACTION_OUTCOME_PENDING: "wait",
}


# A NOT_STARTED run (its wake delivered, no run has read the room) in a few words.
NOT_STARTED_WORDS = "no run has read the room yet, nothing was done; the wake is delivered again"


def _dt(ts: Timestamp) -> datetime | None:
    return ts.ToDatetime(UTC) if ts.seconds or ts.nanos else None


@dataclass(frozen=True)
class Bar:
    """One step on the time axis: from ``start_ms`` after the run started, for ``duration_ms``."""

    what: str
    detail: str
    start_ms: float
    duration_ms: float
    state: str = ""  # "", "bad", "wait", "idle"

    def x(self, total_ms: float) -> int:
        return round(AXIS * self.start_ms / total_ms) if total_ms else 0

    def width(self, total_ms: float) -> int:
        """At least 2 units wide, so a step of no measurable time still shows."""
        if not total_ms:
            return AXIS
        return max(2, min(AXIS - self.x(total_ms), round(AXIS * self.duration_ms / total_ms)))

    @property
    def took(self) -> str:
        return duration(self.duration_ms)


@dataclass
class Timeline:
    bars: list[Bar] = field(default_factory=list)
    total_ms: float = 0.0
    parked_ms: float = 0.0
    # True when the model requests carry no send time (rows recorded before it was kept).
    estimated: bool = False

    @property
    def ticks(self) -> list[str]:
        """The axis' labels at 0, a quarter, half, three quarters and the end."""
        return [duration(self.total_ms * k / 4) if k else "0" for k in range(5)]


def timeline(run: common_pb2.Run, approval: common_pb2.Waitpoint | None, now: datetime | None = None) -> Timeline:
    """The run's steps on a time axis (milliseconds from its start), in the order they happened."""
    now = now or datetime.now(UTC)
    t0 = _dt(run.started_at) or now
    end = _dt(run.ended_at) or (now if run.status not in ENDED else _dt(run.updated_at) or now)

    def ms(at: datetime) -> float:
        return max(0.0, (at - t0).total_seconds() * 1000)

    line = Timeline()
    bars = line.bars
    if run.status == common_pb2.RUN_STATUS_NOT_STARTED:
        # Delivered, but no run has read the room: one waiting bar from when that was recorded.
        line.total_ms = ms(now)
        bars.append(Bar("not started", NOT_STARTED_WORDS, 0.0, line.total_ms, "wait"))
        return line
    cursor = 0.0  # where the measured steps so far end
    attempts = list(run.model_attempts)
    line.estimated = bool(attempts) and not all(a.HasField("started_at") for a in attempts)
    for a in attempts:
        sent = _dt(a.started_at)
        start = cursor if sent is None or line.estimated else ms(sent)
        if not bars and start > 0:
            bars.append(Bar("claim and room read", "before the first model request", 0.0, start, "idle"))
        ok = 200 <= a.status_code < 300 and a.error_class in ("", "ok")
        status = str(a.status_code) if a.status_code else "no answer"
        detail = status if ok else f"{status}, {a.error_class}" + (f": {a.detail}" if a.detail else "")
        bars.append(Bar(f"model request {a.number}", detail, start, float(a.duration_ms), "" if ok else "bad"))
        cursor = start + a.duration_ms
        if a.wait_seconds:
            wait = a.wait_seconds * 1000
            bars.append(
                Bar(
                    f"wait before request {a.number + 1}",
                    "as the provider asked, or the back-off",
                    cursor,
                    wait,
                    "wait",
                )
            )
            cursor += wait

    parked_at = _dt(approval.created_at) if approval is not None else None
    decided_at: datetime | None = None
    if approval is not None and parked_at is not None:
        decisions = [d for h in approval.held if (d := _dt(h.decided_at)) is not None]
        if approval.status == common_pb2.WAITPOINT_STATUS_COMPLETED and decisions:
            decided_at = max(decisions)
        elif approval.status == common_pb2.WAITPOINT_STATUS_EXPIRED:
            decided_at = _dt(approval.expires_at)
    after_model = ms(parked_at) if parked_at is not None else ms(end)
    if attempts and after_model > cursor:
        answered = bool(run.posted_message_id or run.actions) or run.status not in ENDED
        what, why = ("reply and writes", "after the model answered") if answered else ("ending", "nothing posted")
        bars.append(Bar(what, why, cursor, after_model - cursor, "idle"))
    elif not attempts and after_model > 0:
        bars.append(Bar("claim and room read", "no model request was made", 0.0, after_model, "idle"))

    if approval is not None and parked_at is not None:
        start = ms(parked_at)
        until = decided_at or (now if run.status == common_pb2.RUN_STATUS_PARKED else end)
        line.parked_ms = max(0.0, ms(until) - start)
        waiting = "decided" if decided_at is not None else "waiting for your company's decision"
        if approval.status == common_pb2.WAITPOINT_STATUS_EXPIRED:
            waiting = "expired before a decision"
        bars.append(Bar("parked", waiting, start, line.parked_ms, "wait"))
        for h in approval.held:
            decided = _dt(h.decided_at)
            took = ms(decided) - start if decided is not None else line.parked_ms
            verdict = {common_pb2.DECISION_APPROVED: "approved", common_pb2.DECISION_DENIED: "denied"}.get(h.decision)
            detail = f"{verdict} by {h.decided_by}" if verdict else "not decided"
            if verdict and h.decided_by_verified_by:
                detail += f", verified by {issuer_host(h.decided_by_verified_by)}"
            bars.append(Bar(f"held: #{h.index} {ACTION_NAMES[h.kind]}", detail, start, took, "wait"))
        if decided_at is not None and run.status in ENDED and end > decided_at:
            bars.append(Bar("continued", "the decided actions", ms(decided_at), ms(end) - ms(decided_at), "idle"))
    line.total_ms = max([ms(end), *(b.start_ms + b.duration_ms for b in bars)], default=0.0)
    return line


# -- the error in words ------------------------------------------------------------------------------


def error_class(run: common_pb2.Run) -> str:
    """A short class of why a run did not succeed ("" when it did, or has not ended)."""
    if run.status not in ENDED or run.status == common_pb2.RUN_STATUS_SUCCEEDED:
        return ""
    for start, name, _ in RUN_ERRORS:
        if run.error.startswith(start):
            if name == "model" and run.model_attempts:
                return run.model_attempts[-1].error_class or "model"
            return name
    return "timed_out" if run.status == common_pb2.RUN_STATUS_TIMED_OUT else "other"


def error_words(run: common_pb2.Run) -> str:
    """Why the run did not succeed, as a sentence a person acts on ("" when it did)."""
    if not run.error or run.status in (common_pb2.RUN_STATUS_SUCCEEDED, common_pb2.RUN_STATUS_NOT_STARTED):
        return ""
    said = ""
    for start, name, sentence in RUN_ERRORS:
        if run.error.startswith(start):
            said = sentence
            if name == "model" and run.model_attempts:
                last = run.model_attempts[-1]
                n = len(run.model_attempts)
                said = f"{CLASS_WORDS.get(last.error_class, 'the model call failed')} ({n} request{'s' * (n > 1)})"
            break
    said = said or run.error
    left = "nothing was posted or written" if not _anything_done(run) else "what it had done stays done"
    return f"{STATUS_NAMES[run.status].replace('_', ' ').capitalize()}: {said}; {left}."


def _anything_done(run: common_pb2.Run) -> bool:
    return bool(run.posted_message_id) or any(a.outcome == common_pb2.ACTION_OUTCOME_DONE for a in run.actions)


# -- what was posted and written ---------------------------------------------------------------------


def arguments(text: str) -> dict[str, Any]:
    """An action's arguments as a mapping ({} when they are not a JSON object)."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def shown(value: Any) -> str:
    """One argument's value as a person reads it: text as is, anything else as compact JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def effects(run: common_pb2.Run) -> list[dict[str, Any]]:
    """Each thing the run set out to do (the reply, each declared action), done or not, with why."""
    found: list[dict[str, Any]] = []
    if run.posted_message_id:
        found.append({"what": "reply", "outcome": "posted", "state": "ok", "message_id": run.posted_message_id})
    elif run.status in ENDED:
        found.append({"what": "reply", "outcome": "not posted", "state": "bad", "message_id": ""})
    for a in run.actions:
        outcome = OUTCOME_WORDS.get(a.outcome, OUTCOME_NAMES[a.outcome])
        found.append(
            {
                "what": f"#{a.index} {ACTION_NAMES[a.kind]}",
                "arguments": arguments(a.arguments_json),
                "outcome": outcome,
                "detail": a.detail,
                "rule": a.rule,
                "result_id": a.result_id,
                "state": OUTCOME_STATE.get(a.outcome, "bad"),
            }
        )
    return found


def summary(run: common_pb2.Run) -> str:
    """What a run posted and wrote, in a few words, for a list of runs."""
    parts = []
    if run.posted_message_id:
        parts.append("reply posted")
    done = sum(a.outcome == common_pb2.ACTION_OUTCOME_DONE for a in run.actions)
    held = sum(a.outcome == common_pb2.ACTION_OUTCOME_HELD for a in run.actions)
    undone = len(run.actions) - done - held
    if done:
        parts.append(f"{done} written")
    if held:
        parts.append(f"{held} held")
    if undone:
        parts.append(f"{undone} not written")
    return " · ".join(parts) or ("nothing posted" if run.status in ENDED else "")


def started(run: common_pb2.Run) -> str:
    return when(run.started_at)


def steps(run: common_pb2.Run) -> list[dict[str, str]]:
    """The run's ledger as the steps a person follows, in order, each with its outcome."""
    if run.status == common_pb2.RUN_STATUS_NOT_STARTED:
        return [{"what": "not started", "detail": f"wake {run.wake_id}: {NOT_STARTED_WORDS}", "state": "wait"}]
    items: list[dict[str, str]] = [{"what": "claimed", "detail": f"wake {run.wake_id}"}]
    if run.step >= common_pb2.RUN_STEP_ROOM_READ:
        items.append({"what": "room read", "detail": ""})
    for attempt in run.model_attempts:
        parts = [str(attempt.status_code) if attempt.status_code else "no answer"]
        ok = 200 <= attempt.status_code < 300 and attempt.error_class in ("", "ok")
        if not ok and attempt.error_class:
            parts.append(attempt.error_class)
        if attempt.duration_ms:
            parts.append(f"took {duration(attempt.duration_ms)}")
        if attempt.wait_seconds:
            parts.append(f"waited {attempt.wait_seconds:g} s before the next")
        if attempt.detail and not ok:
            parts.append(attempt.detail)
        items.append(
            {"what": f"model request {attempt.number}", "detail": ", ".join(parts), "state": "" if ok else "bad"}
        )
    if run.step >= common_pb2.RUN_STEP_ACTIONS_DECIDED or run.actions:
        items.append({"what": "decided", "detail": f"{len(run.actions)} action(s)"})
    if run.posted_message_id:
        items.append({"what": "reply posted", "detail": ""})
    for action in run.actions:
        outcome = OUTCOME_NAMES[action.outcome]
        detail = outcome + (f" ({action.detail})" if action.detail else "")
        state = {"denied": "bad", "failed": "bad", "not_done": "bad", "refused": "bad"}.get(outcome, "")
        state = state or {"held": "wait", "pending": "wait"}.get(outcome, "")
        items.append({"what": f"action #{action.index} {ACTION_NAMES[action.kind]}", "detail": detail, "state": state})
    if run.status == common_pb2.RUN_STATUS_PARKED:
        items.append(
            {"what": "parked", "detail": "waiting for your company's decision on held actions", "state": "wait"}
        )
    if run.status in ENDED:
        state = "" if run.status == common_pb2.RUN_STATUS_SUCCEEDED else "bad"
        items.append({"what": "ended", "detail": f"{STATUS_NAMES[run.status]} at {when(run.ended_at)}", "state": state})
    return items
