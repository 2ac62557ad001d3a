"""Egress test doubles: a resolver answering from a table (no DNS query leaves the machine) and a
dialer that records what it would dial and dials nothing.

``PUBLIC`` is a public address used only as an answer of the table: nothing ever connects to it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import httpcore

PUBLIC = "93.184.215.14"

# Names the tests use, and what the table says they resolve to.
TEST_HOSTS: Mapping[str, Sequence[str]] = {
    "models.acme.test": (PUBLIC,),
    "localhost": ("127.0.0.1", "::1"),
}


class TableResolver:
    """Answers from ``table`` and records each question; an unknown name does not resolve, and a
    name in ``temporary`` fails as a resolver that cannot answer now (EAI_AGAIN)."""

    def __init__(self, table: Mapping[str, Sequence[str]] | None = None, *, temporary: Iterable[str] = ()) -> None:
        self.table: dict[str, Sequence[str]] = dict(TEST_HOSTS if table is None else table)
        self.temporary = frozenset(temporary)
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.asked.append((host, port))
        if host.lower() in self.temporary:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        answer = self.table.get(host.lower())
        if answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return answer


class RecordingDialer(httpcore.AsyncNetworkBackend):
    """Records every (address, port) it is asked to dial and fails the dial: nothing is dialled."""

    def __init__(self) -> None:
        self.dialled: list[tuple[str, int]] = []

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        self.dialled.append((host, port))
        raise httpcore.ConnectError(f"recording dialer: {host}:{port} not dialled")

    async def sleep(self, seconds: float) -> None:
        return None
