"""A logger that cannot be made to flood: a few lines at once, then a steady trickle.

Used for what anyone who reaches a port can cause (requests that do not decode): each line is one
short warning with no traceback, and the lines it drops are counted in the next one it writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    """At most ``burst`` lines at once, refilled at ``burst`` per ``per_seconds``."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 10,
        per_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst < 1 or per_seconds <= 0:
            raise ValueError("burst must be at least 1 and per_seconds positive")
        self._logger = logger
        self._burst = float(burst)
        self._rate = burst / per_seconds
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self.suppressed = 0

    def warning(self, message: str, *args: object) -> bool:
        """Log ``message % args`` at WARNING unless over the rate; True when it was written."""
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens < 1.0:
            self.suppressed += 1
            return False
        self._tokens -= 1.0
        if self.suppressed:
            message += " (%d similar lines suppressed)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self._logger.warning(message, *args)
        return True
