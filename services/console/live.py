"""Live updates: the Gateway's WatchRoom and WatchRooms streams relayed to the page as Server-Sent Events.

A page that lists, then follows, takes its cursor(s) *before* its lists (``first_cursor`` for a room,
``first_cursors`` for every room of the company) and hands them to its event stream, which resumes
after them: a change that lands between the render and the subscription is replayed, never lost.
The stream sends ``live`` only once the Gateway's first heartbeat confirms the subscription (the
replay caught up); the page shows "Live" then, not when the connection opens.

Limits: a sign-in holds at most QUAYUTEC_CONSOLE_MAX_STREAMS_PER_SESSION open streams on one console
replica (429 beyond, naming the limit); the approvals page follows every room in one WatchRooms
stream. A cursor from the page (``after``, ``Last-Event-ID``) is parsed strictly: anything else, of
any size, is 400 with words, as is a cursor past the room's newest event.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import grpc
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.templating import Jinja2Templates

from quayutec.v1 import common_pb2, gateway_pb2
from services.console.names import Names, room_names
from services.console.session import CALL_SECONDS, Session

RUN_EVENTS = {
    common_pb2.ROOM_EVENT_KIND_RUN_NOT_STARTED,
    common_pb2.ROOM_EVENT_KIND_RUN_STARTED,
    common_pb2.ROOM_EVENT_KIND_RUN_PARKED,
    common_pb2.ROOM_EVENT_KIND_RUN_ENDED,
    common_pb2.ROOM_EVENT_KIND_APPROVAL_AWAITING,
}
MEMBERSHIP_EVENTS = {common_pb2.ROOM_EVENT_KIND_MEMBER_JOINED, common_pb2.ROOM_EVENT_KIND_MEMBER_LEFT}
MAX_CURSOR = 2**63 - 1
# A room cursor in the approvals page's token: the room id's 16 bytes and the cursor's 8.
_ROOM_CURSOR_BYTES = 24
# Most rooms a token may name (the Gateway's WatchRooms follows 200 by default).
MAX_TOKEN_ROOMS = 500
MAX_TOKEN_CHARS = (MAX_TOKEN_ROOMS * _ROOM_CURSOR_BYTES * 4 + 2) // 3
_NOT_A_CURSOR = "after must be a cursor (a whole number from 0 to 9223372036854775807); reload the page"
_NOT_A_TOKEN = "after must be the cursors this console handed out (reload the page)"
# The HTTP status of a Gateway refusal that comes before a stream's first item.
_REFUSED = {
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}


class BadCursor(Exception):
    """A cursor from the page that cannot be used: 400 with these words."""


def parse_cursor(raw: str) -> int:
    """A room cursor: ASCII digits, 0 to 2**63-1; BadCursor otherwise (whatever its size)."""
    if not raw or len(raw) > 19 or not raw.isascii() or not raw.isdigit() or int(raw) > MAX_CURSOR:
        raise BadCursor(_NOT_A_CURSOR)
    return int(raw)


def encode_cursors(cursors: Mapping[str, int]) -> str:
    """Room cursors as one short opaque token for a URL or an SSE id (base64url of id and cursor pairs)."""
    raw = b"".join(uuid.UUID(room).bytes + cursor.to_bytes(8, "big") for room, cursor in cursors.items())
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursors(token: str) -> dict[str, int]:
    """The room cursors of a token made by ``encode_cursors``; BadCursor for anything else."""
    if len(token) > MAX_TOKEN_CHARS or not token.isascii():
        raise BadCursor(_NOT_A_TOKEN)
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (binascii.Error, ValueError):
        raise BadCursor(_NOT_A_TOKEN) from None
    if len(raw) % _ROOM_CURSOR_BYTES:
        raise BadCursor(_NOT_A_TOKEN)
    cursors: dict[str, int] = {}
    for at in range(0, len(raw), _ROOM_CURSOR_BYTES):
        room = str(uuid.UUID(bytes=raw[at : at + 16]))
        cursor = int.from_bytes(raw[at + 16 : at + _ROOM_CURSOR_BYTES], "big")
        if cursor > MAX_CURSOR or room in cursors:
            raise BadCursor(_NOT_A_TOKEN)
        cursors[room] = cursor
    return cursors


def _resume_from(request: Request) -> str:
    """What the page resumes after: the browser's Last-Event-ID on a reconnect, else the page's ``after``."""
    return request.headers.get("last-event-id") or request.query_params.get("after") or ""


class StreamSlots:
    """Open event streams per sign-in on this console replica, at most ``most`` each."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._open: dict[str, int] = {}

    def take(self, session_id: str) -> bool:
        held = self._open.get(session_id, 0)
        if held >= self.most:
            return False
        self._open[session_id] = held + 1
        return True

    def give_back(self, session_id: str) -> None:
        held = self._open.get(session_id, 0) - 1
        if held > 0:
            self._open[session_id] = held
        else:
            self._open.pop(session_id, None)

    def __len__(self) -> int:
        return sum(self._open.values())


