"""The one retry policy for model calls, and the clock it waits on."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries: at most `max_requests` requests; a provider-named wait is honoured up to
    `max_named_wait_seconds` (longer: stop); with no wait named, `default_waits` in order."""

    max_requests: int = 3
    max_named_wait_seconds: float = 20.0
    default_waits: tuple[float, ...] = (2.0, 8.0)

    def __post_init__(self) -> None:
        if self.max_requests < 1:
            raise ValueError("max_requests must be at least 1")
        if self.max_named_wait_seconds < 0:
            raise ValueError("max_named_wait_seconds must not be negative")
        if any(w < 0 for w in self.default_waits):
            raise ValueError("default_waits must not be negative")
        if len(self.default_waits) < self.max_requests - 1:
            raise ValueError("default_waits needs one wait per retry (max_requests - 1)")


class Clock(Protocol):
    async def sleep(self, seconds: float) -> None: ...

    def monotonic(self) -> float: ...


class RealClock:
    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def monotonic(self) -> float:
        return time.monotonic()
