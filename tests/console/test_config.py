"""The console's settings: the dev session secret, refusals named, TLS to the Gateway."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography.fernet import InvalidToken

from quayutec.config import ConfigError
from services.console.app import session_box
from services.console.config import SECRET_FILE, ConsoleConfig


def test_defaults_and_the_dev_secret(tmp_path: Path) -> None:
    config = ConsoleConfig.from_env({"QUAYUTEC_DATA_DIR": str(tmp_path)})
    assert config.listen == "127.0.0.1:8080" and config.host_port == ("127.0.0.1", 8080)
    assert config.secure_cookie is True and config.gateway_ca is None
    assert config.session_seconds == 12 * 3600
    kept = tmp_path / SECRET_FILE
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600
    assert kept.read_text().strip() == config.session_secret and len(config.session_secret) >= 32
    # The same secret next time: sessions survive a restart.
    assert ConsoleConfig.from_env({"QUAYUTEC_DATA_DIR": str(tmp_path)}).session_secret == config.session_secret


def test_refusals_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="QUAYUTEC_CONSOLE_SESSION_SECRET must be at least 32"):
        ConsoleConfig.from_env({"QUAYUTEC_CONSOLE_SESSION_SECRET": "short"})
    with pytest.raises(ConfigError, match="QUAYUTEC_CONSOLE_GATEWAY_CA"):
        ConsoleConfig.from_env(
            {
                "QUAYUTEC_DATA_DIR": str(tmp_path),
                "QUAYUTEC_CONSOLE_GATEWAY_TLS": "true",
                "QUAYUTEC_CONSOLE_GATEWAY_CA": str(tmp_path / "missing.pem"),
            }
        )
    with pytest.raises(ConfigError, match="QUAYUTEC_CONSOLE_LISTEN must be host:port"):
        _ = ConsoleConfig.from_env({"QUAYUTEC_DATA_DIR": str(tmp_path), "QUAYUTEC_CONSOLE_LISTEN": "nowhere"}).host_port


def test_tls_to_the_gateway(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    env = {"QUAYUTEC_DATA_DIR": str(tmp_path), "QUAYUTEC_CONSOLE_GATEWAY_TLS": "true"}
    assert ConsoleConfig.from_env(env).gateway_ca == b""  # the system's roots
    config = ConsoleConfig.from_env(
        {**env, "QUAYUTEC_CONSOLE_GATEWAY_CA": str(ca), "QUAYUTEC_CONSOLE_GATEWAY_TLS_NAME": "rooms.example"}
    )
    assert config.gateway_ca == ca.read_bytes() and config.gateway_tls_name == "rooms.example"


def test_the_key_is_sealed_with_the_secret() -> None:
    sealed = session_box("a" * 40).encrypt(b"qyk_secret")
    assert b"qyk_secret" not in sealed
    assert session_box("a" * 40).decrypt(sealed) == b"qyk_secret"
    with pytest.raises(InvalidToken):
        session_box("b" * 40).decrypt(sealed)
