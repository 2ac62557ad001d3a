"""Wiring and lifecycle of the Gateway: key pool, Room and Runtime channels, auth, servicer, delivery loop."""

from __future__ import annotations

import asyncpg
import grpc
from a2a.types import a2a_pb2_grpc

from quayutec.channels import internal_channel
from quayutec.config import GATEWAY, ROOM, RUNTIME, ConfigError
from quayutec.migrate import GATEWAY as GATEWAY_COMPONENT
from quayutec.migrate import service_pool
from quayutec.server import GrpcServer
from quayutec.tls import Identity, load_identity
from quayutec.v1 import gateway_pb2_grpc, room_pb2_grpc, runtime_pb2_grpc, signin_pb2_grpc
from services.gateway.a2a import SERVICE_NAME as A2A_SERVICE
from services.gateway.a2a import A2AGrpcHandler, RoomAgentHandler
from services.gateway.auth import Authenticator, AuthInterceptor, CallerContext
from services.gateway.config import GatewayConfig
from services.gateway.delivery import WakeDelivery
from services.gateway.keycache import KeyCache
from services.gateway.notify import COMPANY_ROOMS_CHANNEL, ROOM_EVENTS_CHANNEL, Listener, WakeListener
from services.gateway.oidc import OidcClient
from services.gateway.ratelimit import PostRateLimiter
from services.gateway.servicer import GatewayServicer
from services.gateway.signin import SignInServicer
from services.gateway.store import ApiKeyStore
from services.gateway.streams import KEYS_REVOKED_CHANNEL, OpenStreams
from services.gateway.watch import RoomEventHub

# Files and messages up to 10 MiB pass through to the Room.


