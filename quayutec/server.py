"""Server lifecycle shared by the four services.

Start-up order: the caller opens its pool and builds its servicer, then ``GrpcServer.start()``
binds the server with our interceptors, health and reflection (v1 and v1alpha), and marks health
SERVING. Every port cuts connections that do nothing useful (``ConnectionLimits``: handshake
timeout, idle timeout, keepalive). An internal service passes its ``identity``: it then serves
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
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer

from quayutec.authz import AuthzInterceptor
from quayutec.config import ConfigError, ConnectionLimits, ServerConfig, ServiceSpec, env_str
from quayutec.errors import ErrorMappingInterceptor
from quayutec.settings import setting
from quayutec.telemetry import setup_telemetry
from quayutec.tls import Identity

_log = logging.getLogger("quayutec.server")

# Bounded resources on every server: message size and concurrent streams.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_CONCURRENT_RPCS = 1024
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
        self._interceptors = (*authz, *interceptors, self._errors)
        self._credentials = identity.server_credentials() if identity is not None else credentials
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port = 0
        self._health = health.aio.HealthServicer()
        self._stopping: asyncio.Task[None] | None = None
        self._health_watch = health_watch
        self.port = 0

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with port 0)."""
        server = grpc.aio.server(
            interceptors=self._interceptors,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_concurrent_streams", MAX_CONCURRENT_RPCS),
                *connection_options(self._config.connections),
            ],
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        self._register(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        add_reflection(server, (*self._service_names, health.SERVICE_NAME))
        if self._credentials is not None:
            port = server.add_secure_port(self._config.listen, self._credentials)
        else:
            port = server.add_insecure_port(self._config.listen)
        if port == 0:
            raise OSError(f"could not listen on {self._config.listen}")
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
        health_server = grpc.aio.server(
            interceptors=(self._errors,),
            options=[("grpc.max_receive_message_length", 4096), *connection_options(self._config.connections)],
            maximum_concurrent_rpcs=16,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, health_server)
        port = health_server.add_insecure_port(listen)
        if port == 0:
            raise OSError(f"could not listen on {listen} (health checks)")
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
