"""Configuration shared by every service: the database, server and connection settings.

Each service reads its own settings through a frozen dataclass with a ``from_env()``
under one prefix (``QUAYUTEC_<SERVICE>_``); nothing reads the environment at import. The
environment readers and the service table live in ``quayutec.envread`` (imported by
``quayutec.settings`` and ``quayutec.tls`` too) and are re-exported here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from quayutec.envread import CLAIMS as CLAIMS
from quayutec.envread import DATA_DIR_ENV as DATA_DIR_ENV
from quayutec.envread import DATABASE_URL_ENV as DATABASE_URL_ENV
from quayutec.envread import DEFAULT_DATA_DIR as DEFAULT_DATA_DIR
from quayutec.envread import ENCRYPTION_KEY_ENV as ENCRYPTION_KEY_ENV
from quayutec.envread import GATEWAY as GATEWAY
from quayutec.envread import ROOM as ROOM
from quayutec.envread import RUNTIME as RUNTIME
from quayutec.envread import SERVICES as SERVICES
from quayutec.envread import ConfigError as ConfigError
from quayutec.envread import Declared as Declared
from quayutec.envread import ServiceSpec as ServiceSpec
from quayutec.envread import env_bool as env_bool
from quayutec.envread import env_float as env_float
from quayutec.envread import env_int as env_int
from quayutec.envread import env_str as env_str
from quayutec.settings import SETTINGS, setting
from quayutec.tls import MtlsConfig

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


# The values PostgreSQL takes for plan_cache_mode.
PLAN_CACHE_MODES = ("force_generic_plan", "auto", "force_custom_plan")


# The longest QUAYUTEC_DB_CLIENT_CHECK_SECONDS: a backend whose caller is gone stops within it.
MAX_CLIENT_CHECK_SECONDS = 60.0


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
    # PostgreSQL ends a statement of a session this long (statement_timeout; at most the command timeout).
    statement_timeout_seconds: float = 30.0
    # How often a backend running a statement checks that its client is still there (0: never).
    client_check_seconds: float = 2.0
    # PostgreSQL's plan_cache_mode for the sessions (PLAN_CACHE_MODES).
    plan_cache_mode: str = "force_generic_plan"
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
        plan_cache_mode = env_str(env, setting("QUAYUTEC_DB_PLAN_CACHE_MODE")).strip()
        if plan_cache_mode not in PLAN_CACHE_MODES:
            raise ConfigError(
                f"QUAYUTEC_DB_PLAN_CACHE_MODE must be one of {', '.join(PLAN_CACHE_MODES)}, not {plan_cache_mode!r}"
            )
        command_timeout = env_float(env, setting("QUAYUTEC_DB_COMMAND_TIMEOUT_SECONDS"), minimum=0.1)
        statement_timeout = env_float(env, setting("QUAYUTEC_DB_STATEMENT_TIMEOUT_SECONDS"), minimum=0.1)
        if statement_timeout > command_timeout:
            raise ConfigError(
                f"QUAYUTEC_DB_STATEMENT_TIMEOUT_SECONDS ({statement_timeout:g}) exceeds "
                f"QUAYUTEC_DB_COMMAND_TIMEOUT_SECONDS ({command_timeout:g}): a statement the service stopped "
                "waiting for would go on in PostgreSQL; set it to the command timeout or less"
            )
        client_check = env_float(env, setting("QUAYUTEC_DB_CLIENT_CHECK_SECONDS"), minimum=0.0)
        if client_check > MAX_CLIENT_CHECK_SECONDS:
            raise ConfigError(
                f"QUAYUTEC_DB_CLIENT_CHECK_SECONDS must be at most {MAX_CLIENT_CHECK_SECONDS:g} (0 turns it off), "
                f"got {client_check:g}: a backend whose caller is gone would run on that long"
            )
        service = prefix.removeprefix("QUAYUTEC_").rstrip("_").lower()
        return cls(
            url=url or shared_url,
            data_dir=data_dir,
            pool_min=pool_min,
            pool_max=pool_max,
            budget=budget,
            idle_in_transaction_seconds=idle,
            statement_timeout_seconds=statement_timeout,
            client_check_seconds=client_check,
            plan_cache_mode=plan_cache_mode,
            role=service_role(service) if service else None,
            acquire_timeout_seconds=env_float(env, setting("QUAYUTEC_DB_ACQUIRE_TIMEOUT_SECONDS"), minimum=0.1),
            command_timeout_seconds=command_timeout,
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
    # The settings that name ``listen`` and ``health_listen``, for an error that says what to change.
    listen_env: str = "the listen address"
    health_listen_env: str = "the health listen address"

    @classmethod
    def from_env(cls, spec: ServiceSpec, env: Mapping[str, str] | None = None) -> ServerConfig:
        env = os.environ if env is None else env
        return cls(
            listen=env_str(env, setting(spec.listen_env)),
            grace_seconds=env_float(env, setting(f"{spec.prefix}GRACE_SECONDS")),
            mtls=MtlsConfig.from_env(env),
            health_listen=env_str(env, setting(spec.health_listen_env)) or None,
            connections=ConnectionLimits.from_env(env),
            listen_env=spec.listen_env,
            health_listen_env=spec.health_listen_env,
        )


def service_addr(spec: ServiceSpec, env: Mapping[str, str] | None = None) -> str:
    """The address other services dial to reach ``spec``."""
    env = os.environ if env is None else env
    return env_str(env, setting(spec.addr_env))