def server_credentials(config: GatewayConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured PEM files, or None for plaintext."""
    if config.tls_cert_path is None or config.tls_key_path is None:
        return None
    try:
        cert = config.tls_cert_path.read_bytes()
        key = config.tls_key_path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read {GATEWAY.prefix}TLS_CERT / {GATEWAY.prefix}TLS_KEY ({exc.filename}): {exc.strerror}"
        ) from exc
    return grpc.ssl_server_credentials([(key, cert)])


def backend_channel(addr: str, server: str, identity: Identity, config: GatewayConfig) -> grpc.aio.Channel:
    """One shared channel to an internal service, as the Gateway's identity, reconnecting soon after
    it comes back; no retries of UNAVAILABLE (a posted message must not be sent twice)."""
    return internal_channel(
        addr,
        identity=identity,
        server=server,
        retry_unavailable=False,
        options=[
            ("grpc.initial_reconnect_backoff_ms", min(1000, config.reconnect_backoff_max_ms)),
            ("grpc.min_reconnect_backoff_ms", min(1000, config.reconnect_backoff_max_ms)),
            ("grpc.max_reconnect_backoff_ms", config.reconnect_backoff_max_ms),
            # This server's own connections, not shared with other channels of the process.
            ("grpc.use_local_subchannel_pool", 1),
        ],
    )


async def create_server(config: GatewayConfig, *, pool: asyncpg.Pool | None = None) -> GrpcServer:
    """A Gateway server, not yet started; the delivery loop starts with the first call and stops on stop."""
    credentials = server_credentials(config)
    identity = load_identity(GATEWAY.name, config.server.mtls)
    held = await service_pool(config.database, GATEWAY_COMPONENT, migrate_on_start=config.migrate_on_start, pool=pool)
    pool = held.pool
    room_channel = backend_channel(config.room_addr, ROOM.name, identity, config)
    runtime_channel = backend_channel(config.runtime_addr, RUNTIME.name, identity, config)
    room = room_pb2_grpc.RoomServiceStub(room_channel)
    caller = CallerContext()
    # One LISTEN connection of this replica for every WatchRoom stream it serves.
    hub = RoomEventHub(
        room,
        config.watch,
        room_timeout_seconds=config.room_timeout_seconds,
        listening=lambda: events_listener.listening.is_set(),
    )
    keys = ApiKeyStore(pool)
    # Every open stream of this replica: each company's share, ended when its key is revoked.
    streams = OpenStreams(config.streams, keys)
    channels = {ROOM_EVENTS_CHANNEL: hub.notified, COMPANY_ROOMS_CHANNEL: hub.rooms_changed}
    # Key lookups kept in memory only while revocations are listened for (fails closed otherwise).
    revocation_notify = config.streams.revocation_notify
    key_cache = KeyCache(config.key_cache, lambda: revocation_notify and events_listener.listening.is_set())
    keys.on_revoked.append(key_cache.revoked)  # revoked through this replica: dropped before the answer
    if revocation_notify:

        def revoked(key_id: str) -> None:
            key_cache.revoked(key_id)
            streams.revoked(key_id)

        channels[KEYS_REVOKED_CHANNEL] = revoked

    def listening() -> None:
        key_cache.clear()  # revocations sent while not listening were missed
        hub.reconnected()
        streams.listening()

    events_listener = Listener(pool, channels, listening)
    # One per-company rate limit for the Gateway's own API and the A2A door.
    limiter = PostRateLimiter(config.rate_limit)
    # Calls to companies' OpenID providers go through the egress guard (services/gateway/oidc.py).
    oidc = OidcClient(config.egress)
    sign_in = SignInServicer(
        keys,
        config.cipher,
        oidc,
        max_session_keys=config.max_session_keys,
        limiter=limiter,
        throttle=config.auth_throttle,
    )
    delivery = WakeDelivery(room, runtime_pb2_grpc.RuntimeServiceStub(runtime_channel), config.delivery)
    servicer = GatewayServicer(
        room,
        caller,
        limiter,
        room_timeout_seconds=config.room_timeout_seconds,
        watch=hub,
        keys=keys,
        max_session_keys=config.max_session_keys,
        max_api_keys=config.max_api_keys,
        cipher=config.cipher,
        oidc=oidc,
        delivery=delivery,
    )

    def card_url() -> str:
        if config.a2a_url:
            return config.a2a_url
        host = config.server.listen.rpartition(":")[0] or "127.0.0.1"
        if host in ("0.0.0.0", "[::]", "::"):
            host = "127.0.0.1"
        return f"{host}:{grpc_server.port}"

    a2a = A2AGrpcHandler(
        RoomAgentHandler(
            room,
            caller,
            limiter,
            servicer,
            room_timeout_seconds=config.room_timeout_seconds,
            block_seconds=config.a2a_block_seconds,
            card_url=card_url,
            watch=hub,
        )
    )
    listener = WakeListener(pool, delivery.nudge)

    def register(server: grpc.aio.Server) -> None:
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
        signin_pb2_grpc.add_SignInServiceServicer_to_server(sign_in, server)
        a2a_pb2_grpc.add_A2AServiceServicer_to_server(a2a, server)  # type: ignore[no-untyped-call]
        events_listener.start()
        streams.start()
        if config.delivery.enabled:
            delivery.start()
            if config.delivery.wake_notify:
                listener.start()

    async def on_stop() -> None:
        try:
            await listener.stop()
            await events_listener.stop()
            await streams.stop()
            await delivery.stop()
            await room_channel.close()
            await runtime_channel.close()
            await oidc.aclose()
        finally:
            await held.close()

    grpc_server = GrpcServer(
        service_names=(GATEWAY.grpc_service, A2A_SERVICE),
        config=config.server,
        register=register,
        on_stop=on_stop,
        interceptors=(AuthInterceptor(Authenticator(keys, config.auth_throttle, key_cache), caller, streams),),
        credentials=credentials,
        health_watch=held.health,
        # The console's port: the same API over mutual TLS as the Gateway's own identity, where a
        # console certificate's forwarded browser address is believed (services/gateway/auth.py).
        second_port=(
            (config.console_listen, identity.server_credentials(), "QUAYUTEC_GATEWAY_CONSOLE_LISTEN")
            if config.console_listen
            else None
        ),
    )
    return grpc_server


async def main() -> None:
    server = await create_server(GatewayConfig.from_env())
    await server.serve_until_signal()
