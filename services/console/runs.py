"""The runs pages: the company's run history (filtered, paged, newest first), one run as a timeline,
and the approvals waiting for the company's decision."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from urllib.parse import urlencode

import grpc
from starlette.requests import Request
from starlette.responses import Response

from quayutec.jaeger import trace_ids, trace_page
from quayutec.v1 import common_pb2, gateway_pb2
from services.client import STATUS_NAMES
from services.console.live import encode_cursors, first_cursor, first_cursors
from services.console.names import company_and_room_names, company_names
from services.console.session import Session, form_of
from services.console.timeline import ENDED, effects, error_words, steps, timeline
from services.console.web import PAGE, FormError, Refusal, field, page, remember_person, words

DECISIONS = {
    common_pb2.DECISION_PENDING: "pending",
    common_pb2.DECISION_APPROVED: "approved",
    common_pb2.DECISION_DENIED: "denied",
}
STATUSES = {name: value for value, name in STATUS_NAMES.items() if value}
WAKES = {
    common_pb2.WAKE_KIND_MESSAGE: "a message that mentioned the agent",
    common_pb2.WAKE_KIND_TASK: "a task sent to the agent",
    common_pb2.WAKE_KIND_DECISION: "your company's decision on held actions",
}
# The runs page's filters, as its URL names them.
FILTERS = ("room", "agent", "status", "from", "to")
MAX_TOKEN_CHARS = 500


def pretty_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


def _moment(raw: str, what: str) -> datetime | None:
    """A datetime-local value ("2026-03-01T12:00"), read as UTC."""
    if not raw:
        return None
    try:
        return datetime.fromisoformat(raw).replace(tzinfo=UTC)
    except ValueError:
        raise FormError(f"{what} must be a date and time (YYYY-MM-DDTHH:MM), got {raw[:40]!r}.") from None


def runs_request(chosen: dict[str, str]) -> gateway_pb2.ListRunsRequest:
    """ListRuns for the runs page's filters (FormError for one that cannot be used)."""
    status = chosen["status"]
    if status and status not in STATUSES:
        raise FormError(f"There is no status {status[:40]!r}; choose one of the list.")
    if len(chosen["page"]) > MAX_TOKEN_CHARS:
        raise FormError("That page link is not valid; start again from the newest runs.")
    request = gateway_pb2.ListRunsRequest(
        agent_id=chosen["agent"],
        room_id=chosen["room"],
        status=STATUSES.get(status, common_pb2.RUN_STATUS_UNSPECIFIED),
        page_size=PAGE,
        page_token=chosen["page"],
    )
    after, before = _moment(chosen["from"], "From"), _moment(chosen["to"], "To")
    if after is not None:
        request.started_after.FromDatetime(after)
    if before is not None:
        request.started_before.FromDatetime(before)
    return request


async def runs(request: Request) -> Response:
    s = Session(request)
    chosen = {k: request.query_params.get(k, "").strip()[: MAX_TOKEN_CHARS + 1] for k in (*FILTERS, "page")}
    part = request.query_params.get("part") == "list"
    # The newest page follows runs as they start, park and end (the approvals page's stream): the
    # rooms' cursors first, then the list, so a change between the two reaches the page.
    cursors = await first_cursors(s) if not part and not chosen["page"] else None
    names_task = asyncio.ensure_future(company_names(s))
    error = ""
    listed: list[common_pb2.Run] = []
    next_token = ""
    try:
        got = await s.call("ListRuns", runs_request(chosen))
        listed, next_token = list(got.runs), got.next_page_token
    except FormError as exc:
        error = str(exc)
    except grpc.aio.AioRpcError as exc:
        if exc.code() not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
            names_task.cancel()
            raise
        error = words(exc)[1]
    names = await names_task
    filters = {k: chosen[k] for k in FILTERS if chosen[k]}
    context = {
        "title": "Runs",
        "runs": listed,
        "names": names,
        "chosen": chosen,
        "filtered": bool(filters),
        "statuses": list(STATUSES),
        "newest_url": "/runs" + (f"?{urlencode(filters)}" if filters else ""),
        "older_url": f"/runs?{urlencode({**filters, 'page': next_token})}" if next_token else "",
        "error": error,
        "events": f"/approvals/events?after={encode_cursors(cursors)}" if cursors is not None and not error else "",
        "refresh": f"/runs?{urlencode({**filters, 'part': 'list'})}",
    }
    return page(request, "runs_list.html" if part else "runs.html", context, 400 if error else 200)


