"""Provider keys at rest: Fernet encryption under ``QUAYUTEC_ENCRYPTION_KEY`` or a local key file.

The variable may hold several comma-separated keys: the first encrypts, all decrypt (key rotation).
Without it (embedded/dev mode) every local service shares ``<data_dir>/encryption.key``, made once
with 0600 permissions.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from quayutec.config import DATABASE_URL_ENV, ENCRYPTION_KEY_ENV, ConfigError

__all__ = ["KEY_FILE_NAME", "Fernet", "InvalidToken", "MultiFernet", "load_fernet"]

_log = logging.getLogger("quayutec.crypto")

KEY_FILE_NAME = "encryption.key"


def load_fernet(
    env: Mapping[str, str], data_dir: Path, *, variable: str = ENCRYPTION_KEY_ENV, file_name: str = KEY_FILE_NAME
) -> MultiFernet:
    """The cipher for provider keys (or, with ``variable`` and ``file_name``, another service's own
    secrets: the Gateway's sign-in providers); raises ConfigError naming the variable or file to fix."""
    raw = env.get(variable, "").strip()
    if raw:
        keys = [part.strip() for part in raw.split(",") if part.strip()]
        return MultiFernet([_parse_key(key, f"{variable} (key {i + 1})") for i, key in enumerate(keys)])
    if env.get(DATABASE_URL_ENV, "").strip():
        _log.warning(
            "%s is not set: using the local key file in %s; replicas that do not share it cannot read each "
            "other's secrets",
            variable,
            data_dir,
        )
    return MultiFernet([_parse_key(_read_or_create_key_file(data_dir / file_name), str(data_dir / file_name))])


def _parse_key(key: str, where: str) -> Fernet:
    try:
        return Fernet(key.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise ConfigError(
            f"{where} is not a Fernet key (32 url-safe base64-encoded bytes); make one with "
            "python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'"
        ) from exc


def _read_or_create_key_file(path: Path) -> str:
    """The key in ``path``; the first caller writes it atomically so concurrent starts agree."""
    try:
        return _read_key_file(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, Fernet.generate_key() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process won the race; then its key is the key
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return _read_key_file(path)


def _read_key_file(path: Path) -> str:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{path} is readable by other users; run chmod 600 {path} or set {ENCRYPTION_KEY_ENV}")
    return path.read_text(encoding="ascii").strip()