def sse(event: str, data: Mapping[str, Any], event_id: int | str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data)}\n\n"


def text(status: int, words: str, headers: Mapping[str, str] | None = None) -> Response:
    return PlainTextResponse(words, status_code=status, headers=headers)


async def first_cursor(s: Session, room_id: str) -> int:
    """The room's newest cursor, from the first heartbeat of a WatchRoom without ``after``: the page
    reads the room after it and the live stream resumes from it, so nothing between is missed."""
    call = s.client.WatchRoom(gateway_pb2.WatchRoomRequest(room_id=room_id), timeout=CALL_SECONDS)
    try:
        async for response in call:
            if response.HasField("heartbeat"):
                return int(response.heartbeat.cursor)
    except grpc.aio.AioRpcError as exc:
        s.signed_out_if(exc)
        raise
    finally:
        call.cancel()
    return 0


async def first_cursors(s: Session) -> dict[str, int]:
    """Every room's newest cursor, from the first heartbeat of a WatchRooms from now (as ``first_cursor``)."""
    call = s.client.WatchRooms(gateway_pb2.WatchRoomsRequest(), timeout=CALL_SECONDS)
    try:
        async for response in call:
            if response.HasField("heartbeat"):
                return {r.room_id: r.cursor for r in response.heartbeat.rooms}
    except grpc.aio.AioRpcError as exc:
        s.signed_out_if(exc)
        raise
    finally:
        call.cancel()
    return {}


def render_event(request: Request, event: common_pb2.RoomEvent, names: Names) -> dict[str, Any] | None:
    """What the room page does with one event: put a rendered item in a list (its authors by name),
    take one out, or (for runs) note it."""
    templates: Jinja2Templates = request.app.state.templates
    parts: Any = templates.env.get_template("parts.html").module
    kind = event.kind
    if kind == common_pb2.ROOM_EVENT_KIND_MESSAGE_POSTED:
        m = event.message
        return {"op": "put", "list": "messages", "id": f"m-{m.message_id}", "html": str(parts.message(m, names))}
    if kind in (common_pb2.ROOM_EVENT_KIND_TASK_CREATED, common_pb2.ROOM_EVENT_KIND_TASK_UPDATED):
        t = event.task
        if t.status != common_pb2.TASK_STATUS_OPEN:
            return {"op": "drop", "id": f"t-{t.task_id}"}
        return {"op": "put", "list": "tasks", "id": f"t-{t.task_id}", "html": str(parts.task(t, names))}
    if kind == common_pb2.ROOM_EVENT_KIND_TASK_CLOSED:
        return {"op": "drop", "id": f"t-{event.task.task_id}"}
    if kind == common_pb2.ROOM_EVENT_KIND_MEMORY_WRITTEN:
        line = event.memory
        return {"op": "put", "list": "memory", "id": f"k-{line.memory_id}", "html": str(parts.memory(line, names))}
    if kind == common_pb2.ROOM_EVENT_KIND_FILE_UPLOADED:
        f = event.file
        return {"op": "put", "list": "files", "id": f"f-{f.file_id}", "html": str(parts.file(f, names))}
    if kind in RUN_EVENTS and event.HasField("run"):
        r = event.run
        html = str(parts.run_item(r, names))
        return {"op": "put", "list": "runs", "id": f"r-{r.run_id}", "html": html, "first": True, "run_id": r.run_id}
    if kind in RUN_EVENTS:
        return {"op": "run", "run_id": event.approval.run_id}
    return None


def _named_agents(event: common_pb2.RoomEvent) -> list[str]:
    """The agents an event's rendering names (its author, a task's assignee)."""
    found = []
    for author in (event.message.author, getattr(event.task, "from"), event.memory.author, event.file.author):
        if author.agent_id:
            found.append(author.agent_id)
    if event.task.to_agent_id:
        found.append(event.task.to_agent_id)
    return found


class LiveNames:
    """The names a room page's stream renders with: read when it opens, and again when a company joins
    or an event names an agent not known yet (at most once per REFRESH_SECONDS)."""

    REFRESH_SECONDS = 2.0

    def __init__(self, s: Session, room_id: str) -> None:
        self._s = s
        self._room_id = room_id
        self._names: Names | None = None
        self._read_at = 0.0

    async def for_events(self, events: Iterable[common_pb2.RoomEvent]) -> Names:
        events = list(events)
        names = self._names
        loop = asyncio.get_running_loop()
        stale = names is None or any(
            e.kind == common_pb2.ROOM_EVENT_KIND_MEMBER_JOINED or any(a not in names.agents for a in _named_agents(e))
            for e in events
        )
        if stale and (names is None or loop.time() - self._read_at >= self.REFRESH_SECONDS):
            try:
                names = self._names = await room_names(self._s, self._room_id)
                self._read_at = loop.time()
            except grpc.aio.AioRpcError:
                if names is None:
                    raise
        assert names is not None
        return names


