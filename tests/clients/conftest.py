"""Fixtures of the client SDK tests: the real stack with a Gateway process that can be killed
(tests.harness.sdk_stack), companies with keys, and Python clients of them."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import quayutec_client
from quayutec.v1 import common_pb2
from quayutec_client import Client, RetryPolicy
from tests.gateway.test_watch import log_of
from tests.harness.gateway import CompanyKey
from tests.harness.sdk_stack import SdkStack, running_sdk_stack

# Retries patient enough for a Gateway process to start again (a second or two, longer under load).
PATIENT = RetryPolicy(max_attempts=40, initial_backoff=0.05, max_backoff=0.5, total_timeout=90, attempt_timeout=10)


@pytest.fixture
async def stack(database_url: str) -> AsyncIterator[SdkStack]:
    async with running_sdk_stack(database_url) as s:
        yield s


@pytest.fixture
async def acme(stack: SdkStack) -> CompanyKey:
    return await stack.new_company("Acme")


@pytest.fixture
async def bolt(stack: SdkStack) -> CompanyKey:
    return await stack.new_company("Bolt")


ClientFactory = Callable[..., Client]


@pytest.fixture
async def connect(stack: SdkStack) -> AsyncIterator[ClientFactory]:
    """``connect(key, **options)``: a client of the stack's Gateway, closed after the test."""
    made: list[Client] = []

    def make(key: CompanyKey, *, addr: str | None = None, **options: Any) -> Client:
        options.setdefault("retry", PATIENT)
        client = quayutec_client.connect(addr or stack.gateway_addr, key.secret, plaintext=True, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()


# Runs one of a guide's example programs with these environment variables; its output lines.
RunExample = Callable[[str, dict[str, str]], Awaitable[list[str]]]


async def check_guide_examples(
    stack: SdkStack, run: RunExample, quickstart: str, follow: str, follow_rooms: str, folder: Path
) -> None:
    """A client guide's three examples against the stack: the quickstart wakes an agent, sees its
    answer and reads an error; the follow example run twice goes on where it stopped (its cursor file,
    in ``folder``, holds the last cursor shown); so does the follow-every-room example."""
    await _check_follow_rooms(stack, run, follow_rooms, folder)
    company = await stack.new_company("Acme")
    env = {
        "QUAYUTEC_GATEWAY_ADDR": stack.gateway_addr,
        "QUAYUTEC_API_KEY": company.secret,
        "QUAYUTEC_PROVIDER_KEY": "sk-docs",
        "QUAYUTEC_PLAINTEXT": "1",
    }
    lines = await run(quickstart, env)
    assert lines[0] == "company Acme"
    assert lines[1] == "posted #1, waking 1 agent"
    assert re.fullmatch(r"the writer answered \(run \S+\)", lines[2]), lines
    assert lines[3] == "refused: INVALID_ARGUMENT: body is required"

    async with quayutec_client.connect(stack.gateway_addr, company.secret, plaintext=True, retry=PATIENT) as client:
        room = await client.create_room("followed")
        for body in ("one", "two", "three", "four"):
            await client.post_message(room.room_id, body, person="ana")
    follow_env = {**env, "QUAYUTEC_ROOM_ID": room.room_id, "QUAYUTEC_MAX_EVENTS": "2"}
    first = await run(follow, follow_env)
    again = await run(follow, follow_env)
    assert [line.split(": ", 1)[1] for line in first + again] == ["one", "two", "three", "four"], first + again
    assert (folder / f"room-{room.room_id}.cursor").read_text() == again[-1][1:].split("]")[0]


_ROOM_LINE = re.compile(r"(?P<room>[0-9a-f-]{36}) \[(?P<cursor>\d+)\] (?P<kind>[a-z_]+): (?P<body>.*)")


async def _check_follow_rooms(stack: SdkStack, run: RunExample, follow_rooms: str, folder: Path) -> None:
    """The follow-every-room example run twice, stopped in the middle of its first room: every event of
    every room once and in its room's order across the restart, a room joined between the runs from its
    joining; its cursor file (in ``folder``) holds each room's last cursor shown."""
    acme, bolt = await stack.new_company("Acme rooms"), await stack.new_company("Bolt rooms")
    env = {"QUAYUTEC_GATEWAY_ADDR": stack.gateway_addr, "QUAYUTEC_API_KEY": acme.secret, "QUAYUTEC_PLAINTEXT": "1"}
    async with (
        quayutec_client.connect(stack.gateway_addr, acme.secret, plaintext=True, retry=PATIENT) as a,
        quayutec_client.connect(stack.gateway_addr, bolt.secret, plaintext=True, retry=PATIENT) as b,
    ):
        first, second = await a.create_room("first"), await a.create_room("second")
        for room, body in ((first, "one"), (first, "two"), (second, "three")):
            await a.post_message(room.room_id, body, person="ana")
        before = await run(follow_rooms, {**env, "QUAYUTEC_MAX_EVENTS": "2"})
        # Between the runs: more in a room already followed, and a room Acme joins.
        await a.post_message(first.room_id, "four", person="ana")
        theirs = await b.create_room("theirs")
        await b.post_message(theirs.room_id, "before acme joined", person="bo")
        await a.accept_invitation((await b.invite_company(theirs.room_id, acme.company_id)).invitation_id)
        await b.post_message(theirs.room_id, "while away", person="bo")
    expected = {}
    for room in (first, second, theirs):
        log = await log_of(stack.room_addr, room.room_id, acme.company_id, 0)
        if room is theirs:  # from Acme's joining
            log = log[[e.kind for e in log].index(common_pb2.ROOM_EVENT_KIND_MEMBER_JOINED) :]
        expected[room.room_id] = [e.cursor for e in log]
    after = await run(follow_rooms, {**env, "QUAYUTEC_MAX_EVENTS": str(sum(map(len, expected.values())) - 2)})
    matched = [_ROOM_LINE.fullmatch(line) for line in before + after]
    shown = [m for m in matched if m is not None]
    assert len(shown) == len(matched), before + after
    got: dict[str, list[int]] = {}
    for line in shown:
        got.setdefault(line["room"], []).append(int(line["cursor"]))
    assert got == expected, before + after
    assert [line["body"] for line in shown if line["kind"] == "message_posted"].count("four") == 1
    assert "before acme joined" not in "\n".join(before + after)
    kept = json.loads((folder / "rooms.cursors.json").read_text())
    assert {room: int(cursor) for room, cursor in kept.items()} == {r: c[-1] for r, c in expected.items()}
