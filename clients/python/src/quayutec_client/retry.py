"""When a call is sent again: one frozen policy, bounded in attempts and in total time, with
exponential backoff and jitter, honouring the wait the Gateway advises."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import grpc

# The codes after which sending the same call again can succeed.
RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)
# What a write without an idempotency key may retry: the Gateway answers RESOURCE_EXHAUSTED before it
# acts, while after UNAVAILABLE or DEADLINE_EXCEEDED the first attempt may have been done.
REFUSED_BEFORE_ACTING = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class RetryPolicy:
    """How one logical call is retried.

    ``max_attempts`` counts the first one; ``total_timeout`` bounds every attempt and wait of the call
    (and a watch's reconnects between two answers); ``attempt_timeout`` is each attempt's deadline.
    The n-th retry waits a random time between half and all of
    ``min(max_backoff, initial_backoff * multiplier ** (n - 1))``, or the Gateway's advised wait
    (``retry-after-ms``) plus up to a fifth of it when that is longer. An advised wait longer than
    ``max_advised_wait``, or than the time left, is not waited for: the call fails with RateLimited.

    An attempt that found no connection to the Gateway (it is down, restarting, unreachable) was never
    sent: it does not use up ``max_attempts``, only ``total_timeout``, so by default a call or a watch
    rides out a minute of Gateway downtime (once the Gateway is back, the next try comes within
    ``max_backoff``). With ``max_attempts=1`` nothing is tried again.
    """

    max_attempts: int = 6
    initial_backoff: float = 0.2
    max_backoff: float = 5.0
    multiplier: float = 2.0
    total_timeout: float = 60.0
    attempt_timeout: float = 15.0
    max_advised_wait: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1 (1: no retry)")
        for name in ("initial_backoff", "max_backoff", "total_timeout", "attempt_timeout", "max_advised_wait"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.multiplier < 1:
            raise ValueError("multiplier must be at least 1")
        if self.initial_backoff > self.max_backoff:
            raise ValueError("initial_backoff must not exceed max_backoff")

    def within(self, timeout: float | None) -> RetryPolicy:
        """This policy bounded by one call's ``timeout`` (seconds) instead of ``total_timeout``."""
        if timeout is None:
            return self
        if not timeout > 0:
            raise ValueError("timeout must be positive (seconds)")
        return replace(self, total_timeout=timeout, attempt_timeout=min(self.attempt_timeout, timeout))

    def wait_before(self, retry: int, advised: float | None, rng: random.Random) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
        ceiling = min(self.max_backoff, self.initial_backoff * self.multiplier ** (retry - 1))
        wait = rng.uniform(ceiling / 2, ceiling)
        if advised is not None and advised > wait:
            wait = advised * rng.uniform(1.0, 1.2)
        return wait


# No retry at all: each call is sent once.
NO_RETRY = RetryPolicy(max_attempts=1)
