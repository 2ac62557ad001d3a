"""Every setting the project reads, declared once: name, default, meaning and who reads it.

The services' ``Config.from_env`` readers take their names and defaults from here
(``setting(name)``); ``quayutec config`` prints them with the values in effect, ``python -m
services.X --help`` lists a service's own, and ``scripts/gen_settings_table.py`` writes the settings
table of docs/settings.md from them (a test fails when it is stale, and another when the code reads an
environment variable that is not declared here).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from quayutec.envread import SERVICES, ServiceSpec

Value = str | int | float | bool | None

ALL = ("gateway", "room", "claims", "runtime")
WITH_DATABASE = ("gateway", "room", "claims")  # the same as quayutec.config.WITH_DATABASE


@dataclass(frozen=True)
class Setting:
    """One environment variable. ``default`` is the typed value the reader uses when the variable
    is unset or empty; ``shown`` is how the table shows it when that is not the plain value."""

    name: str
    default: Value
    meaning: str
    services: tuple[str, ...]
    shown: str = ""
    secret: bool = False

    @property
    def default_text(self) -> str:
        if self.shown:
            return self.shown
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        if self.default is None or self.default == "":
            return "unset"
        return str(self.default)


def _g(name: str, default: Value, meaning: str, services: Iterable[str], **kw: str | bool) -> Setting:
    return Setting(name, default, meaning, tuple(services), **kw)  # type: ignore[arg-type]


def _per_service(spec: ServiceSpec) -> list[Setting]:
    """The settings every service has under its own prefix."""
    p, name = spec.prefix, spec.name
    found = [
        _g(f"{p}LISTEN", spec.default_listen, f"where {name} listens (host:port)", [name]),
        _g(
            f"{p}ADDR",
            spec.default_addr,
            f"how the others dial {name} (host:port)",
            {
                "gateway": ["cli", "console"],
                "room": ["gateway", "runtime", "cli"],
                "claims": ["runtime"],
                "runtime": ["gateway"],
            }[name],
        ),
        _g(f"{p}GRACE_SECONDS", 10.0, f"drain time of {name} on SIGTERM", [name], shown="10"),
        _g(
            f"{p}HEALTH_LISTEN",
            "",
            f"a second, plaintext port of {name} serving only grpc.health.v1, for probes without a client certificate",
            [name],
        ),
    ]
    if name in WITH_DATABASE:
        found += [
            _g(
                f"{p}DATABASE_URL",
                "",
                f"the database URL of {name} alone (a login that is a member of the role quayutec_{name}); unset: "
                "DATABASE_URL. Migrations on start still use DATABASE_URL when it is set",
                [name],
                shown="(DATABASE_URL)",
                secret=True,
            ),
            _g(f"{p}MIGRATE_ON_START", True, f"{name} applies its own migrations at start-up", [name]),
            _g(f"{p}DB_POOL_MIN", 1, f"fewest open database connections of {name}", [name]),
            _g(
                f"{p}DB_POOL_MAX",
                10,
                f"most open database connections of one {name} replica (every database service reads it: "
                "the connection budget)",
                WITH_DATABASE,
            ),
            _g(
                f"{p}REPLICAS_MAX",
                1,
                f"most {name} replicas running at once (its HPA's maxReplicas); each database service checks at "
                "start that every service's replicas × DB_POOL_MAX, plus DB_CONNECTIONS_RESERVED, fit the "
                "server's max_connections, and refuses to start, naming the numbers, when they do not",
                WITH_DATABASE,
            ),
        ]
    return found


_DECLARED: list[Setting] = [
    _g(
        "DATABASE_URL",
        "",
        "PostgreSQL of Room, Claims, Gateway, migrations and the admin commands; unset: the embedded one",
        [*WITH_DATABASE, "cli"],
        shown="(embedded)",
        secret=True,
    ),
    _g(
        "QUAYUTEC_DATA_DIR",
        ".quayutec",
        "folder of the embedded PostgreSQL, the service logs of `quayutec up`, the dev encryption key file"
        " and the dev certificates (`pki/`)",
        [*WITH_DATABASE, "cli", "console"],
    ),
    _g(
        "QUAYUTEC_ENCRYPTION_KEY",
        "",
        "Fernet key(s), comma-separated, newest first, encrypting provider keys at rest",
        ["room"],
        shown="(dev: key file in the data dir)",
        secret=True,
    ),
    _g(
        "QUAYUTEC_MTLS_CA",
        "",
        "PEM file of the CA every service trusts; with MTLS_CERT and MTLS_KEY (all three or none)",
        [*ALL, "cli", "console"],
        shown="unset (dev PKI in <data dir>/pki/)",
    ),
    _g("QUAYUTEC_MTLS_CERT", "", "PEM certificate of this process, naming its identity", [*ALL, "cli", "console"]),
    _g("QUAYUTEC_MTLS_KEY", "", "PEM private key of MTLS_CERT", [*ALL, "cli", "console"], secret=True),
    _g(
        "QUAYUTEC_EVENT_LOOP",
        "uvloop",
        "the asyncio event loop a service runs on: `uvloop` (libuv; cut the CPU per wake by about a fifth in"
        " bench/wakes.py) or `asyncio` (the standard library's)",
        ALL,
    ),
    _g("QUAYUTEC_LOG_LEVEL", "INFO", "the services' log level: DEBUG, INFO, WARNING or ERROR", ALL),
    _g(
        "CI",
        "",
        "true (as CI systems set it): `quayutec demo` stops its stack as soon as the demo is done, as with "
        "--then-stop; unset: the stack stays up for the console until Ctrl-C",
        ["cli"],
        shown="unset",
    ),
    _g(
        "QUAYUTEC_DB_CONNECTIONS_RESERVED",
        10,
        "database connections kept out of the services' budget: migrations, the admin commands, an operator's psql",
        WITH_DATABASE,
    ),
    _g(
        "QUAYUTEC_GRPC_HANDSHAKE_TIMEOUT_SECONDS",
        10.0,
        "a connection to any gRPC port must finish its TLS and HTTP/2 handshake within this, or it is closed"
        " (gRPC's own default is 120)",
        ALL,
        shown="10",
    ),
    _g(
        "QUAYUTEC_GRPC_IDLE_SECONDS",
        300.0,
        "a gRPC connection with no call open for this long is closed (GOAWAY; clients reconnect when they next"
        " call); open streams keep it",
        ALL,
        shown="300",
    ),
    _g(
        "QUAYUTEC_GRPC_KEEPALIVE_SECONDS",
        60.0,
        "a gRPC server pings a connection quiet for this long, to find peers that are gone",
        ALL,
        shown="60",
    ),
    _g(
        "QUAYUTEC_GRPC_KEEPALIVE_TIMEOUT_SECONDS",
        20.0,
        "a ping not answered within this closes the connection and the calls on it",
        ALL,
        shown="20",
    ),
    _g(
        "QUAYUTEC_GRPC_MAX_CALLS",
        1024,
        "concurrent calls a gRPC server serves (authenticated, or mutual TLS); health checks and reflection"
        " never count against it; past it a call is answered RESOURCE_EXHAUSTED",
        ALL,
    ),
    _g(
        "QUAYUTEC_GRPC_MAX_STREAMS_PER_CONNECTION",
        1024,
        "concurrent streams one HTTP/2 connection may open (max_concurrent_streams); a client's further calls"
        " wait for one to end",
        ALL,
    ),
    _g(
        "QUAYUTEC_GRPC_OPEN_CALLS",
        64,
        "concurrent health checks and reflection streams (calls served without a key or certificate) a gRPC"
        " port serves; a budget of their own, apart from QUAYUTEC_GRPC_MAX_CALLS",
        ALL,
    ),
    _g(
        "QUAYUTEC_GRPC_OPEN_CALLS_PER_SOURCE",
        8,
        "of those, at most this many held open from one source address (an IPv6 /64)",
        ALL,
    ),
    _g(
        "QUAYUTEC_DB_IDLE_IN_TRANSACTION_SECONDS",
        10.0,
        "PostgreSQL ends a session of ours that leaves a transaction open and silent this long "
        "(idle_in_transaction_session_timeout), releasing its locks: a replica cut off from the database "
        "mid-transaction cannot hold a room's rows for long; 0 turns it off",
        [*WITH_DATABASE, "cli"],
        shown="10",
    ),
    _g(
        "QUAYUTEC_DB_STATEMENT_TIMEOUT_SECONDS",
        30.0,
        "PostgreSQL ends a statement of ours that runs, or waits on a lock, this long (statement_timeout), "
        "rolling it back: no statement goes on for a caller that gave up on it; at least 0.1 and at most "
        "QUAYUTEC_DB_COMMAND_TIMEOUT_SECONDS (refused at start otherwise)",
        [*WITH_DATABASE, "cli"],
        shown="30",
    ),
    _g(
        "QUAYUTEC_DB_CLIENT_CHECK_SECONDS",
        2.0,
        "how often a PostgreSQL backend running a statement of ours checks that our side of its connection "
        "is still open (client_connection_check_interval, PostgreSQL 14 or later), and stops, rolling back, "
        "when it is not; 0 turns it off, at most 60",
        [*WITH_DATABASE, "cli"],
        shown="2",
    ),
    _g(
        "QUAYUTEC_DB_PLAN_CACHE_MODE",
        "force_generic_plan",
        "PostgreSQL's plan_cache_mode for our sessions: force_generic_plan plans each prepared statement once "
        "per connection (the wake's one-statement writes and room read would otherwise be planned again at "
        "every call); auto or force_custom_plan to plan by each call's values",
        [*WITH_DATABASE, "cli"],
    ),
    _g(
        "QUAYUTEC_DB_ACQUIRE_TIMEOUT_SECONDS",
        5.0,
        "longest wait for a pooled database connection; past it the call answers UNAVAILABLE",
        [*WITH_DATABASE, "cli"],
        shown="5",
    ),
    _g(
        "QUAYUTEC_DB_COMMAND_TIMEOUT_SECONDS",
        30.0,
        "longest wait for one SQL statement; a statement past it fails UNAVAILABLE and its connection is "
        "closed at once (terminated), never given back to the pool",
        [*WITH_DATABASE, "cli"],
        shown="30",
    ),
    _g(
        "QUAYUTEC_DB_CONNECT_TIMEOUT_SECONDS",
        5.0,
        "longest wait to open one database connection (each host of a multi-host DATABASE_URL in turn)",
        [*WITH_DATABASE, "cli"],
        shown="5",
    ),
    _g(
        "QUAYUTEC_DB_TCP_TIMEOUT_SECONDS",
        10.0,
        "a database socket whose data goes unacknowledged this long is aborted (TCP_USER_TIMEOUT), and an idle "
        "one is probed by keepalives after half of it, on both sides of the socket: a silent network or a dead "
        "primary is noticed in seconds, not after minutes of TCP retransmissions",
        [*WITH_DATABASE, "cli"],
        shown="10",
    ),
    _g(
        "QUAYUTEC_DB_HEALTH_INTERVAL_SECONDS",
        2.0,
        "how often each database service checks it reaches its database (one `SELECT 1`, bounded by "
        "ACQUIRE_TIMEOUT_SECONDS); the health of its service (readiness) is NOT_SERVING while it cannot, SERVING "
        "again when it can; the process's own health (liveness, the empty name) stays SERVING",
        WITH_DATABASE,
        shown="2",
    ),
    _g("QUAYUTEC_DB_POOL_MIN", 1, "fewest open database connections of the admin commands", ["cli"]),
    _g("QUAYUTEC_DB_POOL_MAX", 10, "most open database connections of the admin commands", ["cli"]),
    _g("QUAYUTEC_API_KEY", "", "your company's API key, for the client commands", ["cli"], secret=True),
    _g("QUAYUTEC_PROVIDER_KEY", "", "the model provider key `agent register` sends", ["cli"], secret=True),
    _g(
        "QUAYUTEC_SIGNIN_CLIENT_SECRET",
        "",
        "the console's client secret at your OpenID provider, which `sign-in set` sends",
        ["cli"],
        secret=True,
    ),
    # Room
    _g(
        "QUAYUTEC_ROOM_DELIVERED_WAKES_KEEP_SECONDS",
        604_800,
        "how long a delivered wake stays in the outbox (for inspection) before the Room deletes it; the "
        "claim, not the outbox row, keeps a delivered wake from running twice",
        ["room"],
        shown="604800 (7 days)",
    ),
    _g(
        "QUAYUTEC_ROOM_OUTBOX_CLEANUP_INTERVAL_SECONDS",
        60.0,
        "how often the Room deletes delivered wakes older than DELIVERED_WAKES_KEEP_SECONDS (in batches of "
        "1,000; a full batch is followed at once by another); 0 turns the cleanup off",
        ["room"],
        shown="60",
    ),
    # Claims
    _g("QUAYUTEC_CLAIMS_BATCH_MAX", 256, "most claims combined into one INSERT (1: one statement each)", ["claims"]),
    _g("QUAYUTEC_CLAIMS_BATCH_IN_FLIGHT", 1, "most claim batches sent at once", ["claims"]),
    _g(
        "QUAYUTEC_CLAIMS_ACQUIRE_TIMEOUT_SECONDS",
        5.0,
        "longest wait for a pooled connection before a claim answers UNAVAILABLE",
        ["claims"],
        shown="5",
    ),
    # Runtime
    _g(
        "QUAYUTEC_RUNTIME_MAX_RUNS",
        2048,
        "runs executing at once; over it StartRun is RESOURCE_EXHAUSTED (nothing claimed). A run waiting on its "
        "model holds a coroutine and one provider socket, so the cap is sized by file descriptors (the Runtime "
        "raises its soft `ulimit -n` to the hard limit and refuses to start unless it covers this plus 256) and "
        "memory (see docs/operations.md); the provider connection pool holds as many connections",
        ["runtime"],
    ),
    _g("QUAYUTEC_RUNTIME_RUN_SECONDS", 300.0, "active time of one run", ["runtime"], shown="300"),
    _g(
        "QUAYUTEC_RUNTIME_MODEL_TIMEOUT_SECONDS",
        60.0,
        "timeout of one model request: of each phase and of the whole request (connect, headers and the whole "
        "body); past it the attempt is a `timeout` and the retry policy decides",
        ["runtime"],
        shown="60",
    ),
    _g(
        "QUAYUTEC_RUNTIME_MODEL_MAX_RESPONSE_BYTES",
        4 * 1024 * 1024,
        "the most of one model answer's body the Runtime reads, counted as it streams in (a declared longer "
        "length is refused unread); past it the attempt is a final `response_too_large`, never retried",
        ["runtime"],
        shown="4194304 (4 MiB)",
    ),
    _g(
        "QUAYUTEC_RUNTIME_BACKEND_TIMEOUT_SECONDS",
        10.0,
        "deadline of one try of a Runtime call to Claims or Room",
        ["runtime"],
        shown="10",
    ),
    _g(
        "QUAYUTEC_RUNTIME_ROOM_RETRY_SECONDS",
        30.0,
        "how long a Room call that is safe to repeat (reads, ledger rows, writes with a dedupe key) is retried on "
        "UNAVAILABLE / DEADLINE_EXCEEDED / ABORTED, within the run's active time",
        ["runtime"],
        shown="30",
    ),
    _g(
        "QUAYUTEC_RUNTIME_ANTHROPIC_BASE_URL",
        "https://api.anthropic.com",
        "our own Anthropic address (e.g. the stand-in); retried per the policy",
        ["runtime"],
    ),
    _g(
        "QUAYUTEC_RUNTIME_OPENAI_BASE_URL",
        "https://api.openai.com",
        "our own OpenAI address (e.g. the stand-in); retried per the policy",
        ["runtime"],
    ),
    _g("QUAYUTEC_RUNTIME_RECENT_MESSAGES", 20, "room messages a run reads before its model call", ["runtime"]),
    _g(
        "QUAYUTEC_RUNTIME_WAITPOINT_TTL_SECONDS",
        86_400,
        "how long held actions wait for their company's decision before they end undone",
        ["runtime"],
    ),
    _g(
        "QUAYUTEC_RUNTIME_EGRESS_ALLOW",
        "",
        "comma list of CIDRs and host names an agent owner's base_url may reach besides public https "
        "addresses (plain http only to these); Room checks it at registration, Runtime at each connection: "
        "set it on both; the Gateway's calls to companies' OpenID providers follow it too",
        ["room", "runtime", "gateway"],
    ),
    _g(
        "QUAYUTEC_RUNTIME_FAILPOINTS",
        "",
        "comma-separated step boundaries where a run pauses until the process gets SIGUSR1 (crash tests only)",
        ["runtime"],
    ),
    # Gateway
    _g(
        "QUAYUTEC_GATEWAY_TLS_CERT",
        "",
        "PEM certificate file; the Gateway serves TLS when it and TLS_KEY are set",
        ["gateway"],
    ),
    _g("QUAYUTEC_GATEWAY_TLS_KEY", "", "PEM private key file of TLS_CERT", ["gateway"]),
    _g(
        "QUAYUTEC_GATEWAY_CONSOLE_LISTEN",
        "",
        "a second port of the Gateway for the console (host:port): the same API over mutual TLS with the "
        "services' CA; a caller with the console's certificate may pass on its browser's address "
        "(x-quayutec-client-address), which the throttles then count. Unset: no such port",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_DELIVERY_ENABLED",
        True,
        "this Gateway delivers wakes to Runtime (false: API only)",
        ["gateway"],
    ),
    _g("QUAYUTEC_GATEWAY_DELIVERY_BATCH_SIZE", 100, "wakes leased per delivery round (at most 500)", ["gateway"]),
    _g(
        "QUAYUTEC_GATEWAY_LEASE_SECONDS",
        30,
        "wake delivery lease; an expired lease makes the wake due again (at most 3600)",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS",
        0.2,
        "the delivery loop's poll, the fallback for notifications",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_WAKE_NOTIFY",
        True,
        "LISTEN for the Room's new-wake notifications (same PostgreSQL) and deliver at once",
        ["gateway"],
    ),
    _g("QUAYUTEC_GATEWAY_BACKOFF_BASE_SECONDS", 0.5, "first pause before a wake is redelivered", ["gateway"]),
    _g(
        "QUAYUTEC_GATEWAY_BACKOFF_CEILING_SECONDS",
        30.0,
        "longest pause before a wake is redelivered",
        ["gateway"],
        shown="30",
    ),
    _g(
        "QUAYUTEC_GATEWAY_DELIVERY_CONCURRENCY",
        64,
        "wakes being started at once (the items of StartRuns calls in flight; a person's post through this "
        "replica leases its wakes to it only while it has a place for each)",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_START_RUN_TIMEOUT_SECONDS",
        10.0,
        "deadline of one StartRuns call (or StartRun, against a Runtime without it)",
        ["gateway"],
        shown="10",
    ),
    _g(
        "QUAYUTEC_GATEWAY_DELIVERY_STOP_GRACE_SECONDS",
        5.0,
        "how long deliveries in flight may finish on shutdown",
        ["gateway"],
        shown="5",
    ),
    _g(
        "QUAYUTEC_GATEWAY_EXPIRE_INTERVAL_SECONDS",
        5.0,
        "how often the housekeeping runs: expired waitpoints and abandoned runs are ended, runs not started recorded",
        ["gateway"],
        shown="5",
    ),
    _g(
        "QUAYUTEC_GATEWAY_ABANDON_AFTER_SECONDS",
        600,
        "a run with no progress recorded this long (RUNNING and untouched, or PARKED with its waitpoint decided or "
        "expired) is ended FAILED as abandoned; keep it above the Runtime's RUN_SECONDS",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_NOT_STARTED_AFTER_SECONDS",
        60,
        "a wake this old, delivered and still pending with no ledger row (its runs stopped before the room "
        "read) gets a NOT_STARTED row saying so, within an EXPIRE_INTERVAL more; it is delivered again",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_POST_RATE",
        20.0,
        "per-company posts per second (per Gateway replica)",
        ["gateway"],
        shown="20",
    ),
    _g("QUAYUTEC_GATEWAY_POST_BURST", 40, "per-company burst of posts above the rate", ["gateway"]),
    _g(
        "QUAYUTEC_GATEWAY_RATE_LIMIT_MAX_COMPANIES",
        10_000,
        "companies whose rate buckets are kept (least recent dropped)",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_ROOM_TIMEOUT_SECONDS",
        10.0,
        "deadline of one Gateway call to Room",
        ["gateway"],
        shown="10",
    ),
    _g(
        "QUAYUTEC_GATEWAY_RECONNECT_BACKOFF_MAX_MS",
        5000,
        "longest pause between the Gateway's reconnects to Room and Runtime",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_WATCH_BUFFER_EVENTS",
        256,
        "events a WatchRoom stream holds for its caller; a live stream that overflows it ends RESOURCE_EXHAUSTED",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_WATCH_HEARTBEAT_SECONDS",
        15.0,
        "an idle WatchRoom stream re-checks membership and sends a heartbeat this often",
        ["gateway"],
        shown="15",
    ),
    _g(
        "QUAYUTEC_GATEWAY_WATCH_CHECK_SECONDS",
        0.5,
        "while the Gateway's LISTEN connection is down, streams re-read their room this often",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_WATCH_COALESCE_MS",
        100.0,
        "a busy room's new events (one read for its watchers less than a second before) are read this long"
        " after their notification, so what is posted meanwhile reaches every watcher in one response (fewer"
        " sends per event, that much later); a quiet room's event is read at once (0: always at once)",
        ["gateway"],
        shown="100",
    ),
    _g(
        "QUAYUTEC_GATEWAY_WATCH_COALESCE_MIN_STREAMS",
        16,
        "a room is read late (WATCH_COALESCE_MS) only while at least this many of the replica's streams follow"
        " it: with fewer, what a batch saves (a send per stream) is small, and each event reaches them at once",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_WATCH_MAX_STREAMS",
        900,
        "WatchRoom and WatchRooms streams one replica serves at once (beyond: RESOURCE_EXHAUSTED); each also"
        " counts against the server's concurrent calls (QUAYUTEC_GRPC_MAX_CALLS)",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_WATCH_MAX_ROOMS",
        200,
        "rooms one WatchRooms stream follows; a company in more rooms is answered RESOURCE_EXHAUSTED",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_MAX_STREAMS_PER_COMPANY",
        100,
        "open streams (WatchRoom, WatchRooms, A2A streaming) of one company on one replica (beyond:"
        " RESOURCE_EXHAUSTED), so one company cannot take every stream slot",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_KEY_NOTIFY",
        True,
        "LISTEN for key revocations (quayutec_keys_revoked) and end the revoked key's open streams at once",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_KEY_RECHECK_SECONDS",
        5.0,
        "the backstop of revocation: this often, the keys of open streams are looked up again and a revoked or"
        " expired key's streams end",
        ["gateway"],
        shown="5",
    ),
    _g(
        "QUAYUTEC_GATEWAY_KEY_CACHE_SIZE",
        0,
        "API keys whose lookup authentication keeps in memory (0, the default: every call's key is looked up,"
        " so a revoked key is refused from its revocation's commit); kept keys are used only while the replica"
        " listens for revocations (QUAYUTEC_GATEWAY_KEY_NOTIFY), and one revoked elsewhere than through this"
        " replica is refused once its notification arrives (milliseconds later)",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_KEY_CACHE_SECONDS",
        30.0,
        "longest a kept key lookup is used before the key is read again",
        ["gateway"],
        shown="30",
    ),
    _g(
        "QUAYUTEC_GATEWAY_AUTH_FAILURE_BURST",
        20,
        "failed authentications allowed at once per source address and per key id (failed CompleteSignIn"
        " calls: per source address and per company); beyond, refused RESOURCE_EXHAUSTED until the rate refills",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_AUTH_FAILURE_RATE",
        1.0,
        "failed authentications (and sign-ins) a second per source address, key id or company after the burst"
        " (0: no throttle)",
        ["gateway"],
        shown="1",
    ),
    _g(
        "QUAYUTEC_GATEWAY_AUTH_TRACKED",
        10_000,
        "sources and key ids whose failed authentications are counted (least recent dropped)",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_MAX_SESSION_KEYS",
        1000,
        "live session keys (console sign-ins, CreateSessionKey) of one company key",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_MAX_API_KEYS",
        100,
        "live company API keys of one company that CreateApiKey may reach (the admin's `quayutec keys create` is "
        "not limited)",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_ENCRYPTION_KEY",
        "",
        "Fernet key(s), comma-separated, newest first, encrypting the client secrets of companies' sign-in "
        "providers at rest (the Gateway's own: never the Room's QUAYUTEC_ENCRYPTION_KEY)",
        ["gateway"],
        shown="(dev: gateway-encryption.key in the data dir)",
        secret=True,
    ),
    _g(
        "QUAYUTEC_GATEWAY_A2A_URL",
        "",
        "the gRPC address (host:port) A2A agent cards name for this Gateway; unset: the address it listens on",
        ["gateway"],
    ),
    _g(
        "QUAYUTEC_GATEWAY_A2A_BLOCK_SECONDS",
        30.0,
        "longest a blocking A2A SendMessage waits for the task to leave submitted/working (a shorter client"
        " deadline wins)",
        ["gateway"],
        shown="30",
    ),
    # Console (services/console: the web page; not a gRPC service)
    _g("QUAYUTEC_CONSOLE_LISTEN", "127.0.0.1:8080", "where the console serves HTTP (host:port)", ["console"]),
    _g(
        "QUAYUTEC_CONSOLE_SESSION_SECRET",
        "",
        "secret signing and encrypting the console's session cookie (holds the sign-in's session key); at least"
        " 32 characters",
        ["console"],
        shown="(dev: key file in the data dir)",
        secret=True,
    ),
    _g(
        "QUAYUTEC_CONSOLE_SECURE_COOKIE",
        True,
        "mark the session cookie Secure (sent over https only); false only for plain http on loopback (dev)",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_SESSION_HOURS",
        12.0,
        "how long a console sign-in lasts (its session key at the Gateway lives as long, 1 minute to 7 days)",
        ["console"],
        shown="12",
    ),
    _g(
        "QUAYUTEC_CONSOLE_GATEWAY_TLS",
        False,
        "the console dials the Gateway over TLS (set when the Gateway serves TLS_CERT / TLS_KEY)",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_GATEWAY_CA",
        "",
        "PEM file of the CA that signed the Gateway's certificate; unset: the system's roots",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_GATEWAY_TLS_NAME",
        "",
        "the name the Gateway's certificate must carry, when not the host of QUAYUTEC_GATEWAY_ADDR",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_GATEWAY_CONSOLE_ADDR",
        "",
        "the Gateway's console port (its QUAYUTEC_GATEWAY_CONSOLE_LISTEN): when set, the console calls it as "
        "the console identity (QUAYUTEC_MTLS_* or the dev PKI) instead of QUAYUTEC_GATEWAY_ADDR, and passes on "
        "each browser's address, so failed sign-ins count against the browser, not the console",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_MAX_STREAMS_PER_SESSION",
        6,
        "live-update streams (open pages) of one sign-in on one console replica; beyond, 429",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_SIGNIN_FAILURE_BURST",
        10,
        "failed sign-ins allowed at once per browser address and per key id; beyond, 429 with Retry-After",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_SIGNIN_FAILURE_RATE",
        0.1,
        "failed sign-ins a second per browser address and per key id after the burst (0: no throttle)",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_SIGNIN_TRACKED",
        10_000,
        "browser addresses and key ids whose failed sign-ins are counted (least recent dropped)",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_ORIGIN",
        "",
        "the origin browsers reach the console at (https://host[:port]); every POST's Origin must be it;"
        " unset: the request's own host",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_HEADER_TIMEOUT_SECONDS",
        10.0,
        "a request's line and headers must arrive whole within this after the connection opens (or the previous"
        " answer ends), or the connection is closed",
        ["console"],
        shown="10",
    ),
    _g(
        "QUAYUTEC_CONSOLE_BODY_TIMEOUT_SECONDS",
        30.0,
        "a request's body must arrive whole within this after its headers (408 past it)",
        ["console"],
        shown="30",
    ),
    _g(
        "QUAYUTEC_CONSOLE_KEEP_ALIVE_SECONDS",
        5,
        "a kept-alive connection quiet this long after an answer is closed",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_MAX_CONNECTIONS",
        500,
        "open connections (event streams included) past which a request is answered 503",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_MAX_CONNECTIONS_PER_SOURCE",
        100,
        "open connections one address (an IPv6 /64) may hold; a further one is closed at once, before it counts"
        " against QUAYUTEC_CONSOLE_MAX_CONNECTIONS (0: no limit, for a console whose only client is a proxy)",
        ["console"],
    ),
    _g(
        "QUAYUTEC_CONSOLE_MAX_BODY_BYTES",
        1024 * 1024,
        "the longest request body the console reads (a form post); longer: 413, unread when its length is declared",
        ["console"],
        shown="1048576 (1 MiB)",
    ),
    _g(
        "QUAYUTEC_CONSOLE_JAEGER_URL",
        "",
        "base URL of the Jaeger UI (as people reach it, e.g. http://localhost:16686) that a run's page in the "
        "console and `quayutec run` link each of its traces to (its /trace/TRACE_ID page); anything but an "
        "http(s) URL with a host is refused at start; unset: the trace ids are shown, not linked",
        ["console", "cli"],
    ),
    # Room
    _g(
        "QUAYUTEC_ROOM_EVENT_RETENTION_HOURS",
        168.0,
        "how long room events are kept for watchers to resume from; an older cursor answers OUT_OF_RANGE",
        ["room"],
        shown="168",
    ),
    _g(
        "QUAYUTEC_ROOM_EVENT_CLEANUP_SECONDS",
        300.0,
        "how often each Room replica removes events older than the retention",
        ["room"],
        shown="300",
    ),
    # OpenTelemetry (the standard variables we read)
    _g("OTEL_EXPORTER_OTLP_ENDPOINT", "", "OTLP/gRPC endpoint for traces and metrics; unset: no export", ALL),
    _g("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "", "OTLP endpoint for traces only", ALL),
    _g("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "", "OTLP endpoint for metrics only", ALL),
    _g("OTEL_TRACES_EXPORTER", "", "otlp, console or none (unset: otlp when an endpoint is set)", ALL),
    _g("OTEL_METRICS_EXPORTER", "", "otlp, console or none (unset: otlp when an endpoint is set)", ALL),
    _g("OTEL_SERVICE_NAME", "", "service name in traces", ALL, shown="quayutec-<service>"),
    _g("OTEL_RESOURCE_ATTRIBUTES", "", "extra resource attributes, key=value,...", ALL),
    _g("OTEL_SDK_DISABLED", False, "true turns telemetry off", ALL),
    _g(
        "OTEL_SEMCONV_STABILITY_OPT_IN",
        "http,database",
        "the instrumentations' semantic conventions: the stable HTTP and database names (gRPC's are ours)",
        ALL,
    ),
    _g(
        "QUAYUTEC_HOUSEKEEPING_TRACE_RATIO",
        0.0,
        "fraction (0..1) of idle polls and housekeeping calls traced as traces of their own; 0: only the "
        "passes that change something, each recorded as one span",
        ALL,
        shown="0",
    ),
    _g(
        "OTEL_SPAN_LINK_COUNT_LIMIT",
        "",
        "most links a span keeps; unset: 1000, a link per wake of the largest batched call",
        ALL,
        shown="1000",
    ),
    _g(
        "OTEL_BSP_SCHEDULE_DELAY",
        "",
        "milliseconds between two exports of finished spans (read by the OpenTelemetry SDK); `quayutec demo` "
        "sets 500 when it traces to Jaeger, unless set",
        ALL,
        shown="5000",
    ),
    # Jaeger v2's config (deploy/k8s/base/jaeger-config.yaml), as `make jaeger` runs it; `quayutec demo`
    # traces to that Jaeger when its health check answers.
    _g(
        "JAEGER_OTLP_GRPC_ADDR",
        "127.0.0.1:4317",
        "where Jaeger receives OTLP over gRPC; `quayutec demo` exports its services' traces there",
        ["jaeger", "cli"],
    ),
    _g("JAEGER_OTLP_HTTP_ADDR", "127.0.0.1:4318", "where Jaeger receives OTLP over HTTP", ["jaeger"]),
    _g(
        "JAEGER_QUERY_HTTP_ADDR",
        "127.0.0.1:16686",
        "Jaeger's query API (/api/v3) and UI; `quayutec demo` links the console's run pages to it",
        ["jaeger", "cli"],
    ),
    _g("JAEGER_QUERY_GRPC_ADDR", "127.0.0.1:16685", "Jaeger's query gRPC API", ["jaeger"]),
    _g(
        "JAEGER_HEALTH_ADDR",
        "127.0.0.1:13133",
        "Jaeger's health check (GET /status answers 200 once it is up); `quayutec demo` traces to Jaeger when it "
        "answers",
        ["jaeger", "cli"],
    ),
    _g("JAEGER_METRICS_HOST", "127.0.0.1", "where Jaeger serves its own metrics (Prometheus)", ["jaeger"]),
    _g("JAEGER_METRICS_PORT", "8888", "the port of Jaeger's own metrics", ["jaeger"]),
    _g(
        "JAEGER_MAX_TRACES",
        50000,
        "most traces Jaeger's in-memory storage keeps (the oldest goes first; all are lost when it stops)",
        ["jaeger"],
    ),
    _g("JAEGER_LOG_LEVEL", "info", "Jaeger's log level", ["jaeger"]),
    _g(
        "OTEL_BSP_MAX_QUEUE_SIZE",
        2048,
        "most ended spans waiting for export while the collector is slow or away; more are dropped and "
        "counted (quayutec.telemetry.spans_dropped)",
        ALL,
    ),
    _g(
        "OTEL_EXPORTER_OTLP_TIMEOUT",
        10.0,
        "seconds (this SDK reads seconds, not the spec's milliseconds) one export may take, retries "
        "included; then its batch is dropped",
        ALL,
        shown="10",
    ),
    _g(
        "QUAYUTEC_TELEMETRY_SHUTDOWN_SECONDS",
        5.0,
        "on SIGTERM, after the gRPC drain: the longest spent exporting the spans still queued; the rest "
        "are dropped and counted",
        ALL,
        shown="5",
    ),
    _g(
        "QUAYUTEC_GATEWAY_TRUST_TRACEPARENT",
        False,
        "true: a call's incoming traceparent is the parent of the Gateway's span (its flags decide the "
        "sampling); false: a new trace of ours, sampled by our own sampler, linked to the caller's span",
        ["gateway"],
    ),
]
for _spec in SERVICES:
    _DECLARED += _per_service(_spec)

SETTINGS: dict[str, Setting] = {s.name: s for s in _DECLARED}
if len(SETTINGS) != len(_DECLARED):  # pragma: no cover - a declaration error
    raise RuntimeError("a setting is declared twice")


def setting(name: str) -> Setting:
    """The declaration of ``name``; reading a variable that is not declared is a programming error."""
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not declared in quayutec/settings.py") from None


def for_service(service: str) -> list[Setting]:
    """The settings one service (or ``cli``) reads, in table order."""
    return [s for s in ordered() if service in s.services]


def ordered() -> list[Setting]:
    """Every setting: the shared ones first, then each service's, then OpenTelemetry's, then Jaeger's."""

    def key(s: Setting) -> int:
        if s.name.startswith("OTEL_"):
            return 9
        if s.name.startswith("JAEGER_"):
            return 10
        for i, spec in enumerate(SERVICES):
            if s.name.startswith(spec.prefix):
                return 1 + i
        return 0

    return sorted(_DECLARED, key=key)


