"""Per-company token buckets on posting RPCs, in memory of one Gateway replica.

Limits are per replica: with N replicas behind a balancer a company may post up to N times the rate.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from quayutec.errors import ResourceExhausted
from services.gateway.config import RateLimitConfig


@dataclass
class _Bucket:
    tokens: float
    updated: float


class PostRateLimiter:
    """A token bucket per company (``rate`` tokens a second up to ``burst``), at most ``max_companies`` kept."""

    def __init__(self, config: RateLimitConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = config.rate_per_second
        self._burst = float(config.burst)
        self._max = config.max_companies
        self._clock = clock
        # Least recently used first.
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._rate > 0

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, company_id: str) -> None:
        """Spend one token of ``company_id`` or raise ResourceExhausted saying when one is back."""
        if not self.enabled:
            return
        now = self._clock()
        bucket = self._buckets.get(company_id)
        if bucket is None:
            bucket = _Bucket(tokens=self._burst, updated=now)
            self._buckets[company_id] = bucket
            self._evict(now)
        else:
            bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.updated) * self._rate)
            bucket.updated = now
            self._buckets.move_to_end(company_id)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return
        retry_after_ms = max(1, math.ceil((1.0 - bucket.tokens) / self._rate * 1000))
        raise ResourceExhausted(
            f"rate limit: at most {self._rate:g} posts a second (burst {self._burst:g}) per company; "
            f"retry after {retry_after_ms} ms",
            retry_after_ms=retry_after_ms,
        )

    def _evict(self, now: float) -> None:
        """Keep the map bounded: drop idle buckets (refilled, so equal to a new one), then the least recent.

        Buckets are kept in order of last use, so the idle ones are at the front.
        """
        refill_seconds = self._burst / self._rate
        while self._buckets:
            oldest = next(iter(self._buckets.values()))
            if len(self._buckets) <= self._max and now - oldest.updated < refill_seconds:
                return
            self._buckets.popitem(last=False)
