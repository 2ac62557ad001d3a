"""Token buckets by key in bounded memory, and the failed-authentication throttle built on them.

``TokenBuckets`` is the one bucket implementation: the Gateway's per-company post rate limit, and
the throttle of failed authentications (Gateway API keys, console sign-in) per source address and
per key id. The throttle punishes the guesser, never the key's owner: an attempt that carries a key
is always checked, so the right secret is let in however many wrong ones were sent with its id or
from its address; a failure beyond a subject's burst is answered "too many failed attempts" (the
caller is told to back off) instead of "wrong key". Only an attempt with nothing to check (no key,
or not shaped like one) is refused unchecked while its source is throttled. One log line is written
when a subject's burst of failures begins, not one per try.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated: float
    # The subject ran out and its burst was logged; cleared once the bucket is full again.
    logged: bool = False


class TokenBuckets:
    """A token bucket per key (``rate`` tokens a second up to ``burst``), at most ``max_keys`` kept.

    A key with no bucket has a full one; buckets are kept in order of last use, and a full (idle)
    bucket equals a missing one, so eviction drops idle ones first, then the least recently used.
    """

    def __init__(self, rate: float, burst: int, max_keys: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._max = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def __len__(self) -> int:
        return len(self._buckets)

    def _refilled(self, key: str, now: float) -> _Bucket | None:
        bucket = self._buckets.get(key)
        if bucket is not None:
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
            bucket.updated = now
            if bucket.tokens >= self.burst:
                bucket.logged = False
        return bucket

    def wait_ms(self, key: str) -> int:
        """0 when ``key`` has a token; otherwise the milliseconds until it has one (nothing is spent)."""
        if not self.enabled:
            return 0
        bucket = self._refilled(key, self._clock())
        if bucket is None or bucket.tokens >= 1.0:
            return 0
        return max(1, math.ceil((1.0 - bucket.tokens) / self.rate * 1000))

    def take(self, key: str) -> int:
        """Spend one token of ``key``: 0 when it had one, else the milliseconds until it has (none spent)."""
        wait = self.wait_ms(key)
        if wait or not self.enabled:
            return wait
        self._spend(key).tokens -= 1.0
        return 0

    def spend(self, key: str) -> bool:
        """Spend one token of ``key`` even when none is left (a failure that happened anyway); True when
        this is the first time the key ran out since its bucket was last full."""
        if not self.enabled:
            return False
        bucket = self._spend(key)
        bucket.tokens = max(bucket.tokens - 1.0, 0.0)
        if bucket.tokens < 1.0 and not bucket.logged:
            bucket.logged = True
            return True
        return False

    def _spend(self, key: str) -> _Bucket:
        now = self._clock()
        bucket = self._refilled(key, now)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(tokens=self.burst, updated=now)
            self._evict(now)
        else:
            self._buckets.move_to_end(key)
        return bucket

    def _evict(self, now: float) -> None:
        refill_seconds = self.burst / self.rate
        while self._buckets:
            oldest = next(iter(self._buckets.values()))
            if len(self._buckets) <= self._max and now - oldest.updated < refill_seconds:
                return
            self._buckets.popitem(last=False)


def source_of(peer: str) -> str:
    """The throttled source of a peer (gRPC ``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, or a bare address): the
    address without its port, an IPv6 address as its /64 (one host usually holds a whole /64), an
    IPv4-mapped one as its IPv4 address."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        host = rest.rpartition(":")[0] or rest
    elif kind == "ipv6" and rest.startswith("[") and "]" in rest:
        host = rest[1 : rest.index("]")]
    else:
        host = peer
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host[:100] or "unknown"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)  # an IPv4 client of a dual-stack listener
    if address.version == 6:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


@dataclass(frozen=True)
class ThrottleConfig:
    """Failed authentications: ``burst`` at once per subject, then ``rate`` a second; at most
    ``max_subjects`` subjects (sources and key ids) kept. Rate 0: off."""

    rate_per_second: float = 1.0
    burst: int = 20
    max_subjects: int = 10_000


class AuthThrottle:
    """Counts failed authentications per subject (``source:<address>``, ``key:<key id>``,
    ``company:<id>``) and says when
    a subject is throttled. Memory: at most ``max_subjects`` buckets."""

    def __init__(
        self,
        config: ThrottleConfig,
        logger: logging.Logger,
        *,
        what: str,
        settings: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._buckets = TokenBuckets(config.rate_per_second, config.burst, config.max_subjects, clock=clock)
        self._log = logger
        self._what = what
        self._settings = settings

    def __len__(self) -> int:
        return len(self._buckets)

    def refusal(self, subjects: Iterable[str], key_id: str | None) -> tuple[int, str] | None:
        """Before checking an attempt: (milliseconds to wait, the sentence) when it carries no key to
        check (``key_id`` None) and one of ``subjects`` is throttled; None when it is to be checked (an
        attempt with a key always is: a throttle never keeps the right secret out)."""
        if key_id is not None:
            return None
        return self._throttled(subjects)

    def _throttled(self, subjects: Iterable[str]) -> tuple[int, str] | None:
        if not self._buckets.enabled:
            return None
        for subject in subjects:
            wait = self._buckets.wait_ms(subject)
            if wait:
                where = (
                    "with this key id"
                    if subject.startswith("key:")
                    else "for this company"
                    if subject.startswith("company:")
                    else "from your address"
                )
                return wait, (
                    f"too many failed {self._what} {where} (at most {self._buckets.burst:g} at once, then "
                    f"{self._buckets.rate:g} a second: {self._settings}); retry after {wait} ms"
                )
        return None

    def failed(self, subjects: Iterable[str]) -> tuple[int, str] | None:
        """Count one failure against each subject (logging once when a subject's burst begins); returns
        the refusal to answer instead of "wrong key" when a subject was already throttled."""
        subjects = list(subjects)
        refused = self._throttled(subjects)
        for subject in subjects:
            if self._buckets.spend(subject):
                self._log.warning(
                    "more than %g failed %s at once (%s); answering its failures 'too many' until it calms"
                    " (one line per burst)",
                    self._buckets.burst,
                    self._what,
                    subject,
                )
        return refused
