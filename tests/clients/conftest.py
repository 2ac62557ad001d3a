"""Fixtures of the client SDK tests: the real stack with a Gateway process that can be killed
(tests.harness.sdk_stack), companies with keys, and Python clients of them."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import quayutec_client
from quayutec_client import Client, RetryPolicy
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


async def check_guide_examples(stack: SdkStack, run: RunExample, quickstart: str, follow: str, folder: Path) -> None:
    """A client guide's two examples against the stack: the quickstart wakes an agent, sees its
    answer and reads an error; the follow example run twice goes on where it stopped (its cursor file,
    in ``folder``, holds the last cursor shown)."""
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
