"""The console's settings: the dev session secret, refusals named, TLS to the Gateway."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.fernet import InvalidToken

from quayutec.config import ConfigError
from services.console.app import session_box
from services.console.config import SECRET_FILE, ConsoleConfig

REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize(
    "given",
    [
        "localhost:16686",  # no scheme: a browser would read it as a path
        "ftp://jaeger.example:16686",
        "javascript:alert(1)",
        "http://",
        "http:///trace",
        "https://jaeger.example/?a=b",
        "http://jaeger.example:port",
    ],
)
def test_a_jaeger_url_that_is_not_an_http_address_is_refused(tmp_path: Path, given: str) -> None:
    with pytest.raises(ConfigError, match="QUAYUTEC_CONSOLE_JAEGER_URL") as refused:
        ConsoleConfig.from_env({"QUAYUTEC_DATA_DIR": str(tmp_path), "QUAYUTEC_CONSOLE_JAEGER_URL": given})
    assert repr(given) in str(refused.value)


def test_the_jaeger_url_is_kept_without_its_trailing_slash(tmp_path: Path) -> None:
    def jaeger_url(value: str) -> str:
        return ConsoleConfig.from_env(
            {"QUAYUTEC_DATA_DIR": str(tmp_path), "QUAYUTEC_CONSOLE_JAEGER_URL": value}
        ).jaeger_url

    assert jaeger_url("") == ""
    assert jaeger_url("http://127.0.0.1:16686/") == "http://127.0.0.1:16686"
    assert jaeger_url("https://ops.example/jaeger") == "https://ops.example/jaeger"


def test_the_console_does_not_start_with_a_wrong_jaeger_url(tmp_path: Path) -> None:
    """The console's process itself: it exits at once, naming the setting and what was given."""
    done = subprocess.run(
        [sys.executable, "-m", "services.console"],
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "QUAYUTEC_DATA_DIR": str(tmp_path),
            "QUAYUTEC_CONSOLE_LISTEN": "127.0.0.1:0",
            "QUAYUTEC_CONSOLE_JAEGER_URL": "jaeger:16686",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "QUAYUTEC_CONSOLE_JAEGER_URL must be the Jaeger UI's http(s) address" in done.stdout
    assert "got 'jaeger:16686'" in done.stdout
