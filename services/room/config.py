"""Settings of the Room service, read once from the environment (prefix ``QUAYUTEC_ROOM_``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from quayutec.config import ROOM, DatabaseConfig, ServerConfig, env_bool, env_float, env_int
from quayutec.crypto import MultiFernet, load_fernet
from quayutec.egress import EgressPolicy
from quayutec.settings import setting


@dataclass(frozen=True)
class RoomConfig:
    """Where Room listens, its database, and the cipher of provider keys (never printed)."""

    server: ServerConfig
    database: DatabaseConfig
    cipher: MultiFernet = field(repr=False, compare=False)
    migrate_on_start: bool = True
    # Delivered wakes are kept this long, then deleted by a loop every ``outbox_cleanup_interval_seconds``.
    delivered_wakes_keep_seconds: int = 604_800
    outbox_cleanup_interval_seconds: float = 60.0
    # How long room events are kept for watchers to resume from (hours).
    event_retention_hours: float = 168.0
    # How often this replica removes events older than that (seconds).
    event_cleanup_seconds: float = 300.0
    # The Runtime's egress allow-list (QUAYUTEC_RUNTIME_EGRESS_ALLOW): agent base URLs are checked
    # against the same rules at registration.
    egress: EgressPolicy = field(default_factory=EgressPolicy)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RoomConfig:
        env = os.environ if env is None else env
        prefix = ROOM.prefix
        database = DatabaseConfig.from_env(env, prefix=prefix)
        return cls(
            server=ServerConfig.from_env(ROOM, env),
            database=database,
            cipher=load_fernet(env, database.data_dir),
            migrate_on_start=env_bool(env, setting(f"{prefix}MIGRATE_ON_START")),
            delivered_wakes_keep_seconds=env_int(env, setting(f"{prefix}DELIVERED_WAKES_KEEP_SECONDS"), minimum=0),
            outbox_cleanup_interval_seconds=env_float(
                env, setting(f"{prefix}OUTBOX_CLEANUP_INTERVAL_SECONDS"), minimum=0.0
            ),
            event_retention_hours=env_float(env, setting(f"{prefix}EVENT_RETENTION_HOURS"), minimum=0.01),
            event_cleanup_seconds=env_float(env, setting(f"{prefix}EVENT_CLEANUP_SECONDS"), minimum=1.0),
            egress=EgressPolicy.from_env(env),
        )
