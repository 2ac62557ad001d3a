"""Configuration shared by every service: environment readers and the service table.

Each service reads its own settings through a frozen dataclass with a ``from_env()``
under one prefix (``QUAYUTEC_<SERVICE>_``); nothing reads the environment at import.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from quayutec.tls import MtlsConfig


@dataclass(frozen=True)
class ServiceSpec:
    """Where a service listens by default and how other services find it."""

    name: str
    port: int
    grpc_service: str
    # Listen on every interface when started alone (only the Gateway, the public door); the
    # internal services listen on loopback unless QUAYUTEC_<SVC>_LISTEN says otherwise.
    public: bool = False

    @property
    def prefix(self) -> str:
        return f"QUAYUTEC_{self.name.upper()}_"

    @property
    def listen_env(self) -> str:
        return f"{self.prefix}LISTEN"

    @property
    def addr_env(self) -> str:
        return f"{self.prefix}ADDR"

    @property
    def health_listen_env(self) -> str:
        return f"{self.prefix}HEALTH_LISTEN"

    @property
    def default_listen(self) -> str:
        return f"[::]:{self.port}" if self.public else f"127.0.0.1:{self.port}"

    @property
    def default_addr(self) -> str:
        return f"localhost:{self.port}" if self.public else f"127.0.0.1:{self.port}"


GATEWAY = ServiceSpec("gateway", 50051, "quayutec.v1.GatewayService", public=True)
ROOM = ServiceSpec("room", 50052, "quayutec.v1.RoomService")
CLAIMS = ServiceSpec("claims", 50053, "quayutec.v1.ClaimsService")
RUNTIME = ServiceSpec("runtime", 50054, "quayutec.v1.RuntimeService")
SERVICES: tuple[ServiceSpec, ...] = (GATEWAY, ROOM, CLAIMS, RUNTIME)

DATABASE_URL_ENV = "DATABASE_URL"
DATA_DIR_ENV = "QUAYUTEC_DATA_DIR"
ENCRYPTION_KEY_ENV = "QUAYUTEC_ENCRYPTION_KEY"
DEFAULT_DATA_DIR = ".quayutec"


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the variable to fix."""


class Declared(Protocol):
    """A setting's declaration (``quayutec.settings.Setting``): its name and typed default."""

    @property
    def name(self) -> str: ...
    @property
    def default(self) -> str | int | float | bool | None: ...


def _declared(name: str | Declared, default: Any) -> tuple[str, Any]:
    """A reader's name and default: from the declaration when given one (the usual case)."""
    if isinstance(name, str):
        return name, default
    return name.name, name.default if default is None else default


def env_str(env: Mapping[str, str], name: str | Declared, default: str | None = None) -> str:
    name, default = _declared(name, default)
    value = env.get(name, "").strip()
    return value or str(default or "")


def env_bool(env: Mapping[str, str], name: str | Declared, default: bool | None = None) -> bool:
    name, default = _declared(name, default)
    raw = env_str(env, name, "").lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {raw!r}")


def env_int(env: Mapping[str, str], name: str | Declared, default: int | None = None, *, minimum: int = 0) -> int:
    name, default = _declared(name, default)
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from exc
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
    return value