def trace_links(jaeger_url: str, run: common_pb2.Run) -> list[dict[str, str]]:
    """Each trace of the run, oldest first (its first, then one per continuation after a decision):
    its id, its label and, when QUAYUTEC_CONSOLE_JAEGER_URL is set, Jaeger's page of it (``href``;
    empty otherwise). Another trace viewer is one more href here."""
    ids = trace_ids(run.trace_id, run.trace_ids)
    links = []
    for number, trace_id in enumerate(ids):
        if number == 0:
            label = "the trace" if len(ids) == 1 else "the first trace"
        else:
            label = "the continuation's trace" if len(ids) == 2 else f"continuation {number}'s trace"
        links.append({"trace_id": trace_id, "label": label, "href": trace_page(jaeger_url, trace_id)})
    return links


async def run(request: Request) -> Response:
    s = Session(request)
    run_id = request.path_params["run_id"]
    got = await s.call("GetRun", gateway_pb2.GetRunRequest(run_id=run_id))
    names = await company_and_room_names(s, {got.run.room_id})
    cursor = None
    if got.run.status not in ENDED:
        # Read again after taking the room's cursor: a change after this read reaches the page live.
        cursor = await first_cursor(s, got.run.room_id)
        got = await s.call("GetRun", gateway_pb2.GetRunRequest(run_id=run_id))
    r: common_pb2.Run = got.run
    approval = got.approval if got.HasField("approval") else None
    reply = ""
    if r.posted_message_id:  # the reply's own words, not only a link to them
        posted = await s.call(
            "GetMessage", gateway_pb2.GetMessageRequest(room_id=r.room_id, message_id=r.posted_message_id)
        )
        reply = posted.message.body
    return page(
        request,
        "run.html",
        {
            "title": f"Run of {names.agent(r.agent_id).name}",
            "run": r,
            "names": names,
            "status": STATUS_NAMES[r.status],
            "ended": r.status in ENDED,
            "line": timeline(r, approval),
            "steps": steps(r),
            "effects": effects(r),
            "error_words": error_words(r),
            "woken_by": WAKES.get(r.wake_kind, "a wake"),
            "wake_message": r.wake_source_id if r.wake_kind == common_pb2.WAKE_KIND_MESSAGE else "",
            "trace_links": trace_links(request.app.state.config.jaeger_url, r),
            "cursor": cursor,
            "reply": reply,
        },
    )


async def approvals(request: Request) -> Response:
    s = Session(request)
    notice = error = ""
    if request.method == "POST":
        form = await form_of(request)
        with Refusal() as refused:
            person = field(form, "person", "Your name", limit=200)
            remember_person(request, person)
            index = field(form, "index", "The action", limit=10)
            if not index.isdigit():
                raise FormError("The action number is not valid.")
            approve = form.get("decision") == "approve"
            got = await s.call(
                "DecideApproval",
                gateway_pb2.DecideApprovalRequest(
                    token=field(form, "token", "The approval", limit=200),
                    index=int(index),
                    person=person,
                    approve=approve,
                ),
            )
            verb = "Approved" if approve else "Denied"
            notice = f"{verb} action #{index}." + (" The run continues." if got.completed else "")
            if got.already_decided:
                notice = f"Action #{index} was already decided that way."
        error = refused.text
    part = request.query_params.get("part") == "list"
    # The rooms' cursors first, then the lists: the live stream resumes after these cursors, so a run
    # parked between this read and the page's subscription is replayed to it, never lost.
    cursors = None if part else await first_cursors(s)
    pending = await s.call(
        "ListApprovals",
        gateway_pb2.ListApprovalsRequest(status=common_pb2.WAITPOINT_STATUS_PENDING, page_size=PAGE),
    )
    context = {
        "events": f"/approvals/events?after={encode_cursors(cursors)}" if cursors is not None else "",
        "title": "Approvals",
        "waitpoints": pending.waitpoints,
        # An action may name another company's agent: the names of each room an approval is in too.
        "names": await company_and_room_names(s, {w.room_id for w in pending.waitpoints}),
        "decisions": DECISIONS,
        "pretty": pretty_json,
        "notice": notice,
        "error": error,
    }
    name = "approvals_list.html" if part else "approvals.html"
    return page(request, name, context, 400 if error else 200)
