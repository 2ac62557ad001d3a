"""The per-company token bucket, driven by a test clock."""

from __future__ import annotations

import pytest

from quayutec.errors import ResourceExhausted
from services.gateway.config import RateLimitConfig
from services.gateway.ratelimit import PostRateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_burst_then_refill_with_retry_hint() -> None:
    clock = Clock()
    limiter = PostRateLimiter(RateLimitConfig(rate_per_second=2.0, burst=3), clock=clock)
    for _ in range(3):
        limiter.take("acme")
    with pytest.raises(ResourceExhausted) as err:
        limiter.take("acme")
    assert err.value.retry_after_ms == 500
    assert "retry after 500 ms" in err.value.message
    limiter.take("globex")  # another company has its own bucket
    clock.now += 0.5
    limiter.take("acme")
    with pytest.raises(ResourceExhausted):
        limiter.take("acme")
    clock.now += 10
    for _ in range(3):  # refills to the burst, no further
        limiter.take("acme")
    with pytest.raises(ResourceExhausted):
        limiter.take("acme")


def test_map_stays_bounded_and_evicts_idle_first() -> None:
    clock = Clock()
    limiter = PostRateLimiter(RateLimitConfig(rate_per_second=1.0, burst=2, max_companies=3), clock=clock)
    limiter.take("a")
    limiter.take("a")
    clock.now += 5  # "a" is idle (refilled)
    limiter.take("b")
    limiter.take("c")
    limiter.take("d")
    assert len(limiter) == 3
    for n in range(100):
        limiter.take(f"busy-{n}")
    assert len(limiter) == 3
    # The most recent companies are kept: their spent tokens still count.
    limiter.take("busy-99")
    with pytest.raises(ResourceExhausted):
        limiter.take("busy-99")


def test_rate_zero_disables() -> None:
    limiter = PostRateLimiter(RateLimitConfig(rate_per_second=0, burst=1))
    for _ in range(1000):
        limiter.take("acme")
    assert len(limiter) == 0
