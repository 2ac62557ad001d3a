"""How database failures reach callers: a broken connection is UNAVAILABLE (a caller may retry what
is safe to repeat), a transaction rolled back by a concurrent change is ABORTED, anything else
unexpected is INTERNAL."""

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
        # The server ended a session left idle in its transaction (the transaction was rolled back):
        # a Room replica cut off from the database mid-transaction reads it once the network is back.
        asyncpg.exceptions.IdleInTransactionSessionTimeoutError(
            "terminating connection due to idle-in-transaction timeout"
        ),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_broken_database_connection_is_unavailable(exc: Exception) -> None:
    assert status_for(exc)[0] == grpc.StatusCode.UNAVAILABLE


def test_other_failures_are_internal() -> None:
    assert status_for(ValueError("a bug"))[0] == grpc.StatusCode.INTERNAL
    assert status_for(asyncpg.exceptions.UniqueViolationError("duplicate"))[0] == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize(
    "exc",
    [
        asyncpg.exceptions.SerializationError("could not serialize access due to concurrent update"),
        asyncpg.exceptions.DeadlockDetectedError("deadlock detected"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_transaction_rolled_back_by_a_concurrent_change_is_aborted(exc: Exception) -> None:
    code, message = status_for(exc)
    assert code == grpc.StatusCode.ABORTED
    assert "nothing was written" in message
