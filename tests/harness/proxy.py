"""A TCP proxy on loopback that can hold back a server's replies, to lose a call's answer after the
server has acted on it (the caller is then killed, or gives up)."""

from __future__ import annotations

import asyncio
import contextlib


class HoldingProxy:
    """Forwards 127.0.0.1:<port> to ``target``. While ``hold()`` is in force, bytes from the target are
    kept back (the request still goes through); ``release()`` lets them flow again."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.addr = ""

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.addr = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.addr

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            await self._server.wait_closed()

    def hold(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    async def drop_connections(self) -> None:
        """Close every connection through the proxy (what is held is lost); new ones are still accepted."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self._target)
        except OSError:
            client_writer.close()
            return
        up = asyncio.create_task(self._pump(client_reader, server_writer, held=False))
        down = asyncio.create_task(self._pump(server_reader, client_writer, held=True))
        self._tasks |= {up, down}
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (up, down):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                self._tasks.discard(task)
            for writer in (client_writer, server_writer):
                writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, held: bool) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if held:
                    await self._flowing.wait()
                writer.write(data)
                await writer.drain()
