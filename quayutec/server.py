"""Server lifecycle shared by the four services.

Start-up order: the caller opens its pool and builds its servicer, then ``GrpcServer.start()``
binds the server with our interceptors, health and reflection (v1 and v1alpha), and marks health
SERVING. Every port cuts connections that do nothing useful (``ConnectionLimits``: handshake
timeout, idle timeout, keepalive), and ``CallBudgets`` keeps health checks and reflection (open to
anyone) in a budget of their own, apart from the calls that carry a key or a certificate. An
internal service passes its ``identity``: it then serves
mutual TLS only and admits each call per ``quayutec.authz``; with ``health_listen`` set, a second,
plaintext server answers health checks only.
``stop()`` marks NOT_SERVING, drains with ``server.stop(grace)``, then runs the service's own
clean-up (closing its pool); it is safe to call twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

from quayutec.authz import AuthzInterceptor
from quayutec.config import ConfigError, ConnectionLimits, ServerConfig, ServiceSpec, env_str
from quayutec.errors import ErrorMappingInterceptor, WrappedHandlers
from quayutec.settings import setting
from quayutec.telemetry import setup_telemetry
from quayutec.throttle import source_of
from quayutec.tls import Identity

_log = logging.getLogger("quayutec.server")

# Bounded resources on every server: message size, and concurrent calls (``CallBudgets``, with
# ``ConnectionLimits``: QUAYUTEC_GRPC_MAX_CALLS and its neighbours).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Calls anyone may make without a key or a certificate: health checks and reflection.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# Keepalive enforcement: our own channels ping every few seconds, idle or not
# (quayutec.channels.KEEPALIVE_MS), to find a silent peer; a client may ping that often (at most
# once a second while no data flows, with or without calls in flight), and the third ping sooner
# than that closes its connection (GOAWAY too_many_pings). The argument is gRPC core's
# GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS.
MIN_CLIENT_PING_INTERVAL_MS = 1_000
MAX_PING_STRIKES = 2

# Server reflection v1 (what current grpcurl asks first) beside v1alpha. Its messages are the same
# as v1alpha's, field for field, so v1alpha's servicer answers both.
REFLECTION_V1_SERVICE = "grpc.reflection.v1.ServerReflection"


class _Reflection(ReflectionServicer):  # type: ignore[misc]
    """The stock servicer, which also finds the file of a method ("quayutec.v1.GatewayService.PostMessage"),
    as ``grpcurl describe`` asks for it."""

    def _file_containing_symbol(
        self, request: reflection_pb2.ServerReflectionRequest, fully_qualified_name: str
    ) -> reflection_pb2.ServerReflectionResponse:
        response = super()._file_containing_symbol(request, fully_qualified_name)
        if not response.HasField("error_response"):
            return response
        try:
            method = self._pool.FindMethodByName(fully_qualified_name)
        except KeyError:
            return response
        return super()._file_containing_symbol(request, method.containing_service.full_name)


class CallBudgets(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Concurrent calls in two budgets, so that a client with no key cannot starve the others.

    Keyed calls (the Gateway's API behind its key check, an internal service's behind mutual TLS)
    share ``max_calls``. Health checks and reflection, which anyone may call, have a budget of their
    own, ``open_calls``, of which one source address holds at most ``open_calls_per_source``; a
    health check (unary, answered at once) and a held stream (Watch, reflection) are counted apart,
    so streams held open never refuse a probe's Check. A call past its budget is answered
    RESOURCE_EXHAUSTED at once. (gRPC's own ``maximum_concurrent_rpcs`` counted every call in one
    budget: 1,024 health Watch streams with no key refused every other call.)"""

    def __init__(self, limits: ConnectionLimits) -> None:
        self._limits = limits
        self._keyed = 0
        # Open calls held, unary (False) and streams (True); and per (kind, source).
        self._open: dict[bool, int] = {False: 0, True: 0}
        self._open_by_source: dict[tuple[bool, str], int] = {}
        self._wrapped = WrappedHandlers()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method
        return self._wrapped.get(method, handler, lambda: self._budgeted(handler, method.startswith(OPEN_SERVICES)))

    def _take(self, open_call: bool, stream: bool, peer: str) -> Callable[[], None] | str:
        """A release function when the call fits its budget, else why it does not."""
        limits = self._limits
        if not open_call:
            if self._keyed >= limits.max_calls:
                return f"concurrent call limit reached ({limits.max_calls}: QUAYUTEC_GRPC_MAX_CALLS); retry shortly"
            self._keyed += 1

            def release_keyed() -> None:
                self._keyed -= 1

            return release_keyed
        source = (stream, source_of(peer))
        if self._open[stream] >= limits.open_calls:
            return f"too many health and reflection calls at once ({limits.open_calls}: QUAYUTEC_GRPC_OPEN_CALLS)"
        if self._open_by_source.get(source, 0) >= limits.open_calls_per_source:
            return (
                f"too many health and reflection calls from your address at once ({limits.open_calls_per_source}:"
                " QUAYUTEC_GRPC_OPEN_CALLS_PER_SOURCE)"
            )
        self._open[stream] += 1
        self._open_by_source[source] = self._open_by_source.get(source, 0) + 1

        def release_open() -> None:
            self._open[stream] -= 1
            left = self._open_by_source[source] - 1
            if left:
                self._open_by_source[source] = left
            else:
                del self._open_by_source[source]

        return release_open

    async def _enter(self, open_call: bool, stream: bool, context: grpc.aio.ServicerContext) -> Callable[[], None]:
        taken = self._take(open_call, stream, context.peer())
        if isinstance(taken, str):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, taken)
            raise AssertionError("abort raises")  # pragma: no cover
        return taken

    def _budgeted(self, handler: grpc.RpcMethodHandler, open_call: bool) -> grpc.RpcMethodHandler:
        """``handler`` holding a place in its budget while it runs, for all four kinds of RPC."""
        codecs = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            unary_unary = handler.unary_unary

            async def uu(request: Any, context: grpc.aio.ServicerContext) -> Any:
                release = await self._enter(open_call, False, context)
                try:
                    return await unary_unary(request, context)
                finally:
                    release()

            return grpc.unary_unary_rpc_method_handler(uu, **codecs)
        if handler.stream_unary is not None:
            stream_unary = handler.stream_unary

            async def su(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                release = await self._enter(open_call, True, context)
                try:
                    return await stream_unary(requests, context)
                finally:
                    release()

            return grpc.stream_unary_rpc_method_handler(su, **codecs)
        streaming = handler.unary_stream if handler.unary_stream is not None else handler.stream_stream

        async def held(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            release = await self._enter(open_call, True, context)
            try:
                async for response in _responses(streaming(request, context)):
                    yield response
            finally:
                release()

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(held, **codecs)
        return grpc.stream_stream_rpc_method_handler(held, **codecs)


async def _responses(result: Any) -> AsyncIterator[Any]:
    """The responses of a streaming handler, whether it yields them or writes them and returns."""
    if hasattr(result, "__aiter__"):
        async for response in result:
            yield response
    else:
        await result


def connection_options(limits: ConnectionLimits) -> list[tuple[str, int]]:
    """The gRPC core arguments that cut connections doing nothing useful (``ConnectionLimits``)."""

    def ms(seconds: float) -> int:
        return max(1, round(seconds * 1000))

    return [
        ("grpc.server_handshake_timeout_ms", ms(limits.handshake_seconds)),
        ("grpc.max_connection_idle_ms", ms(limits.idle_seconds)),
        ("grpc.keepalive_time_ms", ms(limits.keepalive_seconds)),
        ("grpc.keepalive_timeout_ms", ms(limits.keepalive_timeout_seconds)),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def add_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Reflection v1 and v1alpha on ``server`` for ``service_names`` (both reflection services listed)."""
    names = (*service_names, reflection.SERVICE_NAME, REFLECTION_V1_SERVICE)
    servicer = _Reflection(names)
    server.add_generic_rpc_handlers(
        tuple(
            grpc.method_handlers_generic_handler(
                service,
                {
                    "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                        servicer.ServerReflectionInfo,
                        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
                    )
                },
            )
            for service in (reflection.SERVICE_NAME, REFLECTION_V1_SERVICE)
        )
    )


class HealthWatch(Protocol):
    """Something that sets the server's health while it runs (quayutec.dbhealth.DatabaseHealth)."""

    def start(self, set_serving: Callable[[bool], Awaitable[None]]) -> None: ...
    async def stop(self) -> None: ...


class GrpcServer:
    """One gRPC server with health checking, reflection and error mapping."""

    def __init__(
        self,
        *,
        service_names: Sequence[str],
        config: ServerConfig,
        register: Callable[[grpc.aio.Server], None],
        on_stop: Callable[[], Awaitable[None]] | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        credentials: grpc.ServerCredentials | None = None,
        identity: Identity | None = None,
        health_watch: HealthWatch | None = None,
        second_port: tuple[str, grpc.ServerCredentials, str] | None = None,
    ) -> None:
        if identity is not None and credentials is not None:
            raise ValueError("give an internal service its identity or the public port its credentials, not both")
        self._service_names = tuple(service_names)
        self._config = config
        self._register = register
        self._on_stop = on_stop
        authz = (AuthzInterceptor(),) if identity is not None else ()
        # One per server, so the main and health ports share one budget of undecodable-request lines.
        self._errors = ErrorMappingInterceptor()
        # First, so a call past its budget costs nothing more; the health port has its own.
        self._interceptors = (CallBudgets(config.connections), *authz, *interceptors, self._errors)
        self._credentials = identity.server_credentials() if identity is not None else credentials
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port = 0
        self._health = health.aio.HealthServicer()
        self._stopping: asyncio.Task[None] | None = None
        self._health_watch = health_watch
        # Another port of the same server, with credentials of its own and the setting that names it
        # (the Gateway's console port).
        self._second_port = second_port
        self.second_port = 0
        self.port = 0

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with port 0)."""
        server = grpc.aio.server(
            interceptors=self._interceptors,
            options=[
                *EXCLUSIVE_PORTS,
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_concurrent_streams", self._config.connections.streams_per_connection),
                *connection_options(self._config.connections),
            ],
        )
        self._register(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        add_reflection(server, (*self._service_names, health.SERVICE_NAME))
        port = add_port(server, self._config.listen, self._config.listen_env, self._credentials)
        if self._second_port is not None:
            listen, credentials, listen_env = self._second_port
            self.second_port = add_port(server, listen, listen_env, credentials)
        await server.start()
        self._server = server
        if self._config.health_listen:
            try:
                await self._start_health_server(self._config.health_listen)
            except BaseException:
                await server.stop(0)
                self._server = None
                raise
        for name in ("", *self._service_names):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self._health_watch is not None:
            self._health_watch.start(self.set_serving)
        self.port = int(port)
        _log.info("%s listening on port %d", ", ".join(self._service_names), port)
        return self.port

    async def _start_health_server(self, listen: str) -> None:
        """Plaintext health checks only, for probes that cannot present a client certificate."""
        limits = self._config.connections
        health_server = grpc.aio.server(
            interceptors=(CallBudgets(limits), self._errors),
            options=[
                *EXCLUSIVE_PORTS,
                ("grpc.max_receive_message_length", 4096),
                ("grpc.max_concurrent_streams", min(limits.open_calls_per_source, limits.streams_per_connection)),
                *connection_options(limits),
            ],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, health_server)
        port = add_port(health_server, listen, self._config.health_listen_env, None)
        await health_server.start()
        self._health_server = health_server
        self.health_port = int(port)
        _log.info("health checks (plaintext) on port %d", port)

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving and clean up; concurrent and repeated calls wait for the same stop."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(self._config.grace_seconds if grace is None else grace))
        await asyncio.shield(self._stopping)

    async def set_serving(self, serving: bool) -> None:
        """Health SERVING or NOT_SERVING for this server's services (what readiness probes ask; ignored
        once stopping). The process's own health ("", what liveness probes ask) stays SERVING."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._service_names:
            await self._health.set(name, status)

    async def _stop(self, grace: float) -> None:
        if self._health_watch is not None:
            await self._health_watch.stop()
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._on_stop is not None:
            await self._on_stop()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def serve_until_signal(self) -> None:
        """Serve until SIGTERM or SIGINT, then stop gracefully."""
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_requested.set)
        if self._server is None:
            await self.start()
        await stop_requested.wait()
        _log.info("stopping %s", ", ".join(self._service_names))
        await self.stop()


