"""Runtime settings, read once from ``QUAYUTEC_RUNTIME_*``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from quayutec.config import CLAIMS, ROOM, RUNTIME, ConfigError, ServerConfig, env_float, env_int, env_str, service_addr
from quayutec.egress import EgressPolicy
from quayutec.settings import setting
from services.runtime.model import DEFAULT_MAX_RESPONSE_BYTES

P = RUNTIME.prefix


@dataclass(frozen=True)
class RuntimeConfig:
    """How the Runtime listens, whom it calls, and the bounds on its runs."""

    server: ServerConfig
    claims_addr: str
    room_addr: str
    # Runs executing at once in this process; over that StartRun answers RESOURCE_EXHAUSTED. The
    # provider connection pool holds as many connections (a run makes one model request at a time).
    max_runs: int = 2048
    # Active time of one run (time parked on a waitpoint does not count).
    run_seconds: float = 300.0
    # Timeout of one model request: of each phase (connect, read, write, pool) and of the whole request.
    model_timeout_seconds: float = 60.0
    # The most of one model answer's body that is read; a longer one is a final response_too_large.
    model_max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    # Deadline of one call to Claims or Room.
    backend_timeout_seconds: float = 10.0
    # How long a Room call that is safe to repeat (reads, ledger rows, writes with a dedupe key) is
    # retried on UNAVAILABLE / DEADLINE_EXCEEDED, within the run's active time.
    room_retry_seconds: float = 30.0
    # Our own provider addresses (not owner supplied: retried per the policy), e.g. the stand-in.
    anthropic_base_url: str = "https://api.anthropic.com"
    openai_base_url: str = "https://api.openai.com"
    recent_messages: int = 20
    # How long held actions wait for their company's decision before they end undone.
    waitpoint_ttl_seconds: int = 86_400
    # Where an owner-supplied base URL may lead besides public https addresses (EGRESS_ALLOW).
    egress: EgressPolicy = field(default_factory=EgressPolicy)
    # Step boundaries at which a run pauses until SIGUSR1 (crash tests only), each with how many runs
    # pass it first ("name" or "name:N", comma-separated).
    failpoints: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RuntimeConfig:
        env = os.environ if env is None else env
        failpoints = _failpoints(env.get(f"{P}FAILPOINTS", ""))
        return cls(
            server=ServerConfig.from_env(RUNTIME, env),
            claims_addr=service_addr(CLAIMS, env),
            room_addr=service_addr(ROOM, env),
            max_runs=env_int(env, setting(f"{P}MAX_RUNS"), minimum=1),
            run_seconds=env_float(env, setting(f"{P}RUN_SECONDS"), minimum=0.001),
            model_timeout_seconds=env_float(env, setting(f"{P}MODEL_TIMEOUT_SECONDS"), minimum=0.001),
            model_max_response_bytes=env_int(env, setting(f"{P}MODEL_MAX_RESPONSE_BYTES"), minimum=1024),
            backend_timeout_seconds=env_float(env, setting(f"{P}BACKEND_TIMEOUT_SECONDS"), minimum=0.001),
            room_retry_seconds=env_float(env, setting(f"{P}ROOM_RETRY_SECONDS"), minimum=0.0),
            anthropic_base_url=env_str(env, setting(f"{P}ANTHROPIC_BASE_URL")).rstrip("/"),
            openai_base_url=env_str(env, setting(f"{P}OPENAI_BASE_URL")).rstrip("/"),
            recent_messages=env_int(env, setting(f"{P}RECENT_MESSAGES"), minimum=1),
            waitpoint_ttl_seconds=env_int(env, setting(f"{P}WAITPOINT_TTL_SECONDS"), minimum=1),
            egress=EgressPolicy.from_env(env),
            failpoints=failpoints,
        )


# The step boundaries a crash test can stop a run at.
FAILPOINTS = frozenset(
    {
        "before_room_read",
        "claimed",
        "model_called",
        "reply_posted",
        "action_written",
        "continuation_claimed",
        "continued",
    }
)


def _failpoints(text: str) -> dict[str, int]:
    """``name`` or ``name:N`` (N runs pass it before it pauses them), comma-separated."""
    points: dict[str, int] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, _, skip = item.partition(":")
        if name not in FAILPOINTS:
            raise ConfigError(f"{P}FAILPOINTS names unknown point {name!r}; known: {sorted(FAILPOINTS)}")
        if skip and not skip.isdigit():
            raise ConfigError(f"{P}FAILPOINTS: {item!r} must be NAME or NAME:N, N the runs let through first")
        points[name] = int(skip or 0)
    return points
