"""Configuration shared by every service: environment readers and the service table.

Each service reads its own settings through a frozen dataclass with a ``from_env()``
under one prefix (``QUAYUTEC_<SERVICE>_``); nothing reads the environment at import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

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


def env_str(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, "").strip()
    return value or default


def env_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env_str(env, name, "").lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {raw!r}")


def env_int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 0) -> int:
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


def env_float(env: Mapping[str, str], name: str, default: float, *, minimum: float = 0.0) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from exc
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class DatabaseConfig:
    """``DATABASE_URL`` when set; otherwise an embedded PostgreSQL under ``data_dir``."""

    url: str | None
    data_dir: Path
    pool_min: int = 1
    pool_max: int = 10

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, prefix: str = "QUAYUTEC_") -> DatabaseConfig:
        env = os.environ if env is None else env
        url = env.get(DATABASE_URL_ENV, "").strip() or None
        data_dir = Path(env_str(env, DATA_DIR_ENV, DEFAULT_DATA_DIR)).absolute()
        pool_min = env_int(env, f"{prefix}DB_POOL_MIN", 1, minimum=0)
        pool_max = env_int(env, f"{prefix}DB_POOL_MAX", 10, minimum=1)
        if pool_min > pool_max:
            raise ConfigError(f"{prefix}DB_POOL_MIN ({pool_min}) exceeds {prefix}DB_POOL_MAX ({pool_max})")
        return cls(url=url, data_dir=data_dir, pool_min=pool_min, pool_max=pool_max)


@dataclass(frozen=True)
class ServerConfig:
    """Where one service listens, how long it drains on shutdown, where its certificates come from
    (``None``: from the environment when the server is made) and, when set, a second plaintext
    port that serves only health checks (for probes that cannot present a client certificate)."""

    listen: str
    grace_seconds: float
    mtls: MtlsConfig | None = None
    health_listen: str | None = None

    @classmethod
    def from_env(cls, spec: ServiceSpec, env: Mapping[str, str] | None = None) -> ServerConfig:
        from quayutec.tls import MtlsConfig

        env = os.environ if env is None else env
        return cls(
            listen=env_str(env, spec.listen_env, spec.default_listen),
            grace_seconds=env_float(env, f"{spec.prefix}GRACE_SECONDS", 10.0),
            mtls=MtlsConfig.from_env(env),
            health_listen=env_str(env, spec.health_listen_env, "") or None,
        )


def service_addr(spec: ServiceSpec, env: Mapping[str, str] | None = None) -> str:
    """The address other services dial to reach ``spec``."""
    env = os.environ if env is None else env
    return env_str(env, spec.addr_env, spec.default_addr)
