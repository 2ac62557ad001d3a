"""Settings of the Claims service, read once from the environment (prefix ``QUAYUTEC_CLAIMS_``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from quayutec.config import CLAIMS, DatabaseConfig, ServerConfig, env_bool, env_float, env_int
from quayutec.settings import setting

# Measured by bench/claims.py at concurrency 64: one batch in flight (claims arriving meanwhile join
# the next one) doubles gRPC throughput over one statement per claim.
DEFAULT_BATCH_MAX = 256
DEFAULT_BATCH_IN_FLIGHT = 1
DEFAULT_ACQUIRE_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class ClaimsConfig:
    """Where Claims listens, its database, and how it batches concurrent claims."""

    server: ServerConfig
    database: DatabaseConfig
    migrate_on_start: bool = True
    # Most claims combined into one INSERT; 1 sends one statement per claim.
    batch_max: int = DEFAULT_BATCH_MAX
    # Most batches sent at once; further claims wait and join the next batch.
    batch_in_flight: int = DEFAULT_BATCH_IN_FLIGHT
    # Longest wait for a pooled connection before answering UNAVAILABLE.
    acquire_timeout_seconds: float = DEFAULT_ACQUIRE_TIMEOUT_SECONDS

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClaimsConfig:
        env = os.environ if env is None else env
        prefix = CLAIMS.prefix
        return cls(
            server=ServerConfig.from_env(CLAIMS, env),
            database=DatabaseConfig.from_env(env, prefix=prefix),
            migrate_on_start=env_bool(env, setting(f"{prefix}MIGRATE_ON_START")),
            batch_max=env_int(env, setting(f"{prefix}BATCH_MAX"), minimum=1),
            batch_in_flight=env_int(env, setting(f"{prefix}BATCH_IN_FLIGHT"), minimum=1),
            acquire_timeout_seconds=env_float(env, setting(f"{prefix}ACQUIRE_TIMEOUT_SECONDS"), minimum=0.001),
        )
