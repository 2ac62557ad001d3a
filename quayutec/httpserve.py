"""An HTTP server (uvicorn) whose connections and request bodies are all bounded: the console's.

uvicorn cuts a kept-alive connection that stays quiet after a response, caps a request head at
16 KiB and answers 503 past ``limit_concurrency``; it never cuts a client that connects and then
sends its request line and headers slowly or not at all, and one address may hold every connection.
Two small guards close the gaps:

* ``header_deadline_protocol``: uvicorn's h11 protocol with a deadline on each request head,
  from the moment the connection opens (or the previous response ends) until the head is whole;
  past it the connection is closed. It also holds at most ``per_source`` connections of one
  source address (an IPv6 /64) open at once: a further one is closed as soon as it opens, before
  it counts against ``limit_concurrency``, so one address's half-sent requests (slowloris) cannot
  make everyone else's answer 503.
* ``BoundedBody``: an ASGI wrapper that reads a request's body before the application sees it,
  at most ``max_body_bytes`` (413 past it, or at once when a longer length is declared) and
  within ``body_seconds`` (408 past it), then hands it over whole.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from quayutec.config import env_float, env_int
from quayutec.throttle import source_of

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class HttpLimits:
    """The console's connection and body limits (QUAYUTEC_CONSOLE_*)."""

    header_seconds: float = 10.0
    body_seconds: float = 30.0
    keep_alive_seconds: int = 5
    max_connections: int = 500
    max_body_bytes: int = 1024 * 1024
    # Open connections of one source address (0: no limit, e.g. behind a proxy that is the only source).
    max_connections_per_source: int = 100

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HttpLimits:
        from quayutec.settings import setting

        env = os.environ if env is None else env
        return cls(
            header_seconds=env_float(env, setting("QUAYUTEC_CONSOLE_HEADER_TIMEOUT_SECONDS"), minimum=0.1),
            body_seconds=env_float(env, setting("QUAYUTEC_CONSOLE_BODY_TIMEOUT_SECONDS"), minimum=0.1),
            keep_alive_seconds=env_int(env, setting("QUAYUTEC_CONSOLE_KEEP_ALIVE_SECONDS"), minimum=1),
            max_connections=env_int(env, setting("QUAYUTEC_CONSOLE_MAX_CONNECTIONS"), minimum=1),
            max_body_bytes=env_int(env, setting("QUAYUTEC_CONSOLE_MAX_BODY_BYTES"), minimum=1024),
            max_connections_per_source=env_int(env, setting("QUAYUTEC_CONSOLE_MAX_CONNECTIONS_PER_SOURCE"), minimum=0),
        )


def server_config(app: App, *, host: str, port: int, limits: HttpLimits, **options: Any) -> uvicorn.Config:
    """A uvicorn config serving ``app`` on ``host:port`` with ``limits`` applied; ``options`` are
    uvicorn's own (log level, graceful shutdown...)."""
    return uvicorn.Config(
        BoundedBody(app, limits.max_body_bytes, limits.body_seconds),
        host=host,
        port=port,
        http=header_deadline_protocol(limits.header_seconds, limits.max_connections_per_source),
        timeout_keep_alive=limits.keep_alive_seconds,
        limit_concurrency=limits.max_connections,
        **options,
    )


def header_deadline_protocol(seconds: float, per_source: int = 0) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head is not whole ``seconds``
    after the connection opened or the previous response ended, and one that opens while its source
    address holds ``per_source`` others (0: no limit)."""
    held: dict[str, int] = {}  # open connections by source, shared by every connection of the server

    class HeaderDeadline(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _source: str | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            if per_source:
                source = source_of(self.client[0]) if self.client else "unknown"
                if held.get(source, 0) >= per_source:
                    transport.close()  # before it reads a byte: no request, no 503 for anyone else
                    return
                held[source] = held.get(source, 0) + 1
                self._source = source
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the head is whole
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._source is not None:
                left = held[self._source] - 1
                if left:
                    held[self._source] = left
                else:
                    del held[self._source]
                self._source = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(seconds, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


class _TooLarge(Exception):
    pass


class BoundedBody:
    """Reads each HTTP request's body (at most ``max_bytes``, within ``seconds``) before ``app``
    runs, and gives it to ``app`` whole; a client that hangs up meanwhile reaches no handler."""

    def __init__(self, app: App, max_bytes: int, seconds: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, 413)
            return
        try:
            async with asyncio.timeout(self.seconds):
                body = await self._read(receive)
        except TimeoutError:
            await self._refuse(send, 408)
            return
        except _TooLarge:
            await self._refuse(send, 413)
            return
        if body is None:  # the client hung up
            return
        handed = False

        async def replay() -> Message:
            nonlocal handed
            if not handed:
                handed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_bytes:
                raise _TooLarge
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)

    async def _refuse(self, send: Send, status: int) -> None:
        text = (
            f"The request body is longer than {self.max_bytes} bytes."
            if status == 413
            else f"The request body did not arrive within {self.seconds:g} seconds."
        )
        payload = text.encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
