"""Settings of the Gateway, read once from the environment (prefix ``QUAYUTEC_GATEWAY_``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from quayutec.config import (
    GATEWAY,
    ROOM,
    RUNTIME,
    ConfigError,
    DatabaseConfig,
    ServerConfig,
    env_bool,
    env_float,
    env_int,
    env_str,
    service_addr,
)
from quayutec.crypto import Fernet, MultiFernet, load_fernet
from quayutec.egress import EgressPolicy
from quayutec.settings import setting
from quayutec.throttle import ThrottleConfig


@dataclass(frozen=True)
class DeliveryConfig:
    """How the wake delivery loop leases, delivers and backs off."""

    enabled: bool = True
    # Most wakes leased by one LeaseWakes call.
    batch_size: int = 100
    lease_seconds: int = 30
    # Sleep between polls that found less than a full batch (a committed wake's notification ends it early).
    poll_interval_seconds: float = 0.2
    # LISTEN for the Room's "new wakes" notifications (same PostgreSQL) to deliver without waiting a poll.
    wake_notify: bool = True
    # Retry delay of a failed delivery: min(ceiling, base * 2**(attempts-1)), plus jitter.
    backoff_base_seconds: float = 0.5
    backoff_ceiling_seconds: float = 30.0
    # Most StartRun calls in flight at once per replica.
    concurrency: int = 64
    # Deadline of one StartRun call; must be shorter than the lease.
    start_run_timeout_seconds: float = 10.0
    # On stop, how long in-flight deliveries may finish before they are cancelled (their leases expire).
    stop_grace_seconds: float = 5.0
    # How often the loop asks the Room to expire waitpoints past their expiry (each gets a DECISION wake).
    expire_interval_seconds: float = 5.0
    # Runs with no progress recorded this long (RUNNING rows untouched, PARKED rows whose waitpoint was
    # decided or expired but which never continued) are ended as abandoned; it must exceed the
    # Runtime's QUAYUTEC_RUNTIME_RUN_SECONDS (300 by default) with room to spare.
    abandon_after_seconds: int = 600
    # A wake this old, delivered at least once and still pending with no ledger row for its run, gets
    # a NOT_STARTED row (housekeeping, every expire interval): no claim stays out of the ledger.
    not_started_after_seconds: int = 60

    def __post_init__(self) -> None:
        if self.start_run_timeout_seconds >= self.lease_seconds:
            raise ConfigError(
                f"{GATEWAY.prefix}START_RUN_TIMEOUT_SECONDS ({self.start_run_timeout_seconds}) must be shorter "
                f"than {GATEWAY.prefix}LEASE_SECONDS ({self.lease_seconds})"
            )
        if self.backoff_base_seconds > self.backoff_ceiling_seconds:
            raise ConfigError(f"{GATEWAY.prefix}BACKOFF_BASE_SECONDS exceeds {GATEWAY.prefix}BACKOFF_CEILING_SECONDS")

    def retry_delay_seconds(self, attempts: int) -> float:
        """The backoff before the next delivery of a wake that failed ``attempts`` times (no jitter)."""
        exponent = min(max(attempts, 1) - 1, 62)
        return min(self.backoff_ceiling_seconds, self.backoff_base_seconds * 2.0**exponent)


@dataclass(frozen=True)
class RateLimitConfig:
    """Per-company token bucket on posting RPCs, in memory per replica; rate 0 disables it."""

    rate_per_second: float = 20.0
    burst: int = 40
    # Most companies tracked at once; idle buckets are evicted first.
    max_companies: int = 10_000


@dataclass(frozen=True)
class WatchConfig:
    """WatchRoom streams: per-stream buffer, heartbeats, membership checks and how many at once."""

    # Events a stream holds for its caller; a live stream that overflows it ends RESOURCE_EXHAUSTED.
    buffer_events: int = 256
    # An idle stream re-checks membership and sends a heartbeat this often.
    heartbeat_seconds: float = 15.0
    # While the LISTEN connection is down, streams re-read their room this often instead.
    check_seconds: float = 0.5
    # A busy room's new events are read this long after their notification (what is posted meanwhile
    # goes out in the same response); a quiet room's at once.
    coalesce_ms: float = 100.0
    # ... only while at least this many streams follow the room: with fewer, a batch saves little.
    coalesce_min_streams: int = 16
    # Most WatchRoom and WatchRooms streams this replica serves at once (each also counts against the
    # server's concurrent RPC limit); beyond it they answer RESOURCE_EXHAUSTED.
    max_streams: int = 900
    # Most rooms one WatchRooms stream follows (a company in more rooms is answered RESOURCE_EXHAUSTED).
    max_rooms: int = 200


@dataclass(frozen=True)
class StreamsConfig:
    """Every server stream of an API key (WatchRoom, WatchRooms, A2A streaming): the company's fair share
    of a replica, and how soon a revoked or expired key's open streams end."""

    # Most open streams of one company on one replica, well below WatchConfig.max_streams.
    max_per_company: int = 100
    # LISTEN for key revocations (quayutec_keys_revoked) and end the key's streams at once.
    revocation_notify: bool = True
    # The backstop: this often, the keys of open streams are looked up again (a missed notification).
    recheck_seconds: float = 5.0

    def __post_init__(self) -> None:
        if self.max_per_company < 1 or self.recheck_seconds <= 0:
            raise ConfigError("the per-company stream limit must be at least 1 and the re-check interval positive")


