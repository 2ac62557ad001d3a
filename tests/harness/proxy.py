"""Proxies on loopback that lose a call's answer after the server has acted on it (the caller is then
killed, or gives up): a TCP proxy that holds back a server's replies, and a gRPC proxy that drops the
answers of chosen methods."""

from __future__ import annotations

import asyncio
import contextlib

import grpc


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


class AnswerLosingProxy:
    """A gRPC proxy on loopback in front of an internal service (it serves as ``server``'s identity of
    the test PKI and calls it as ``caller``): unary calls are forwarded with their metadata and deadline,
    and the answers of the methods named in ``lose`` (full names, "/quayutec.v1.RoomService/PostMessage")
    are lost after the service gave them: the service has acted (committed), the caller gets UNAVAILABLE,
    as when the network eats an answer. ``lost`` counts them per method."""

    def __init__(self, target: str, *, server: str, caller: str) -> None:
        self._target = target
        self._server_name = server
        self._caller = caller
        self.lose: set[str] = set()
        self.lost: dict[str, int] = {}
        self.addr = ""
        self._grpc_server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None

    async def start(self) -> str:
        from quayutec.channels import internal_channel
        from tests.harness.channels import pki_identity

        self._channel = internal_channel(
            self._target, identity=pki_identity(self._caller), server=self._server_name, retry_unavailable=False
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_Forward(self),))
        port = server.add_secure_port("127.0.0.1:0", pki_identity(self._server_name).server_credentials())
        await server.start()
        self._grpc_server = server
        self.addr = f"127.0.0.1:{port}"
        return self.addr

    async def stop(self) -> None:
        if self._grpc_server is not None:
            await self._grpc_server.stop(0)
        if self._channel is not None:
            await self._channel.close()

    async def forward(self, method: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        assert self._channel is not None
        call = self._channel.unary_unary(method)
        remaining = context.time_remaining()
        metadata = tuple((m.key, m.value) for m in context.invocation_metadata() or () if not m.key.startswith(":"))
        try:
            answer: bytes = await call(request, timeout=remaining, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
        if method in self.lose:
            self.lost[method] = self.lost.get(method, 0) + 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the test's proxy lost the answer of {method}")
        return answer


class _Forward(grpc.GenericRpcHandler):  # type: ignore[misc]
    def __init__(self, proxy: AnswerLosingProxy) -> None:
        self._proxy = proxy

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method

        async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await self._proxy.forward(method, request, context)

        return grpc.unary_unary_rpc_method_handler(unary)
