"""The rooms pages: the company's rooms, one room (its messages, tasks, memory, files and runs, live),
and one message with what the viewer may see of the run that posted it."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import grpc
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from quayutec.v1 import common_pb2, gateway_pb2
from services.console.live import first_cursor
from services.console.names import Names, room_names
from services.console.session import MAX_MENTIONS, Session, form_of
from services.console.web import (
    PAGE,
    UNSURE,
    FormError,
    Refusal,
    field,
    page,
    remember_person,
    typed,
    words,
)

# How many of the company's runs in the room its page shows (the runs page has them all).
ROOM_RUNS = 10


def mentions(form: FormData) -> list[str]:
    """The agents a message wakes: the ones ticked in the room's picker."""
    ticked = list(dict.fromkeys(v.strip() for v in form.getlist("mention") if isinstance(v, str) and v.strip()))
    if len(ticked) > MAX_MENTIONS or any(len(x) > 64 for x in ticked):
        raise FormError(f"Wake at most {MAX_MENTIONS} agents at once.")
    return ticked


async def answer_invitation(s: Session, form: FormData) -> str:
    """Accept or decline the form's invitation; the sentence that says what happened."""
    invitation = field(form, "invitation_id", "The invitation", limit=64)
    if form.get("answer") == "accept":
        got = await s.call("AcceptInvitation", gateway_pb2.AcceptInvitationRequest(invitation_id=invitation))
        return f"You joined {got.invitation.room_name}."
    got = await s.call("DeclineInvitation", gateway_pb2.DeclineInvitationRequest(invitation_id=invitation))
    return f"You declined the invitation to {got.invitation.room_name}."


async def _manage_room(s: Session, form: FormData) -> str:
    """Rename or archive the form's room (its creator only: the Room's rule `creator-manages-room`)."""
    room_id = field(form, "room_id", "The room", limit=64)
    if form.get("action") == "archive":
        got = await s.call("ArchiveRoom", gateway_pb2.ArchiveRoomRequest(room_id=room_id))
        return f"{got.room.name} is archived: read-only from now on; its history stays."
    name = field(form, "name", "The new name", limit=200)
    got = await s.call("RenameRoom", gateway_pb2.RenameRoomRequest(room_id=room_id, name=name))
    return f"Renamed to {got.room.name}."


async def rooms(request: Request) -> Response:
    s = Session(request)
    notice = error = ""
    if request.method == "POST":
        form = await form_of(request)
        with Refusal() as refused:
            notice = await (_manage_room(s, form) if form.get("room_id") else answer_invitation(s, form))
        error = refused.text
    listed, invited = await asyncio.gather(
        s.call("ListRooms", gateway_pb2.ListRoomsRequest(page_size=PAGE)),
        s.call(
            "ListInvitations",
            gateway_pb2.ListInvitationsRequest(status=common_pb2.INVITATION_STATUS_PENDING, page_size=PAGE),
        ),
    )
    context = {"title": "Rooms", "rooms": listed.rooms, "invitations": invited.invitations, "notice": notice}
    return page(request, "rooms.html", context | {"error": error}, 400 if error else 200)


async def _post(s: Session, room_id: str, form: FormData) -> str:
    """Send the form's message or task; the notice to show ("" when the page should reload)."""
    person = field(form, "person", "Your name", limit=200)
    remember_person(s.request, person)
    key = field(form, "idem", "The form's key", limit=64)
    if form.get("what") == "task":
        sent = await s.call(
            "SendTask",
            gateway_pb2.SendTaskRequest(
                room_id=room_id,
                person=person,
                to_agent_id=field(form, "to_agent_id", "The agent", limit=64),
                title=field(form, "title", "The title", limit=500),
                body=field(form, "body", "The task", required=False),
                idempotency_key=key,
            ),
        )
        return f"Task “{sent.task.title}” sent."
    await s.call(
        "PostMessage",
        gateway_pb2.PostMessageRequest(
            room_id=room_id,
            person=person,
            body=field(form, "body", "The message"),
            mention_agent_ids=mentions(form),
            idempotency_key=key,
        ),
    )
    return ""


