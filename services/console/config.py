"""Settings of the console, read once from the environment (prefix ``QUAYUTEC_CONSOLE_``)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from quayutec.config import DATA_DIR_ENV, GATEWAY, ConfigError, env_bool, env_float, env_int, env_str, service_addr
from quayutec.jaeger import ui_base_url
from quayutec.settings import setting
from quayutec.throttle import ThrottleConfig
from quayutec.tls import CONSOLE, Identity, MtlsConfig, load_identity

SECRET_FILE = "console-session.key"
MIN_SECRET_CHARS = 32


@dataclass(frozen=True)
class ConsoleConfig:
    listen: str
    gateway_addr: str
    session_secret: str
    secure_cookie: bool
    session_seconds: int
    jaeger_url: str
    # TLS to the Gateway: None for plaintext; otherwise the CA's PEM (b"" for the system's roots).
    gateway_ca: bytes | None = None
    gateway_tls_name: str = ""
    # The Gateway's console port and the console's certificate for it ("": the public port above).
    gateway_console_addr: str = ""
    identity: Identity | None = None
    # Open live-update streams of one sign-in on this replica.
    max_streams_per_session: int = 6
    # Failed sign-ins per browser address and per key id.
    signin_throttle: ThrottleConfig = field(default_factory=lambda: ThrottleConfig(rate_per_second=0.1, burst=10))
    # The origin browsers reach the console at ("": the request's own host); every POST's Origin must match.
    origin: str = ""

    @property
    def host_port(self) -> tuple[str, int]:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"QUAYUTEC_CONSOLE_LISTEN must be host:port, got {self.listen!r}")
        return host.strip("[]") or "127.0.0.1", int(port)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ConsoleConfig:
        env = os.environ if env is None else env
        secret = env_str(env, setting("QUAYUTEC_CONSOLE_SESSION_SECRET"))
        if not secret:
            secret = dev_secret(Path(env_str(env, setting(DATA_DIR_ENV))).absolute())
        if len(secret) < MIN_SECRET_CHARS:
            raise ConfigError(f"QUAYUTEC_CONSOLE_SESSION_SECRET must be at least {MIN_SECRET_CHARS} characters")
        gateway_ca: bytes | None = None
        if env_bool(env, setting("QUAYUTEC_CONSOLE_GATEWAY_TLS")):
            ca_path = env_str(env, setting("QUAYUTEC_CONSOLE_GATEWAY_CA"))
            try:
                gateway_ca = Path(ca_path).read_bytes() if ca_path else b""
            except OSError as exc:
                raise ConfigError(f"cannot read QUAYUTEC_CONSOLE_GATEWAY_CA ({ca_path}): {exc.strerror}") from exc
        console_addr = env_str(env, setting("QUAYUTEC_CONSOLE_GATEWAY_CONSOLE_ADDR"))
        identity = load_identity(CONSOLE, MtlsConfig.from_env(env)) if console_addr else None
        hours = env_float(env, setting("QUAYUTEC_CONSOLE_SESSION_HOURS"), minimum=0.01)
        origin = env_str(env, setting("QUAYUTEC_CONSOLE_ORIGIN")).strip().rstrip("/")
        if origin and (urlsplit(origin).scheme not in ("http", "https") or not urlsplit(origin).netloc):
            raise ConfigError(f"QUAYUTEC_CONSOLE_ORIGIN must read https://host[:port], got {origin!r}")
        return cls(
            listen=env_str(env, setting("QUAYUTEC_CONSOLE_LISTEN")),
            gateway_addr=service_addr(GATEWAY, env),
            session_secret=secret,
            secure_cookie=env_bool(env, setting("QUAYUTEC_CONSOLE_SECURE_COOKIE")),
            session_seconds=int(hours * 3600),
            jaeger_url=ui_base_url(env),
            gateway_ca=gateway_ca,
            gateway_tls_name=env_str(env, setting("QUAYUTEC_CONSOLE_GATEWAY_TLS_NAME")),
            gateway_console_addr=console_addr,
            identity=identity,
            max_streams_per_session=env_int(env, setting("QUAYUTEC_CONSOLE_MAX_STREAMS_PER_SESSION"), minimum=1),
            signin_throttle=ThrottleConfig(
                rate_per_second=env_float(env, setting("QUAYUTEC_CONSOLE_SIGNIN_FAILURE_RATE")),
                burst=env_int(env, setting("QUAYUTEC_CONSOLE_SIGNIN_FAILURE_BURST"), minimum=1),
                max_subjects=env_int(env, setting("QUAYUTEC_CONSOLE_SIGNIN_TRACKED"), minimum=1),
            ),
            origin=origin,
        )


def dev_secret(data_dir: Path) -> str:
    """The development session secret: a random one kept in the data folder (mode 0600), made once."""
    path = data_dir / SECRET_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    data_dir.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(48)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value
