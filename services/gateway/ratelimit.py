"""Per-company token buckets on posting RPCs, in memory of one Gateway replica.

Limits are per replica: with N replicas behind a balancer a company may post up to N times the rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from quayutec.errors import ResourceExhausted
from quayutec.throttle import TokenBuckets
from services.gateway.config import RateLimitConfig


class PostRateLimiter:
    """A token bucket per company (``rate`` tokens a second up to ``burst``), at most ``max_companies`` kept."""

    def __init__(self, config: RateLimitConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._buckets = TokenBuckets(config.rate_per_second, config.burst, config.max_companies, clock=clock)

    @property
    def enabled(self) -> bool:
        return self._buckets.enabled

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, company_id: str) -> None:
        """Spend one token of ``company_id`` or raise ResourceExhausted saying when one is back."""
        retry_after_ms = self._buckets.take(company_id)
        if retry_after_ms:
            raise ResourceExhausted(
                f"rate limit: at most {self._buckets.rate:g} posts a second (burst {self._buckets.burst:g}) per "
                f"company; retry after {retry_after_ms} ms",
                retry_after_ms=retry_after_ms,
            )
