"""Environment readers and the service table: what every configuration module builds on.

It imports nothing of quayutec, so ``quayutec.settings`` (the declarations), ``quayutec.tls`` and
``quayutec.config`` all build on it without an import circle; ``quayutec.config`` re-exports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol


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