def env_float(
    env: Mapping[str, str], name: str | Declared, default: float | None = None, *, minimum: float = 0.0
) -> float:
    name, default = _declared(name, default)
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from exc
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {raw!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
    return value


# The services that hold database pools, whose replicas share the server's connections.
WITH_DATABASE: tuple[str, ...] = ("gateway", "room", "claims")
CONNECTIONS_RESERVED_ENV = "QUAYUTEC_DB_CONNECTIONS_RESERVED"


@dataclass(frozen=True)
class ConnectionBudget:
    """What every replica of the services could hold at once: each service's most replicas times
    its pool's size, plus a reserve (migrations, the admin commands, an operator's psql). A service
    checks it against the server's ``max_connections`` when it starts (``quayutec.db``)."""

    shares: tuple[tuple[str, int, int], ...]  # (service, most replicas, pool size)
    reserved: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ConnectionBudget:
        from quayutec.settings import setting

        env = os.environ if env is None else env
        shares = tuple(
            (
                name,
                env_int(env, setting(f"QUAYUTEC_{name.upper()}_REPLICAS_MAX"), minimum=1),
                env_int(env, setting(f"QUAYUTEC_{name.upper()}_DB_POOL_MAX"), minimum=1),
            )
            for name in WITH_DATABASE
        )
        return cls(shares=shares, reserved=env_int(env, setting(CONNECTIONS_RESERVED_ENV), minimum=0))

    @property
    def total(self) -> int:
        return sum(replicas * pool for _, replicas, pool in self.shares) + self.reserved

    def explain(self) -> str:
        """``gateway 6 × 8 + room 2 × 10 + claims 2 × 5 + reserved 10 = 88``."""
        parts = [f"{name} {replicas} × {pool}" for name, replicas, pool in self.shares]
        return f"{' + '.join(parts)} + reserved {self.reserved} = {self.total}"


@dataclass(frozen=True)
class DatabaseConfig:
    """``DATABASE_URL`` (or the service's own ``QUAYUTEC_<SVC>_DATABASE_URL``) when set; otherwise an
    embedded PostgreSQL under ``data_dir``. ``role``: the PostgreSQL role the service's sessions run
    as (``quayutec.roles``; None: the login user's own, as the admin commands and migrations do)."""

    url: str | None
    data_dir: Path
    pool_min: int = 1
    pool_max: int = 10
    budget: ConnectionBudget | None = None
    # PostgreSQL ends a session left idle inside a transaction this long (0: never).
    idle_in_transaction_seconds: float = 10.0
    role: str | None = None
    # Bounded waits (quayutec.db.create_pool): for a pooled connection, a statement, a new
    # connection, and unacknowledged data or silence on a connection's socket.
    acquire_timeout_seconds: float = 5.0
    command_timeout_seconds: float = 30.0
    connect_timeout_seconds: float = 5.0
    tcp_timeout_seconds: float = 10.0
    # How often a service checks that it reaches its database (its gRPC health follows).
    health_interval_seconds: float = 2.0
    # The login URL when the service has one of its own (``url`` is then that one).
    admin_url: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, prefix: str = "QUAYUTEC_") -> DatabaseConfig:
        from quayutec.roles import service_role
        from quayutec.settings import SETTINGS, setting

        env = os.environ if env is None else env
        shared_url = env.get(DATABASE_URL_ENV, "").strip() or None
        own = f"{prefix}DATABASE_URL"
        url = (env.get(own, "").strip() or None) if own in SETTINGS else None
        data_dir = Path(env_str(env, setting(DATA_DIR_ENV))).absolute()
        pool_min = env_int(env, setting(f"{prefix}DB_POOL_MIN"), minimum=0)
        pool_max = env_int(env, setting(f"{prefix}DB_POOL_MAX"), minimum=1)
        if pool_min > pool_max:
            raise ConfigError(f"{prefix}DB_POOL_MIN ({pool_min}) exceeds {prefix}DB_POOL_MAX ({pool_max})")
        budget = ConnectionBudget.from_env(env)
        idle = env_float(env, setting("QUAYUTEC_DB_IDLE_IN_TRANSACTION_SECONDS"), minimum=0.0)
        service = prefix.removeprefix("QUAYUTEC_").rstrip("_").lower()
        return cls(
            url=url or shared_url,
            data_dir=data_dir,
            pool_min=pool_min,
            pool_max=pool_max,
            budget=budget,
            idle_in_transaction_seconds=idle,
            role=service_role(service) if service else None,
            acquire_timeout_seconds=env_float(env, setting("QUAYUTEC_DB_ACQUIRE_TIMEOUT_SECONDS"), minimum=0.1),
            command_timeout_seconds=env_float(env, setting("QUAYUTEC_DB_COMMAND_TIMEOUT_SECONDS"), minimum=0.1),
            connect_timeout_seconds=env_float(env, setting("QUAYUTEC_DB_CONNECT_TIMEOUT_SECONDS"), minimum=0.1),
            tcp_timeout_seconds=env_float(env, setting("QUAYUTEC_DB_TCP_TIMEOUT_SECONDS"), minimum=1.0),
            health_interval_seconds=env_float(env, setting("QUAYUTEC_DB_HEALTH_INTERVAL_SECONDS"), minimum=0.1),
            admin_url=shared_url if url else None,
        )


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a gRPC server keeps a connection that does nothing useful (every port of every
    service): the TLS and HTTP/2 handshake must finish within ``handshake_seconds``; a connection
    with no call open for ``idle_seconds`` is closed (GOAWAY); one quiet for ``keepalive_seconds``
    is pinged, and closed when the ping is not answered within ``keepalive_timeout_seconds``."""

    handshake_seconds: float = 10.0
    idle_seconds: float = 300.0
    keepalive_seconds: float = 60.0
    keepalive_timeout_seconds: float = 20.0
    # Concurrent calls: keyed ones, and health and reflection (a budget of their own, and per source);
    # the streams of one HTTP/2 connection (quayutec.server.CallBudgets).
    max_calls: int = 1024
    open_calls: int = 64
    open_calls_per_source: int = 8
    streams_per_connection: int = 1024

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ConnectionLimits:
        from quayutec.settings import setting

        env = os.environ if env is None else env
        return cls(
            handshake_seconds=env_float(env, setting("QUAYUTEC_GRPC_HANDSHAKE_TIMEOUT_SECONDS"), minimum=0.1),
            idle_seconds=env_float(env, setting("QUAYUTEC_GRPC_IDLE_SECONDS"), minimum=1.0),
            keepalive_seconds=env_float(env, setting("QUAYUTEC_GRPC_KEEPALIVE_SECONDS"), minimum=1.0),
            keepalive_timeout_seconds=env_float(env, setting("QUAYUTEC_GRPC_KEEPALIVE_TIMEOUT_SECONDS"), minimum=1.0),
            max_calls=env_int(env, setting("QUAYUTEC_GRPC_MAX_CALLS"), minimum=1),
            open_calls=env_int(env, setting("QUAYUTEC_GRPC_OPEN_CALLS"), minimum=1),
            open_calls_per_source=env_int(env, setting("QUAYUTEC_GRPC_OPEN_CALLS_PER_SOURCE"), minimum=1),
            streams_per_connection=env_int(env, setting("QUAYUTEC_GRPC_MAX_STREAMS_PER_CONNECTION"), minimum=1),
        )


@dataclass(frozen=True)
class ServerConfig:
    """Where one service listens, how long it drains on shutdown, where its certificates come from
    (``None``: from the environment when the server is made), when set, a second plaintext
    port that serves only health checks (for probes that cannot present a client certificate), and
    how long its connections may do nothing."""

    listen: str
    grace_seconds: float
    mtls: MtlsConfig | None = None
    health_listen: str | None = None
    connections: ConnectionLimits = ConnectionLimits()

    @classmethod
    def from_env(cls, spec: ServiceSpec, env: Mapping[str, str] | None = None) -> ServerConfig:
        from quayutec.settings import setting
        from quayutec.tls import MtlsConfig

        env = os.environ if env is None else env
        return cls(
            listen=env_str(env, setting(spec.listen_env)),
            grace_seconds=env_float(env, setting(f"{spec.prefix}GRACE_SECONDS")),
            mtls=MtlsConfig.from_env(env),
            health_listen=env_str(env, setting(spec.health_listen_env)) or None,
            connections=ConnectionLimits.from_env(env),
        )


def service_addr(spec: ServiceSpec, env: Mapping[str, str] | None = None) -> str:
    """The address other services dial to reach ``spec``."""
    from quayutec.settings import setting

    env = os.environ if env is None else env
    return env_str(env, setting(spec.addr_env))