def in_effect(s: Setting, env: Mapping[str, str]) -> tuple[str, bool]:
    """The value in effect (secrets masked) and whether the environment sets it."""
    raw = env.get(s.name, "").strip()
    if not raw:
        return s.default_text, False
    return ("(set, hidden)" if s.secret else raw), True


def markdown_table() -> str:
    """The settings table of docs/settings.md."""
    lines = ["| variable | default | read by | meaning |", "|---|---|---|---|"]
    for s in ordered():
        default = (
            f"`{s.default_text}`"
            if not s.default_text.startswith("(") and s.default_text != "unset"
            else s.default_text
        )
        lines.append(
            f"| `{s.name}` | {default} | {', '.join(s.services) if s.services != ALL else 'all'} | {s.meaning} |"
        )
    return "\n".join(lines)


def service_arguments(spec: ServiceSpec, argv: list[str]) -> None:
    """``python -m services.<name> [--help]``: the services take no arguments, only settings."""
    lines = [f"  {s.name}  (default {s.default_text})\n      {s.meaning}" for s in for_service(spec.name)]
    p = argparse.ArgumentParser(
        prog=f"python -m services.{spec.name}",
        description=f"Serve {spec.grpc_service} until SIGTERM or Ctrl-C. It takes no arguments: "
        "every setting is an environment variable, read once at start-up.",
        epilog="settings:\n" + "\n".join(lines),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.parse_args(argv)