@dataclass(frozen=True)
class KeyCacheConfig:
    """How many API keys, and how long each, authentication keeps in memory (0 keys, the default: no cache)."""

    size: int = 0
    seconds: float = 30.0


@dataclass(frozen=True)
class GatewayConfig:
    """Where the Gateway listens, whom it calls, its key database, TLS, rate limits and delivery."""

    server: ServerConfig
    database: DatabaseConfig
    room_addr: str
    runtime_addr: str
    migrate_on_start: bool = True
    tls_cert_path: Path | None = None
    tls_key_path: Path | None = None
    # The console's port (mutual TLS with the services' CA; None: not served): see services/gateway/auth.py.
    console_listen: str | None = None
    # Deadline of each call to the Room made while serving a request.
    room_timeout_seconds: float = 10.0
    # Ceiling of gRPC's reconnect backoff to Room and Runtime, so a backend that returns is used soon.
    reconnect_backoff_max_ms: int = 5000
    rate_limit: RateLimitConfig = RateLimitConfig()
    delivery: DeliveryConfig = DeliveryConfig()
    watch: WatchConfig = WatchConfig()
    streams: StreamsConfig = StreamsConfig()
    # Key lookups kept in memory while revocations are listened for (services/gateway/keycache.py).
    key_cache: KeyCacheConfig = KeyCacheConfig()
    # Failed authentications per source address and per key id.
    auth_throttle: ThrottleConfig = field(default_factory=ThrottleConfig)
    # Most live session keys (CreateSessionKey) of one company key.
    max_session_keys: int = 1000
    max_api_keys: int = 100
    # The address A2A agent cards name ("" : the address the server is bound to).
    a2a_url: str = ""
    # Longest wait of a blocking A2A SendMessage.
    a2a_block_seconds: float = 30.0
    # The cipher of sign-in providers' client secrets: Fernet, as agents' provider keys in the Room
    # (quayutec.crypto), under a key of the Gateway's own, so the public door never holds the Room's.
    cipher: MultiFernet = field(default_factory=lambda: MultiFernet([Fernet(Fernet.generate_key())]), repr=False)
    # Where calls to companies' OpenID providers may go (the Runtime's allow-list, QUAYUTEC_RUNTIME_EGRESS_ALLOW).
    egress: EgressPolicy = field(default_factory=EgressPolicy)

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert_path is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GatewayConfig:
        env = os.environ if env is None else env
        p = GATEWAY.prefix
        cert = env_str(env, setting(f"{p}TLS_CERT"))
        key = env_str(env, setting(f"{p}TLS_KEY"))
        if bool(cert) != bool(key):
            raise ConfigError(f"set both {p}TLS_CERT and {p}TLS_KEY (file paths) for TLS, or neither")
        delivery = DeliveryConfig(
            enabled=env_bool(env, setting(f"{p}DELIVERY_ENABLED")),
            batch_size=env_int(env, setting(f"{p}DELIVERY_BATCH_SIZE"), minimum=1),
            lease_seconds=env_int(env, setting(f"{p}LEASE_SECONDS"), minimum=1),
            poll_interval_seconds=env_float(env, setting(f"{p}POLL_INTERVAL_SECONDS"), minimum=0.001),
            wake_notify=env_bool(env, setting(f"{p}WAKE_NOTIFY")),
            backoff_base_seconds=env_float(env, setting(f"{p}BACKOFF_BASE_SECONDS"), minimum=0.001),
            backoff_ceiling_seconds=env_float(env, setting(f"{p}BACKOFF_CEILING_SECONDS"), minimum=0.001),
            concurrency=env_int(env, setting(f"{p}DELIVERY_CONCURRENCY"), minimum=1),
            start_run_timeout_seconds=env_float(env, setting(f"{p}START_RUN_TIMEOUT_SECONDS"), minimum=0.001),
            stop_grace_seconds=env_float(env, setting(f"{p}DELIVERY_STOP_GRACE_SECONDS")),
            expire_interval_seconds=env_float(env, setting(f"{p}EXPIRE_INTERVAL_SECONDS"), minimum=0.001),
            abandon_after_seconds=env_int(env, setting(f"{p}ABANDON_AFTER_SECONDS"), minimum=60),
            not_started_after_seconds=env_int(env, setting(f"{p}NOT_STARTED_AFTER_SECONDS"), minimum=1),
        )
        if delivery.batch_size > 500:
            raise ConfigError(f"{p}DELIVERY_BATCH_SIZE must be at most 500, got {delivery.batch_size}")
        if delivery.lease_seconds > 3600:
            raise ConfigError(f"{p}LEASE_SECONDS must be at most 3600, got {delivery.lease_seconds}")
        rate_limit = RateLimitConfig(
            rate_per_second=env_float(env, setting(f"{p}POST_RATE")),
            burst=env_int(env, setting(f"{p}POST_BURST"), minimum=1),
            max_companies=env_int(env, setting(f"{p}RATE_LIMIT_MAX_COMPANIES"), minimum=1),
        )
        watch = WatchConfig(
            buffer_events=env_int(env, setting(f"{p}WATCH_BUFFER_EVENTS"), minimum=1),
            heartbeat_seconds=env_float(env, setting(f"{p}WATCH_HEARTBEAT_SECONDS"), minimum=0.01),
            check_seconds=env_float(env, setting(f"{p}WATCH_CHECK_SECONDS"), minimum=0.01),
            max_streams=env_int(env, setting(f"{p}WATCH_MAX_STREAMS"), minimum=1),
            coalesce_ms=env_float(env, setting(f"{p}WATCH_COALESCE_MS")),
            coalesce_min_streams=env_int(env, setting(f"{p}WATCH_COALESCE_MIN_STREAMS"), minimum=1),
            max_rooms=env_int(env, setting(f"{p}WATCH_MAX_ROOMS"), minimum=1),
        )
        streams = StreamsConfig(
            max_per_company=env_int(env, setting(f"{p}MAX_STREAMS_PER_COMPANY"), minimum=1),
            revocation_notify=env_bool(env, setting(f"{p}KEY_NOTIFY")),
            recheck_seconds=env_float(env, setting(f"{p}KEY_RECHECK_SECONDS"), minimum=0.05),
        )
        key_cache = KeyCacheConfig(
            size=env_int(env, setting(f"{p}KEY_CACHE_SIZE")),
            seconds=env_float(env, setting(f"{p}KEY_CACHE_SECONDS"), minimum=0.001),
        )
        auth_throttle = ThrottleConfig(
            rate_per_second=env_float(env, setting(f"{p}AUTH_FAILURE_RATE")),
            burst=env_int(env, setting(f"{p}AUTH_FAILURE_BURST"), minimum=1),
            max_subjects=env_int(env, setting(f"{p}AUTH_TRACKED"), minimum=1),
        )
        database = DatabaseConfig.from_env(env, prefix=p)
        return cls(
            server=ServerConfig.from_env(GATEWAY, env),
            database=database,
            room_addr=service_addr(ROOM, env),
            runtime_addr=service_addr(RUNTIME, env),
            migrate_on_start=env_bool(env, setting(f"{p}MIGRATE_ON_START")),
            tls_cert_path=Path(cert) if cert else None,
            tls_key_path=Path(key) if key else None,
            console_listen=env_str(env, setting(f"{p}CONSOLE_LISTEN")) or None,
            room_timeout_seconds=env_float(env, setting(f"{p}ROOM_TIMEOUT_SECONDS"), minimum=0.001),
            reconnect_backoff_max_ms=env_int(env, setting(f"{p}RECONNECT_BACKOFF_MAX_MS"), minimum=100),
            rate_limit=rate_limit,
            delivery=delivery,
            watch=watch,
            streams=streams,
            key_cache=key_cache,
            auth_throttle=auth_throttle,
            max_session_keys=env_int(env, setting(f"{p}MAX_SESSION_KEYS"), minimum=1),
            max_api_keys=env_int(env, setting(f"{p}MAX_API_KEYS"), minimum=1),
            a2a_url=env_str(env, setting(f"{p}A2A_URL")).strip(),
            a2a_block_seconds=env_float(env, setting(f"{p}A2A_BLOCK_SECONDS"), minimum=0.0),
            cipher=load_fernet(
                env, database.data_dir, variable=setting(f"{p}ENCRYPTION_KEY").name, file_name="gateway-encryption.key"
            ),
            egress=EgressPolicy.from_env(env),
        )
