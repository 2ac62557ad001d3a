"""Fixtures of the client SDK tests: the real stack with a Gateway process that can be killed
(tests.harness.sdk_stack), companies with keys, and Python clients of them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
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