# gRPC servers bind with SO_REUSEPORT unless told not to: a second server on a port in use would start
# without a word and the kernel would split the connections between the two. Ours bind alone.
EXCLUSIVE_PORTS = (("grpc.so_reuseport", 0),)
# How a service ends when a port it was told to listen on is taken: the stack that started it may
# choose another port and start it again (services/stack.py).
PORT_IN_USE_EXIT = 98


class PortInUse(ConfigError):
    """A port a server was told to listen on cannot be had; the message names it and its setting."""


def port_in_use(listen: str, listen_env: str, what: str = "") -> PortInUse:
    return PortInUse(
        f"cannot listen on {listen}{what} ({listen_env}): the port is in use by another program (or the "
        f"address is not one of this machine's). Stop what holds it, or set {listen_env} to another host:port"
    )


def add_port(server: grpc.aio.Server, listen: str, listen_env: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind ``listen`` on ``server`` (TLS with ``credentials``, else plaintext), alone (EXCLUSIVE_PORTS);
    a port in use is refused with PortInUse naming it and ``listen_env``."""
    try:
        if credentials is not None:
            port = server.add_secure_port(listen, credentials)
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError:  # grpcio: "Failed to bind to address ..."
        port = 0
    if port == 0:
        raise port_in_use(listen, listen_env)
    return int(port)


def run_service(main: Callable[[], Coroutine[Any, Any, None]], service: ServiceSpec | str) -> None:
    """The ``python -m services.<name>`` entry: logging, telemetry (before any server, channel or
    pool exists, so the instrumentation sees them), then ``main`` on the configured event loop;
    flushes at exit."""
    loop_name, level = process_settings(os.environ)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    telemetry = setup_telemetry(service.name if isinstance(service, ServiceSpec) else service)
    try:
        if loop_name == "uvloop":
            uvloop.run(main())
        else:
            asyncio.run(main())
    except PortInUse as exc:
        _log.error("%s", exc)
        raise SystemExit(PORT_IN_USE_EXIT) from None
    except ConfigError as exc:
        # A setting to fix (or a data folder another stack owns): say which, without a traceback.
        _log.error("%s", exc)
        raise SystemExit(2) from None
    finally:
        telemetry.shutdown()


_LOOPS = ("uvloop", "asyncio")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def process_settings(env: Mapping[str, str]) -> tuple[str, int]:
    """QUAYUTEC_EVENT_LOOP and QUAYUTEC_LOG_LEVEL, checked: a wrong value stops the service at start."""
    loop_name = env_str(env, setting("QUAYUTEC_EVENT_LOOP")).strip().lower()
    if loop_name not in _LOOPS:
        raise ConfigError(f"QUAYUTEC_EVENT_LOOP must be one of {', '.join(_LOOPS)}, got {loop_name!r}")
    level = env_str(env, setting("QUAYUTEC_LOG_LEVEL")).strip().upper()
    if level not in _LEVELS:
        raise ConfigError(f"QUAYUTEC_LOG_LEVEL must be one of {', '.join(_LEVELS)}, got {level!r}")
    return loop_name, logging.getLevelNamesMapping()[level]
