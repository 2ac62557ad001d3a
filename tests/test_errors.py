"""How database failures reach callers: a broken connection is UNAVAILABLE (a caller may retry what
is safe to repeat), anything else unexpected is INTERNAL."""

from __future__ import annotations

import asyncpg
import grpc
import pytest

from quayutec.errors import status_for


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionRefusedError("refused"),
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.exceptions.CannotConnectNowError("the database system is shutting down"),
        asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator command"),
        # Seen when PostgreSQL shut down in the middle of a Room transaction's commit.
        asyncpg.exceptions.InternalClientError("cannot switch to state 15; another operation (2) is in progress"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_broken_database_connection_is_unavailable(exc: Exception) -> None:
    assert status_for(exc)[0] == grpc.StatusCode.UNAVAILABLE


def test_other_failures_are_internal() -> None:
    assert status_for(ValueError("a bug"))[0] == grpc.StatusCode.INTERNAL
    assert status_for(asyncpg.exceptions.UniqueViolationError("duplicate"))[0] == grpc.StatusCode.INTERNAL
