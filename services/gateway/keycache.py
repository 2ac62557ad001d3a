"""What authentication needs of recently used API keys, kept in memory so a call costs no key lookup.

A cached key is used only while the replica LISTENs for revocations (``quayutec_keys_revoked``, the
trigger's notification of every revoked key, a company key's session keys included): a notification
drops the key at once, and the cache fails closed — it is emptied and bypassed (every call looks its
key up again) from the moment the listener is down until it listens again, since notifications sent
meanwhile are lost. A revocation made through this replica (RevokeApiKey, EndSession) drops the key
before the call answers; one made elsewhere (another replica, `quayutec keys revoke`) is refused once its
notification arrives, milliseconds after its commit: that window is why the cache is off by default
(QUAYUTEC_GATEWAY_KEY_CACHE_SIZE=0), and the key lookup it saves was within noise of the wake's cost.
A lookup that a revocation notification overtook is not cached (an epoch counts notifications and
reconnects), so a key never comes back from a read older than its revocation.

Bounded: at most ``size`` keys (the least recently used go first), each for at most ``seconds``; a
session key's expiry is checked on every use. The hash is kept, never the secret: each call still
compares the SHA-256 of the secret it carries, in constant time.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime

from services.gateway.config import KeyCacheConfig
from services.gateway.store import StoredKeyHash


class KeyCache:
    """Key id -> what authentication needs of it, valid while ``listening()`` holds."""

    def __init__(
        self,
        config: KeyCacheConfig,
        listening: Callable[[], bool],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._listening = listening
        self._clock = clock
        self._keys: OrderedDict[str, tuple[StoredKeyHash, float]] = OrderedDict()
        # Bumped by every revocation and every (re)connect of the listener: a lookup started before
        # one is not cached.
        self.epoch = 0
        self._was_listening = False

    @property
    def enabled(self) -> bool:
        return self._config.size > 0

    def _live(self) -> bool:
        """Whether cached keys may be used now; emptied whenever the listener was seen down."""
        listening = self._listening()
        if not listening and self._was_listening:
            self.clear()
        self._was_listening = listening
        return listening

    def get(self, key_id: str) -> StoredKeyHash | None:
        if not self.enabled or not self._keys or not self._live():
            return None
        found = self._keys.get(key_id)
        if found is None:
            return None
        stored, until = found
        if self._clock() >= until or (
            stored.expires_at is not None and stored.expires_at <= datetime.now(UTC)
        ):  # stale, or a session key that has expired since (the lookup answers "expired")
            del self._keys[key_id]
            return None
        self._keys.move_to_end(key_id)
        return stored

    def put(self, key_id: str, stored: StoredKeyHash, epoch: int) -> None:
        """Keep a live key read by a lookup that started at ``epoch`` (nothing revoked or lost since)."""
        if not self.enabled or epoch != self.epoch or stored.revoked or stored.expired or not self._live():
            return
        self._keys[key_id] = (stored, self._clock() + self._config.seconds)
        self._keys.move_to_end(key_id)
        while len(self._keys) > self._config.size:
            self._keys.popitem(last=False)

    def revoked(self, key_id: str) -> None:
        """A key was revoked (notified, or by this replica): drop it, and the session keys it made."""
        self.epoch += 1
        self._keys.pop(key_id, None)
        for child in [k for k, (s, _) in self._keys.items() if s.parent_key_id == key_id]:
            del self._keys[child]

    def clear(self) -> None:
        """Forget every key (the listener (re)connected: notifications may have been missed)."""
        self.epoch += 1
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)
