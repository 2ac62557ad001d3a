"""The Python client's company-wide watch (``watch_rooms``) and session keys against a real Gateway
process, Room, Claims, Runtime and model stand-in on loopback: every event of every room exactly once
and in its room's order across two Gateway kills, a RESOURCE_EXHAUSTED cut, a room joined while
watching, one joined while the Gateway was down and one left; a resume from persisted cursors follows
a room joined meanwhile from its joining; a revoked key's watch ends Unauthenticated without a retry;
session keys are made and ended, an ended session whose answer was lost counts as ended."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from quayutec_client import NO_RETRY, Client, RetryPolicy, RoomsWatch, errors
from quayutec_client.types import RoomEvent, RoomEventKind
from tests.clients.conftest import ClientFactory
from tests.gateway.test_watch import log_of
from tests.harness.gateway import CompanyKey
from tests.harness.proxy import HoldingProxy
from tests.harness.sdk_stack import STRICT_GATEWAY_ENV, SdkStack

MEMBER_JOINED = RoomEventKind.ROOM_EVENT_KIND_MEMBER_JOINED
MEMBER_LEFT = RoomEventKind.ROOM_EVENT_KIND_MEMBER_LEFT


async def join(inviter: Client, invitee: Client, room_id: str, company_id: str) -> None:
    invitation = await inviter.invite_company(room_id, company_id)
    await invitee.accept_invitation(invitation.invitation_id)


class Reader:
    """Reads a RoomsWatch into ``received`` until a condition holds, within a failsafe bound."""

    def __init__(self, watch: RoomsWatch) -> None:
        self.watch = watch
        self.received: list[RoomEvent] = []

    def has(self, body: str) -> bool:
        return any(e.message.body == body for e in self.received)

    async def until(self, done: Callable[[], bool]) -> None:
        try:
            async with asyncio.timeout(120):  # a failsafe: a missed event would be waited for forever
                while not done():
                    self.received.append(await anext(self.watch))
        except TimeoutError:
            got = [(e.room_id[:8], e.message.body[:8] or e.kind) for e in self.received]
            raise AssertionError(f"the awaited event never came; got {got}") from None

    def of(self, room_id: str) -> list[RoomEvent]:
        return [e for e in self.received if e.room_id == room_id]


@contextlib.asynccontextmanager
async def pinging(client: Client, room_id: str) -> AsyncIterator[None]:
    """Posts to a room every 0.2 s meanwhile, so a reader keeps receiving (and applying heartbeats)."""

    async def ping() -> None:
        for n in range(600):
            await client.post_message(room_id, f"ping {n}", person="ana")
            await asyncio.sleep(0.2)

    task = asyncio.create_task(ping())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_watch_rooms_across_gateway_kills_a_cut_joins_and_a_departure_yields_every_event_once_in_order(
    stack: SdkStack, acme: CompanyKey, bolt: CompanyKey, connect: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="quayutec_client")
    a, b = connect(acme), connect(bolt)
    # A flow-control window that does not grow, so a watcher that stops reading is cut soon.
    watcher = connect(acme, channel_options=[("grpc.http2.bdp_probe", 0)])
    first, second = await a.create_room("first"), await a.create_room("second")

    async with watcher.watch_rooms(idle_timeout=30) as watch:
        start = watch.cursors  # the first heartbeat: every room of Acme, from now
        assert set(start) == {first.room_id, second.room_id}
        r = Reader(watch)
        for n in range(3):
            await a.post_message(first.room_id, f"a{n} first", person="ana")
            await a.post_message(second.room_id, f"a{n} second", person="ana")
        await r.until(lambda: r.has("a2 second"))

        # Joined while watching: followed from Acme's joining.
        joined = await b.create_room("bolt's")
        await b.post_message(joined.room_id, "before acme joined", person="bo")
        await join(b, a, joined.room_id, acme.company_id)
        await b.post_message(joined.room_id, "welcome", person="bo")
        await r.until(lambda: r.has("welcome"))

        async with stack.extra_gateway() as other_addr:
            a2, b2 = connect(acme, addr=other_addr), connect(bolt, addr=other_addr)
            # Kill one: the stream drops; what happens meanwhile (through another Gateway) is replayed,
            # and a room Acme joins while the Gateway is down is followed from its joining.
            await stack.gateway.kill()
            await a2.post_message(first.room_id, "b0 first", person="ana")
            await b2.post_message(joined.room_id, "b0 joined", person="bo")
            while_down = await b2.create_room("joined while down")
            await b2.post_message(while_down.room_id, "before acme joined", person="bo")
            await join(b2, a2, while_down.room_id, acme.company_id)
            await b2.post_message(while_down.room_id, "b0 while down", person="bo")
            await stack.gateway.start()
            await r.until(lambda: r.has("b0 first") and r.has("b0 joined") and r.has("b0 while down"))

            # Kill two, in the middle of a batch the watcher is still reading.
            for n in range(10):
                await a.post_message((first, second)[n % 2].room_id, f"c{n}", person="ana")
            await r.until(lambda: r.has("c2"))
            await stack.gateway.kill()
            await a2.post_message(second.room_id, "d0 second", person="ana")
            await b2.post_message(while_down.room_id, "d0 while down", person="bo")
            await stack.gateway.start()
            await r.until(lambda: r.has("c9") and r.has("d0 second") and r.has("d0 while down"))
        reconnects_before_cut = watch.reconnects

        # Left while watching: the room ends with Acme's MEMBER_LEFT and leaves the cursors.
        await a.leave_room(joined.room_id)
        await b.post_message(joined.room_id, "after acme left", person="bo")
        await r.until(lambda: any(e.kind == MEMBER_LEFT for e in r.of(joined.room_id)))
        async with pinging(a, first.room_id):
            await r.until(lambda: joined.room_id not in watch.cursors)

        # The cut: the watcher reads nothing while large messages arrive in two rooms; its buffer at
        # the Gateway fills and the Gateway ends the stream with RESOURCE_EXHAUSTED; the watch resumes.
        for n in range(40):
            await a.post_message((first, while_down)[n % 2].room_id, f"e{n:02d} " + "x" * 60_000, person="ana")
        await r.until(lambda: r.has("e39 " + "x" * 60_000))
        kept = watch.cursors

    assert stack.gateway.kills == 2
    assert "WatchRooms: RESOURCE_EXHAUSTED after attempt 1" in caplog.text
    assert watch.reconnects >= reconnects_before_cut + 1 >= 3
    assert not any(e.message.body in ("before acme joined", "after acme left") for e in r.received)
    # Each room's events are its log as Acme may see it: from the watch's start, or from Acme's joining.
    for room_id in (first.room_id, second.room_id, while_down.room_id):
        got = r.of(room_id)
        begin = start.get(room_id, got[0].cursor - 1)
        log = await log_of(stack.room_addr, room_id, acme.company_id, begin)
        assert [(e.cursor, int(e.kind)) for e in got] == [(e.cursor, int(e.kind)) for e in log], room_id
        assert kept[room_id] >= got[-1].cursor
    for room_id in (joined.room_id, while_down.room_id):
        assert (r.of(room_id)[0].kind, r.of(room_id)[0].member.company_id) == (MEMBER_JOINED, acme.company_id)
    # The room left: up to Acme's departure, as its remaining member sees the log.
    got = r.of(joined.room_id)
    log = await log_of(stack.room_addr, joined.room_id, bolt.company_id, got[0].cursor - 1)
    assert [e.cursor for e in got] == [e.cursor for e in log if e.cursor <= got[-1].cursor]
    assert (got[-1].kind, got[-1].member.company_id) == (MEMBER_LEFT, acme.company_id)
    assert joined.room_id not in kept


async def test_watch_rooms_resumes_from_kept_cursors_and_follows_a_room_joined_meanwhile(
    stack: SdkStack, acme: CompanyKey, bolt: CompanyKey, connect: ClientFactory
) -> None:
    a, b = connect(acme), connect(bolt)
    mine = await a.create_room("mine")
    async with a.watch_rooms() as watch:
        await a.post_message(mine.room_id, "one", person="ana")
        assert (await anext(watch)).message.body == "one"
        kept = watch.cursors  # what a caller persists
    assert kept == {mine.room_id: (await log_of(stack.room_addr, mine.room_id, acme.company_id, 0))[-1].cursor}

    # While no watch is open: a message in Acme's room, and a room Acme joins.
    await a.post_message(mine.room_id, "two", person="ana")
    theirs = await b.create_room("theirs")
    await b.post_message(theirs.room_id, "before acme joined", person="bo")
    await join(b, a, theirs.room_id, acme.company_id)
    await b.post_message(theirs.room_id, "while away", person="bo")

    async with a.watch_rooms(after=kept) as again:
        r = Reader(again)
        await r.until(lambda: r.has("two") and r.has("while away"))
    assert [e.message.body for e in r.of(mine.room_id)] == ["two"]
    assert [(e.kind, e.message.body) for e in r.of(theirs.room_id)] == [
        (MEMBER_JOINED, ""),
        (RoomEventKind.ROOM_EVENT_KIND_MESSAGE_POSTED, "while away"),
    ]

    # A cursor past its room's end is CursorOutOfRange naming the room and its newest cursor, not retried.
    newest = again.cursors[mine.room_id]
    with pytest.raises(errors.CursorOutOfRange) as past:
        await anext(a.watch_rooms(after={mine.room_id: newest + 100}))
    assert past.value.code == grpc.StatusCode.OUT_OF_RANGE and past.value.attempts == 1
    assert (past.value.room_id, past.value.newest_cursor) == (mine.room_id, newest)

    # Every cursor is checked before anything streams: one bad cursor among good ones (whose rooms have
    # events to replay) is CursorOutOfRange before any event.
    theirs_newest = again.cursors[theirs.room_id]
    with pytest.raises(errors.CursorOutOfRange) as one_bad:
        await anext(a.watch_rooms(after={mine.room_id: 0, theirs.room_id: theirs_newest + 100}))
    assert one_bad.value.room_id == theirs.room_id
    with pytest.raises(errors.CursorOutOfRange) as other_bad:
        await anext(a.watch_rooms(after={mine.room_id: newest + 100, theirs.room_id: 0}))
    assert other_bad.value.room_id == mine.room_id


async def test_a_revoked_session_keys_watch_ends_unauthenticated_without_a_retry(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory
) -> None:
    a = connect(acme)
    room = await a.create_room("sessions")
    session = await a.create_session_key(600, label="sdk test")
    assert session.secret.startswith(f"qyk_{session.key_id}_") and session.expires_at.seconds > 0
    signed_in = connect(CompanyKey(acme.company_id, acme.name, session.key_id, session.secret))
    assert (await signed_in.who_am_i()).company_id == acme.company_id

    async with signed_in.watch_rooms() as watch:
        await a.post_message(room.room_id, "seen", person="ana")
        assert (await anext(watch)).message.body == "seen"
        assert await signed_in.end_session() == session.key_id
        with pytest.raises(errors.Unauthenticated) as ended:
            async with asyncio.timeout(60):  # a failsafe: the stream ends within seconds
                await anext(watch)
    assert ended.value.attempts == 1 and watch.reconnects == 0, "a revoked key's watch is not retried"
    assert "revoked" in ended.value.message
    with pytest.raises(errors.Unauthenticated):
        await signed_in.who_am_i()
    with pytest.raises(errors.Unauthenticated):  # ending it again is refused as the call of an ended key
        await signed_in.end_session()

    once = a.with_retry(NO_RETRY)
    with pytest.raises(errors.FailedPrecondition, match="keys revoke"):
        await once.end_session()  # a company key is not a session
    with pytest.raises(errors.InvalidArgument, match="ttl_seconds"):
        await once.create_session_key(5)
    other = await a.create_session_key(60)
    with pytest.raises(errors.PermissionDenied):
        await connect(CompanyKey("", "", "", other.secret), retry=NO_RETRY).create_session_key(60)


async def test_an_ended_session_whose_answer_was_lost_counts_as_ended(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """EndSession acts, its answer is lost (the connection drops); the retry is answered UNAUTHENTICATED
    (the key is ended), which the client reports as the session ended."""
    caplog.set_level(logging.INFO, logger="quayutec_client")
    session = await connect(acme).create_session_key(600)
    proxy = HoldingProxy(stack.gateway_addr)
    await proxy.start()
    try:
        signed_in = connect(CompanyKey("", "", "", session.secret), addr=proxy.addr)
        await signed_in.who_am_i()
        proxy.hold()
        ending = asyncio.create_task(signed_in.end_session())
        async with asyncio.timeout(60):
            while not await stack.pool.fetchval(  # noqa: ASYNC110 - the Gateway writes it
                "SELECT revoked_at IS NOT NULL FROM api_keys WHERE key_id = $1", uuid.UUID(session.key_id)
            ):
                await asyncio.sleep(0.02)
        await proxy.drop_connections()
        proxy.release()
        assert await ending == session.key_id
    finally:
        await proxy.stop()
    assert "EndSession: UNAVAILABLE after attempt 1" in caplog.text


async def test_stream_refusals_are_typed_errors_naming_the_limit_and_the_advised_wait(
    stack: SdkStack, acme: CompanyKey, connect: ClientFactory
) -> None:
    """A Gateway that allows one open stream per company and one failed authentication: a second
    watch is retried as the policy allows, then ends RateLimited naming the limit; a throttled watch
    carries the Gateway's advised wait (its retry-after-ms trailer) and is not waited for beyond
    max_advised_wait."""
    quick = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02)
    async with stack.extra_gateway(**STRICT_GATEWAY_ENV) as addr:
        client = connect(acme, addr=addr, retry=quick)
        async with client.watch_rooms():
            with pytest.raises(errors.RateLimited) as limited:
                await anext(client.watch_rooms())
        assert "QUAYUTEC_GATEWAY_MAX_STREAMS_PER_COMPANY = 1" in limited.value.message
        assert limited.value.attempts == 3 and limited.value.retry_after is None

        wrong = connect(CompanyKey("", "", "", f"qyk_{uuid.uuid4()}_{'x' * 43}"), addr=addr, retry=quick)
        with pytest.raises(errors.Unauthenticated):
            await anext(wrong.watch_rooms())
        with pytest.raises(errors.RateLimited) as throttled:
            await anext(wrong.watch_rooms())
    assert throttled.value.retry_after is not None and throttled.value.retry_after > quick.max_advised_wait
    assert throttled.value.attempts == 1, "an advised wait over max_advised_wait is not waited"
    assert "failed authentications" in throttled.value.message
