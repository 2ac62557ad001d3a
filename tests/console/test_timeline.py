"""A run's timeline on a time axis, its error in words and what it posted and wrote, from its ledger row
and the approval it parked on (services/console/timeline.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from google.protobuf.timestamp_pb2 import Timestamp

from quayutec.v1 import common_pb2
from services.console.timeline import effects, error_class, error_words, steps, summary, timeline

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def at(ms: float) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(T0 + timedelta(milliseconds=ms))
    return ts


def attempt(
    number: int, sent_ms: float, took_ms: int, status: int, error: str, wait: float = 0
) -> common_pb2.ModelAttempt:
    a = common_pb2.ModelAttempt(
        number=number, status_code=status, error_class=error, duration_ms=took_ms, wait_seconds=wait
    )
    a.started_at.CopyFrom(at(sent_ms))
    return a


def parked_run() -> tuple[common_pb2.Run, common_pb2.Waitpoint]:
    """Read for 300 ms, a 529 (200 ms), a 2 s wait, a 200 (500 ms), parked at 3.5 s, decided at 13.5 s and
    15.5 s, ended at 16 s."""
    run = common_pb2.Run(
        run_id="r",
        wake_id="w",
        status=common_pb2.RUN_STATUS_SUCCEEDED,
        step=common_pb2.RUN_STEP_ENDED,
        posted_message_id="m",
        active_ms=3600,
        model_attempts=[attempt(1, 300, 200, 529, "overloaded", wait=2.0), attempt(2, 2500, 500, 200, "ok")],
        actions=[
            common_pb2.DeclaredAction(
                index=0,
                kind=common_pb2.ACTION_KIND_REMEMBER,
                arguments_json='{"text": "launch on Friday", "private": false}',
                outcome=common_pb2.ACTION_OUTCOME_DONE,
                result_id="k1",
                detail="approved by Ana",
            ),
            common_pb2.DeclaredAction(
                index=1,
                kind=common_pb2.ACTION_KIND_CREATE_TASK,
                arguments_json='{"title": "Copy"}',
                outcome=common_pb2.ACTION_OUTCOME_DENIED,
                detail="denied by Bo",
            ),
        ],
    )
    run.started_at.CopyFrom(at(0))
    run.ended_at.CopyFrom(at(16_000))
    approval = common_pb2.Waitpoint(status=common_pb2.WAITPOINT_STATUS_COMPLETED)
    approval.created_at.CopyFrom(at(3500))
    for index, kind, decision, by, decided in (
        (0, common_pb2.ACTION_KIND_REMEMBER, common_pb2.DECISION_APPROVED, "Ana", 13_500),
        (1, common_pb2.ACTION_KIND_CREATE_TASK, common_pb2.DECISION_DENIED, "Bo", 15_500),
    ):
        held = approval.held.add(index=index, kind=kind, decision=decision, decided_by=by)
        held.decided_at.CopyFrom(at(decided))
    return run, approval


def test_the_steps_of_a_parked_run_on_the_time_axis() -> None:
    run, approval = parked_run()
    line = timeline(run, approval)
    bars = [(b.what, b.detail, b.start_ms, b.duration_ms, b.state) for b in line.bars]
    assert bars == [
        ("claim and room read", "before the first model request", 0.0, 300.0, "idle"),
        ("model request 1", "529, overloaded", 300.0, 200.0, "bad"),
        ("wait before request 2", "as the provider asked, or the back-off", 500.0, 2000.0, "wait"),
        ("model request 2", "200", 2500.0, 500.0, ""),
        ("reply and writes", "after the model answered", 3000.0, 500.0, "idle"),
        ("parked", "decided", 3500.0, 12_000.0, "wait"),
        ("held: #0 remember", "approved by Ana", 3500.0, 10_000.0, "wait"),
        ("held: #1 create_task", "denied by Bo", 3500.0, 12_000.0, "wait"),
        ("continued", "the decided actions", 15_500.0, 500.0, "idle"),
    ]
    assert (line.total_ms, line.parked_ms, line.estimated) == (16_000.0, 12_000.0, False)
    assert line.ticks == ["0", "4.0 s", "8.0 s", "12 s", "16 s"]
    # On the axis: the wait starts at 500/16000 of its width and lasts 2000/16000 of it.
    wait = line.bars[2]
    assert (wait.x(line.total_ms), wait.width(line.total_ms), wait.took) == (31, 125, "2.0 s")


def test_a_run_still_parked_is_measured_until_now() -> None:
    run, approval = parked_run()
    run.status, run.step = common_pb2.RUN_STATUS_PARKED, common_pb2.RUN_STEP_PARKED
    run.ClearField("ended_at")
    approval.status = common_pb2.WAITPOINT_STATUS_PENDING
    for held in approval.held:
        held.ClearField("decided_at")
        held.decision, held.decided_by = common_pb2.DECISION_PENDING, ""
    line = timeline(run, approval, now=T0 + timedelta(seconds=60))
    parked = next(b for b in line.bars if b.what == "parked")
    assert (parked.detail, parked.start_ms, parked.duration_ms) == ("waiting for your company's decision", 3500, 56_500)
    assert [b.what for b in line.bars][-1] == "held: #1 create_task" and line.total_ms == 60_000


def test_rows_without_send_times_are_laid_out_one_after_the_other() -> None:
    run = common_pb2.Run(status=common_pb2.RUN_STATUS_RUNNING, step=common_pb2.RUN_STEP_MODEL_CALLED)
    run.started_at.CopyFrom(at(0))
    run.model_attempts.add(number=1, status_code=429, error_class="rate_limited", duration_ms=100, wait_seconds=1)
    run.model_attempts.add(number=2, status_code=200, error_class="ok", duration_ms=100)
    line = timeline(run, None, now=T0 + timedelta(seconds=2))
    assert line.estimated
    assert [(b.what, b.start_ms) for b in line.bars] == [
        ("model request 1", 0),
        ("wait before request 2", 100),
        ("model request 2", 1100),
        ("reply and writes", 1200),
    ]


def test_the_error_in_words_and_what_was_not_done() -> None:
    run = common_pb2.Run(
        status=common_pb2.RUN_STATUS_FAILED,
        step=common_pb2.RUN_STEP_ENDED,
        error="model call failed: rate_limited after 3 requests: 429",
        model_attempts=[
            common_pb2.ModelAttempt(number=n, status_code=429, error_class="rate_limited") for n in (1, 2, 3)
        ],
    )
    assert error_class(run) == "rate_limited"
    assert error_words(run) == (
        "Failed: the model provider kept refusing it for too many requests (HTTP 429) (3 requests); "
        "nothing was posted or written."
    )
    assert effects(run) == [{"what": "reply", "outcome": "not posted", "state": "bad", "message_id": ""}]
    assert summary(run) == "nothing posted"
    timed_out = common_pb2.Run(
        status=common_pb2.RUN_STATUS_TIMED_OUT, error="stopped after 120 s of active time", posted_message_id="m"
    )
    assert error_class(timed_out) == "time_limit"
    assert error_words(timed_out).endswith("(QUAYUTEC_RUNTIME_RUN_SECONDS); what it had done stays done.")
    assert error_class(common_pb2.Run(status=common_pb2.RUN_STATUS_SUCCEEDED)) == ""


def test_what_a_run_posted_and_wrote() -> None:
    run, _ = parked_run()
    assert summary(run) == "reply posted · 1 written · 1 not written"
    found = effects(run)
    assert [(e["what"], e["outcome"], e["state"]) for e in found] == [
        ("reply", "posted", "ok"),
        ("#0 remember", "done", "ok"),
        ("#1 create_task", "denied", "bad"),
    ]
    assert found[1]["arguments"] == {"text": "launch on Friday", "private": False}
    assert (found[1]["result_id"], found[2]["detail"]) == ("k1", "denied by Bo")
    assert [(s["what"], s.get("state", "")) for s in steps(run)][-3:] == [
        ("action #0 remember", ""),
        ("action #1 create_task", "bad"),
        ("ended", ""),
    ]


def test_a_run_not_started_is_one_waiting_step_with_its_reason_and_no_error() -> None:
    reason = "not started: the wake was delivered once and no run has read the room; nothing was done; ..."
    run = common_pb2.Run(run_id="r", wake_id="w", status=common_pb2.RUN_STATUS_NOT_STARTED, error=reason)
    run.started_at.CopyFrom(at(0))
    line = timeline(run, None, now=T0 + timedelta(seconds=90))
    assert [(b.what, b.start_ms, b.duration_ms, b.state) for b in line.bars] == [("not started", 0, 90_000, "wait")]
    assert line.total_ms == 90_000
    assert steps(run) == [
        {
            "what": "not started",
            "detail": "wake w: no run has read the room yet, nothing was done; the wake is delivered again",
            "state": "wait",
        }
    ]
    # Not a failure: no error in words, nothing said to be not posted, no error class in the history.
    assert (error_words(run), error_class(run), effects(run), summary(run)) == ("", "", [], "")