async def relay(request: Request, s: Session, call: Any, chunks: Callable[[Any], AsyncIterator[str]]) -> Response:
    """The SSE response of a Gateway stream: refused with an HTTP status (and words) when the Gateway
    refuses before the first item; otherwise each item as ``chunks`` renders it, then "gone" with
    words when the Gateway ends the stream for good. Counts against the sign-in's stream slots."""
    slots: StreamSlots = request.app.state.stream_slots
    if not slots.take(s.session_id):
        call.cancel()
        return text(
            429,
            f"This sign-in already has {slots.most} live pages open in this console (the per-session limit, "
            f"QUAYUTEC_CONSOLE_MAX_STREAMS_PER_SESSION = {slots.most}); close a tab, then reload this page.",
        )
    items = call.__aiter__()
    try:
        first = await items.__anext__()
    except (grpc.aio.AioRpcError, StopAsyncIteration) as exc:
        slots.give_back(s.session_id)
        call.cancel()
        if not isinstance(exc, grpc.aio.AioRpcError):
            return text(502, "The Gateway ended the stream at once. Reload the page.")
        s.signed_out_if(exc)
        status = _REFUSED.get(exc.code(), 502)
        return text(status, exc.details() or "The Gateway refused the stream.")

    async def body() -> AsyncIterator[str]:
        disconnected = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(request, call, disconnected))
        try:
            yield "retry: 2000\n\n"
            async for chunk in chunks(first):
                yield chunk
            async for item in items:
                async for chunk in chunks(item):
                    yield chunk
        except asyncio.CancelledError:
            if not disconnected.is_set():
                raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OUT_OF_RANGE):
                yield sse("gone", {"message": _gone_words(exc)})
            # Otherwise the browser reconnects and resumes after the last id it saw.
        finally:
            watcher.cancel()
            call.cancel()
            slots.give_back(s.session_id)

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    )


def _gone_words(exc: grpc.aio.AioRpcError) -> str:
    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
        return "You were signed out. Sign in again to follow this page."
    if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
        return "Events were missed: reload the page."
    return "Not found, or not visible to your company any more."


async def _watch_disconnect(request: Request, call: Any, disconnected: asyncio.Event) -> None:
    """Cancels the Gateway stream as soon as the browser goes away (not at the next write)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            disconnected.set()
            call.cancel()
            return


async def room_events(request: Request) -> Response:
    """A room's events (WatchRoom) after the page's cursor, for the room and run pages."""
    s = Session(request)
    room_id = request.path_params["room_id"]
    raw = _resume_from(request)
    try:
        after = parse_cursor(raw) if raw else None
    except BadCursor as exc:
        return text(400, str(exc))
    watch = gateway_pb2.WatchRoomRequest(room_id=room_id)
    if after is not None:
        watch.after = after
    confirmed = False
    live_names = LiveNames(s, room_id)

    async def chunks(response: gateway_pb2.WatchRoomResponse) -> AsyncIterator[str]:
        nonlocal confirmed
        names = await live_names.for_events(response.events) if response.events else None
        for event in response.events:
            assert names is not None
            item = render_event(request, event, names)
            yield sse("room", item or {"op": "none"}, event.cursor)
        if response.HasField("heartbeat"):
            yield sse("beat" if confirmed else "live", {}, response.heartbeat.cursor)
            confirmed = True

    return await relay(request, s, s.client.WatchRoom(watch), chunks)


async def approval_events(request: Request) -> Response:
    """One stream for the approvals and runs pages (WatchRooms: every room of the company): a "changed" event
    whenever a run of the company is parked, continues or ends, or the company joins or leaves a room,
    so the page re-reads its list. Every message carries the room cursors to resume after as its id."""
    s = Session(request)
    raw = _resume_from(request)
    try:
        after = decode_cursors(raw) if raw else {}
    except BadCursor as exc:
        return text(400, str(exc))
    cursors = dict(after)
    confirmed = False

    async def chunks(response: gateway_pb2.WatchRoomsResponse) -> AsyncIterator[str]:
        nonlocal confirmed
        changed = ""
        for event in response.events:
            cursors[event.room_id] = event.cursor
            if event.kind in RUN_EVENTS or event.kind in MEMBERSHIP_EVENTS:
                changed = event.room_id
        if changed:
            yield sse("changed", {"room_id": changed}, encode_cursors(cursors))
        if response.HasField("heartbeat"):
            cursors.clear()
            cursors.update({r.room_id: r.cursor for r in response.heartbeat.rooms})
            yield sse("beat" if confirmed else "live", {}, encode_cursors(cursors))
            confirmed = True

    request_after = [gateway_pb2.RoomCursor(room_id=r, cursor=c) for r, c in after.items()]
    # Resuming: a room the company joined while no stream was open is not among the cursors; follow it
    # from its joining so a run parked there meanwhile is not missed.
    watch = gateway_pb2.WatchRoomsRequest(after=request_after, unnamed_from_joining=bool(request_after))
    return await relay(request, s, s.client.WatchRooms(watch), chunks)
