"""The console's sessions and limits over HTTP (a real console served by uvicorn, real Gateways, Room and
PostgreSQL; no browser needed): a cookie copied before sign-out is refused afterwards on every replica
(pages, posting, live updates); a sign-in's open streams are bounded; failed sign-ins are throttled;
every POST checks Origin and Sec-Fetch-Site; bad cursors of any size are 400 with words.

Waits are failsafes (read timeouts); nothing asserts on timing.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from quayutec.v1 import gateway_pb2
from services.console.app import COOKIE, session_box
from tests.console.browser import SESSION_SECRET, running_console
from tests.gateway.conftest import NOWHERE
from tests.gateway.helpers import GatewayStub, create_room
from tests.harness.channels import mtls_env
from tests.harness.gateway import (
    CompanyKey,
    authed_gateway,
    join_room,
    make_company,
    running_gateway,
    running_gateway_ports,
)
from tests.harness.room import running_room

QUIET = {"QUAYUTEC_GATEWAY_DELIVERY_ENABLED": "false", "QUAYUTEC_GATEWAY_POST_RATE": "0"}
FAILSAFE = httpx.Timeout(10.0, read=60.0)


@dataclass
class World:
    database_url: str
    room_addr: str
    gateway_addr: str
    acme: CompanyKey
    globex: CompanyKey
    acme_gw: GatewayStub
    globex_gw: GatewayStub


@asynccontextmanager
async def world(database_url: str, **gateway_env: str) -> AsyncIterator[World]:
    async with running_room(database_url) as room_addr:
        tag = uuid.uuid4().hex[:6]
        acme = await make_company(database_url, room_addr, f"Acme {tag}")
        globex = await make_company(database_url, room_addr, f"Globex {tag}")
        async with (
            running_gateway(database_url, room_addr, NOWHERE, **{**QUIET, **gateway_env}) as gateway_addr,
            authed_gateway(gateway_addr, acme.secret) as acme_gw,
            authed_gateway(gateway_addr, globex.secret) as globex_gw,
        ):
            yield World(database_url, room_addr, gateway_addr, acme, globex, acme_gw, globex_gw)


@asynccontextmanager
async def browser(base: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=base, follow_redirects=False, timeout=FAILSAFE) as client:
        yield client


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "no CSRF token on the page"
    return found.group(1)


async def sign_in(client: httpx.AsyncClient, key: str) -> httpx.Response:
    form = await client.get("/signin")
    return await client.post("/signin", data={"csrf": csrf_of(form.text), "api_key": key})


async def signed_in(client: httpx.AsyncClient, key: str) -> str:
    """Signs in; returns the CSRF token of the new session."""
    answer = await sign_in(client, key)
    assert answer.status_code == 303 and answer.headers["location"] == "/rooms", answer.text
    return csrf_of((await client.get("/rooms")).text)


@asynccontextmanager
async def events(client: httpx.AsyncClient, path: str, **headers: str) -> AsyncIterator[Any]:
    """An open event stream: yields (response, an iterator of (event, data) pairs)."""
    async with client.stream("GET", path, headers=headers) as response:

        async def read() -> AsyncIterator[tuple[str, dict[str, Any]]]:
            event, data = "", ""
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    data = line[6:]
                elif not line and event:
                    yield event, json.loads(data)
                    event, data = "", ""

        yield response, read()


async def until(items: AsyncIterator[tuple[str, dict[str, Any]]], wanted: str) -> dict[str, Any]:
    async for event, data in items:
        if event == wanted:
            return data
    raise AssertionError(f"the stream ended before a {wanted!r} event")


def sealed_key(cookie: str) -> str:
    """The session key inside a console cookie (signed JSON, the key encrypted with the session secret)."""
    kept = json.loads(base64.b64decode(cookie.split(".")[0] + "=="))["key"]
    key: str = session_box(SESSION_SECRET).decrypt(kept.encode()).decode()
    return key


async def test_a_cookie_copied_before_sign_out_is_refused_on_every_replica(database_url: str) -> None:
    async with world(database_url) as w:
        room = await create_room(w.acme_gw)
        async with (
            running_gateway(w.database_url, w.room_addr, NOWHERE, **QUIET) as other_gateway,
            running_console(w.gateway_addr) as one,
            running_console(other_gateway) as two,  # another replica of both, sharing the secret and database
            browser(one) as person,
            browser(two) as thief,
        ):
            csrf = await signed_in(person, w.acme.secret)
            stolen = person.cookies[COOKIE]
            # The cookie holds a session key made for this sign-in, never the company's API key.
            kept = sealed_key(stolen)
            assert kept.startswith("qyk_") and kept != w.acme.secret

            thief.cookies.set(COOKIE, stolen)
            assert (await thief.get("/rooms")).status_code == 200
            async with events(thief, f"/rooms/{room.room_id}/events") as (response, items):
                assert response.status_code == 200
                await until(items, "live")
                signed_out = await person.post("/signout", data={"csrf": csrf})
                assert signed_out.status_code == 303 and signed_out.headers["location"] == "/signin"
                # The open stream on the other replica ends: the Gateway ended its session key's stream.
                gone = await until(items, "gone")
                assert "signed out" in gone["message"]

            # Pages, posting and new streams with the copied cookie are refused.
            thief.cookies.set(COOKIE, stolen)
            page = await thief.get("/rooms")
            assert page.status_code == 303 and page.headers["location"] == "/signin"
            thief.cookies.set(COOKIE, stolen)
            posted = await thief.post(
                f"/rooms/{room.room_id}", data={"csrf": csrf, "person": "Mallory", "idem": "k", "body": "hello"}
            )
            assert posted.status_code == 303 and posted.headers["location"] == "/signin"
            thief.cookies.set(COOKIE, stolen)
            assert (await thief.get(f"/rooms/{room.room_id}/events")).status_code == 401
        messages = await w.acme_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)
        assert list(messages.messages) == []


async def test_a_sign_in_holds_a_bounded_number_of_streams_and_approvals_use_one(database_url: str) -> None:
    # The Gateway lets Acme hold one stream: the approvals page must follow its three rooms in one.
    async with world(database_url, QUAYUTEC_GATEWAY_MAX_STREAMS_PER_COMPANY="1") as w:
        rooms = [await create_room(w.acme_gw, name) for name in ("a", "b", "c")]
        async with (
            running_console(w.gateway_addr, QUAYUTEC_CONSOLE_MAX_STREAMS_PER_SESSION="2") as base,
            browser(base) as tab,
        ):
            await signed_in(tab, w.acme.secret)
            async with events(tab, "/approvals/events") as (response, items):
                assert response.status_code == 200
                await until(items, "live")
                await join_room(w.acme_gw, w.globex_gw, rooms[2].room_id)  # a change in the third room
                assert (await until(items, "changed"))["room_id"] == rooms[2].room_id
    async with world(database_url) as w:
        room = await create_room(w.acme_gw)
        path = f"/rooms/{room.room_id}/events"
        async with (
            running_console(w.gateway_addr, QUAYUTEC_CONSOLE_MAX_STREAMS_PER_SESSION="2") as base,
            browser(base) as tab,
            browser(base) as colleague,
        ):
            await signed_in(tab, w.acme.secret)
            await signed_in(colleague, w.acme.secret)  # another sign-in of the same company
            async with events(tab, path) as (first, one), events(tab, path) as (_, two):
                assert first.status_code == 200
                await until(one, "live")
                await until(two, "live")
                third = await tab.get(path)
                assert third.status_code == 429
                assert "QUAYUTEC_CONSOLE_MAX_STREAMS_PER_SESSION = 2" in third.text
                async with events(colleague, path) as (theirs, items):
                    assert theirs.status_code == 200
                    await until(items, "live")
            # Closed streams give their slots back (the console sees the browser go at once).
            status = 429
            for _ in range(200):  # a failsafe bound, not a timing assertion
                async with events(tab, path) as (again, items):
                    status = again.status_code
                    if status == 200:
                        await until(items, "live")
                        break
                await asyncio.sleep(0.05)
            assert status == 200


async def test_failed_sign_ins_are_throttled_with_one_log_line(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "quayutec.console")
    async with world(database_url) as w, running_console(w.gateway_addr) as base, browser(base) as client:
        await signed_in(client, w.acme.secret)  # a key that works here
        answers = [await sign_in(client, f"qyk_{uuid.uuid4()}_{'x' * 43}") for _ in range(15)]
        statuses = [a.status_code for a in answers]
        assert statuses[:10] == [401] * 10  # the default burst
        assert statuses[10:] == [429] * 5, statuses
        refused = answers[-1]
        assert "Too many failed sign-ins" in refused.text and "QUAYUTEC_CONSOLE_SIGNIN_FAILURE_BURST" in refused.text
        assert int(refused.headers["retry-after"]) >= 1
        # A valid key is always checked: its address's throttle does not lock it out.
        assert (await sign_in(client, w.acme.secret)).status_code == 303
    lines = [r for r in caplog.records if "failed sign-ins at once" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


async def test_fifty_failed_sign_ins_from_one_browser_never_refuse_a_valid_sign_in(database_url: str) -> None:
    """50 failed sign-ins from one browser address (half of them with acme's own key id): past both
    throttles (the console's per browser, the Gateway's), acme's valid key still signs in from another
    address and from that same one, and so does globex's (a key neither replica has seen work)."""
    async with world(database_url) as w, running_console(w.gateway_addr) as base:
        elsewhere = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with browser(base) as guesser:
            guesses = [f"qyk_{w.acme.key_id if n % 2 else uuid.uuid4()}_{'x' * 43}" for n in range(50)]
            statuses = [(await sign_in(guesser, g)).status_code for g in guesses]
            assert set(statuses) == {401, 429} and statuses.count(429) >= 30, statuses
            async with httpx.AsyncClient(
                base_url=base, follow_redirects=False, timeout=FAILSAFE, transport=elsewhere
            ) as owner:
                await signed_in(owner, w.acme.secret)
            await signed_in(guesser, w.acme.secret)
        async with browser(base) as other:
            await signed_in(other, w.globex.secret)


async def test_failed_sign_ins_count_at_the_gateway_against_the_browser_not_the_console(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 34, finding 4: the console calls the Gateway's console port with its certificate and
    passes on each browser's address. Its own throttle off, so every wrong key reaches the Gateway
    (burst 5 there): 50 from browser 127.0.0.2, which the Gateway tells to back off, while 127.0.0.3,
    through the same console, still gets its own answers (a wrong key is "not accepted", a valid one
    signs in), and the Gateway's one log line names the guessing browser."""
    caplog.set_level(logging.WARNING, "quayutec.gateway.auth")
    async with running_room(database_url) as room_addr:
        acme = await make_company(database_url, room_addr, f"Acme {uuid.uuid4().hex[:6]}")
        async with (
            running_gateway_ports(
                database_url, room_addr, NOWHERE, **QUIET,
                QUAYUTEC_GATEWAY_AUTH_FAILURE_BURST="5", QUAYUTEC_GATEWAY_AUTH_FAILURE_RATE="0.001",
            ) as (public_addr, console_addr),
            running_console(
                public_addr, QUAYUTEC_CONSOLE_GATEWAY_CONSOLE_ADDR=console_addr,
                QUAYUTEC_CONSOLE_SIGNIN_FAILURE_RATE="0", **mtls_env("console"),
            ) as base,
        ):  # fmt: skip

            def browser_at(address: str) -> httpx.AsyncClient:
                transport = httpx.AsyncHTTPTransport(local_address=address)
                return httpx.AsyncClient(base_url=base, follow_redirects=False, timeout=FAILSAFE, transport=transport)

            async with browser_at("127.0.0.2") as guesser, browser_at("127.0.0.3") as owner:
                answers = [await sign_in(guesser, f"qyk_{uuid.uuid4()}_{'x' * 43}") for _ in range(50)]
                assert [a.status_code for a in answers] == [401] * 5 + [429] * 45
                assert "from your address" in answers[-1].text  # the Gateway's words, passed on
                assert (await sign_in(owner, f"qyk_{uuid.uuid4()}_{'y' * 43}")).status_code == 401
                await signed_in(owner, acme.secret)
                await signed_in(guesser, acme.secret)  # a valid key is always checked
                # Live updates (a server stream) go through the console port too.
                async with events(owner, "/approvals/events") as (response, items):
                    assert response.status_code == 200
                    await until(items, "live")
    lines = [r.getMessage() for r in caplog.records if "failed authentications at once" in r.getMessage()]
    assert len(lines) == 1 and "source:127.0.0.2" in lines[0], lines


async def test_posts_from_another_origin_are_refused(database_url: str) -> None:
    async with world(database_url) as w, running_console(w.gateway_addr) as base, browser(base) as client:
        room = await create_room(w.acme_gw)
        csrf = await signed_in(client, w.acme.secret)
        form = {"csrf": csrf, "person": "Ana", "idem": "k1", "body": "hello"}
        for headers in (
            {"origin": "http://evil.example"},
            {"origin": "null"},
            {"origin": base.replace("127.0.0.1", "localhost")},
            {"sec-fetch-site": "cross-site"},
            {"origin": base, "sec-fetch-site": "same-site"},
        ):
            refused = await client.post(f"/rooms/{room.room_id}", data=form, headers=headers)
            assert refused.status_code == 403, (headers, refused.status_code)
            assert "sent from another site" in refused.text and "Traceback" not in refused.text
        out = await client.post("/signout", data={"csrf": csrf}, headers={"origin": "http://evil.example"})
        assert out.status_code == 403
        assert (await client.get("/rooms")).status_code == 200  # still signed in
        posted = await client.post(
            f"/rooms/{room.room_id}", data=form, headers={"origin": base, "sec-fetch-site": "same-origin"}
        )
        assert posted.status_code == 303
        messages = await w.acme_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)
        assert [m.body for m in messages.messages] == ["hello"]


async def test_bad_cursors_of_any_size_are_400_with_words(database_url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    async with world(database_url) as w, running_console(w.gateway_addr) as base, browser(base) as client:
        room = await create_room(w.acme_gw)
        await w.acme_gw.PostMessage(
            gateway_pb2.PostMessageRequest(room_id=room.room_id, person="Ana", body="one"), timeout=10
        )
        await signed_in(client, w.acme.secret)
        path = f"/rooms/{room.room_id}/events"
        cases: tuple[tuple[str | None, bytes | None], ...] = (
            ("9" * 5000, None),
            ("9" * 19, None),
            ("-1", None),
            ("1.5", None),
            ("\u00b2", None),
            (None, b"abc"),
            (None, "²".encode()),
            (None, b"7" * 10_000),
        )
        for query, header in cases:
            answer = await client.get(
                path, params={"after": query} if query else None, headers={b"last-event-id": header} if header else None
            )
            assert answer.status_code == 400, (query, header, answer.status_code)
            assert "after must be a cursor" in answer.text
        past = await client.get(path, params={"after": "99"})
        assert past.status_code == 400 and "past the newest event" in past.text
        for token in ("garbage!", "A" * 40_000, "AAAA", "x" * 33):
            answer = await client.get("/approvals/events", params={"after": token})
            assert answer.status_code == 400 and "cursors this console handed out" in answer.text, token[:20]
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


async def test_approvals_resume_follows_a_room_joined_while_the_page_was_away(database_url: str) -> None:
    # The approvals page resumes with the cursors it was handed; a room its company joined while no
    # stream was open is not among them, and must be followed from its joining, not from now.
    async with world(database_url) as w:
        await create_room(w.acme_gw, "known")
        async with running_console(w.gateway_addr) as base, browser(base) as tab:
            await signed_in(tab, w.acme.secret)
            token = ""
            async with tab.stream("GET", "/approvals/events") as response:
                assert response.status_code == 200
                last_id = ""
                async for line in response.aiter_lines():
                    if line.startswith("id: "):
                        last_id = line[4:]
                    elif line == "event: live":
                        token = last_id
                        break
            assert token, "the first live event carries the cursors to resume from"
            joined = await create_room(w.globex_gw, "joined while away")
            await join_room(w.globex_gw, w.acme_gw, joined.room_id)
            async with events(tab, "/approvals/events", **{"last-event-id": token}) as (resumed, items):
                assert resumed.status_code == 200
                assert (await until(items, "changed"))["room_id"] == joined.room_id