async def room(request: Request) -> Response:
    s = Session(request)
    room_id = request.path_params["room_id"]
    notice = error = ""
    form: FormData | None = None
    idem = str(uuid.uuid4())
    if request.method == "POST":
        form = posted = await form_of(request)
        with Refusal() as refused:
            notice = await _post(s, room_id, posted)
            if not notice:
                return RedirectResponse(f"/rooms/{room_id}", 303)
            form = None  # sent: the form starts empty again
        error = refused.text
        if refused.code in UNSURE:
            # It may have been written: sending it again with the same key writes it at most once.
            sent_key = posted.get("idem")
            idem = sent_key.removesuffix("-t") if isinstance(sent_key, str) and sent_key else idem
    try:
        context = await _room_context(s, room_id)
    except grpc.aio.AioRpcError as exc:
        if form is None or exc.code() == grpc.StatusCode.NOT_FOUND:
            raise
        # The Gateway failed after a failed post: the form still comes back with what was typed.
        context = {"names": Names(s.company_id), "cursor": 0, "members": [], "messages": [], "tasks": []}
        context |= {"memory": [], "files": [], "runs": [], "title": "Room"}
        error = f"{error} {words(exc)[1]}".strip()
    kept = typed(form, "person", "what", "to_agent_id", "title")
    if form is not None:
        kept["task_body" if form.get("what") == "task" else "body"] = str(form.get("body") or "")
    mentioned = set(form.getlist("mention")) if form is not None else set()
    context |= {"room_id": room_id, "idem": idem, "notice": notice, "error": error, "kept": kept}
    context["mentioned"] = mentioned
    return page(request, "room.html", context, 400 if error else 200)


async def _room_context(s: Session, room_id: str) -> dict[str, Any]:
    """Everything the room page lists, read after the room's cursor (the live stream resumes there)."""
    cursor = await first_cursor(s, room_id)
    names, messages, tasks, memory, files, runs, listed = await asyncio.gather(
        room_names(s, room_id),
        s.call("ListMessages", gateway_pb2.ListMessagesRequest(room_id=room_id, page_size=PAGE, newest_first=True)),
        s.call(
            "ListTasks",
            gateway_pb2.ListTasksRequest(room_id=room_id, status=common_pb2.TASK_STATUS_OPEN, page_size=PAGE),
        ),
        s.call("ListMemory", gateway_pb2.ListMemoryRequest(room_id=room_id, page_size=PAGE)),
        s.call("ListFiles", gateway_pb2.ListFilesRequest(room_id=room_id, page_size=PAGE)),
        s.call("ListRuns", gateway_pb2.ListRunsRequest(room_id=room_id, page_size=ROOM_RUNS)),
        s.call("ListRooms", gateway_pb2.ListRoomsRequest(page_size=PAGE)),
    )
    names.rooms = {r.room_id: r.name for r in listed.rooms}
    return {
        "title": names.room(room_id),
        "names": names,
        "cursor": cursor,
        "members": sorted(set(names.companies.values())),
        "messages": list(reversed(messages.messages)),
        "tasks": tasks.tasks,
        "memory": memory.lines,
        "files": files.files,
        "runs": runs.runs,
    }


async def message(request: Request) -> Response:
    """One message and, for an agent's reply, what the viewer may see of the run that posted it: the
    whole run for its own company's agent, that a run of that agent answered for another's."""
    s = Session(request)
    room_id, message_id = request.path_params["room_id"], request.path_params["message_id"]
    got, names, listed = await asyncio.gather(
        s.call("GetMessage", gateway_pb2.GetMessageRequest(room_id=room_id, message_id=message_id)),
        room_names(s, room_id),
        s.call("ListRooms", gateway_pb2.ListRoomsRequest(page_size=PAGE)),
    )
    names.rooms = {r.room_id: r.name for r in listed.rooms}
    m: common_pb2.Message = got.message
    author = names.author(m.author)
    own = m.author.company_id == s.company_id
    title = (
        f"A reply of {author.name}" if m.author.kind == common_pb2.AUTHOR_KIND_AGENT else f"A message of {author.name}"
    )
    context = {"title": title, "room_id": room_id, "message": m, "names": names, "author": author, "own": own}
    return page(request, "message.html", context)
