"""Open server streams of one Gateway replica: each company's fair share, and the end of a revoked key's.

The auth interceptor registers every authenticated server stream (WatchRoom, WatchRooms, A2A
streaming) here before its first item. A company may hold at most ``max_per_company`` of them on
one replica (RESOURCE_EXHAUSTED beyond, naming the limit), so one key cannot take every slot.

A stream ends with UNAUTHENTICATED, within seconds, when its key stops working:
- revoked: the revoke's trigger NOTIFYs ``quayutec_keys_revoked`` (payload: the key id; a company
  key's session keys are revoked and notified with it); every replica LISTENs and ends the key's
  streams at once;
- the backstop: every ``recheck_seconds``, and whenever the LISTEN (re)connects, the keys of open
  streams are looked up again in one query, and a revoked, expired or vanished key's streams end;
- expired: a session key's streams end when it expires (a timer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

from quayutec.errors import ResourceExhausted, Unauthenticated
from services.gateway.config import StreamsConfig
from services.gateway.store import ApiKeyStore

_log = logging.getLogger("quayutec.gateway.streams")

KEYS_REVOKED_CHANNEL = "quayutec_keys_revoked"
# A stream told to end while a send of it is blocked (a client that stopped reading) is cut this much later.
CUT_AFTER_SECONDS = 1.0
# How often expired session keys are removed from the table (a day after their expiry).
PRUNE_EVERY_SECONDS = 3600.0
_REVOKED = "this API key was revoked while the stream was open; sign in again or use a live key"
_EXPIRED = "this session key expired while the stream was open; sign in again"
_DEAD = "this API key was revoked or expired while the stream was open; sign in again or use a live key"


class OpenStream:
    """One open stream: its company, its key, and the task serving it (cancelled to end it)."""

    def __init__(self, company_id: str, key_id: str, task: asyncio.Task[object] | None) -> None:
        self.company_id = company_id
        self.key_id = key_id
        self._task = task
        # The stream is waiting for its next item (ending it then cancels that wait).
        self.waiting = False
        # Why it must end (set once); the interceptor aborts the call with it.
        self.ended: BaseException | None = None
        self.timers: list[asyncio.TimerHandle] = []

    def end(self, reason: BaseException) -> None:
        if self.ended is not None or self._task is None:
            return
        self.ended = reason
        if self.waiting:
            self._task.cancel()
        else:  # between items: the interceptor ends it after the send; cut it if the send never finishes
            self.timers.append(asyncio.get_running_loop().call_later(CUT_AFTER_SECONDS, self._cut))

    def _cut(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def uncancel(self) -> None:
        if self._task is not None:
            self._task.uncancel()


class OpenStreams:
    """The open streams of this replica by company and by key; ends the streams of dead keys."""

    def __init__(self, config: StreamsConfig, store: ApiKeyStore) -> None:
        self._config = config
        self._store = store
        self._per_company: dict[str, int] = {}
        self._by_key: dict[str, set[OpenStream]] = {}
        self._task: asyncio.Task[None] | None = None
        self._recheck_now = asyncio.Event()

    def __len__(self) -> int:
        return sum(self._per_company.values())

    def open(self, company_id: str, key_id: str, expires_at: datetime | None) -> OpenStream:
        """Registers the current task's stream; RESOURCE_EXHAUSTED when its company has its share."""
        most = self._config.max_per_company
        if self._per_company.get(company_id, 0) >= most:
            raise ResourceExhausted(
                f"your company already has {most} open streams on this Gateway replica (the per-company limit, "
                f"QUAYUTEC_GATEWAY_MAX_STREAMS_PER_COMPANY = {most}); close one (WatchRooms follows every room of "
                "your company in one stream) or retry later"
            )
        stream = OpenStream(company_id, key_id, asyncio.current_task())
        self._per_company[company_id] = self._per_company.get(company_id, 0) + 1
        self._by_key.setdefault(key_id, set()).add(stream)
        if expires_at is not None:
            seconds = (expires_at - datetime.now(UTC)).total_seconds()
            loop = asyncio.get_running_loop()
            stream.timers.append(loop.call_later(max(seconds, 0.0), stream.end, Unauthenticated(_EXPIRED)))
        return stream

    def close(self, stream: OpenStream) -> None:
        for timer in stream.timers:
            timer.cancel()
        streams = self._by_key.get(stream.key_id)
        if streams is None or stream not in streams:
            return
        streams.discard(stream)
        if not streams:
            del self._by_key[stream.key_id]
        left = self._per_company[stream.company_id] - 1
        if left:
            self._per_company[stream.company_id] = left
        else:
            del self._per_company[stream.company_id]

    # -- revocation ----------------------------------------------------------------------------------

    def revoked(self, key_id: str, why: str = _REVOKED) -> None:
        """The notification of a revoked key: its streams end now."""
        for stream in list(self._by_key.get(key_id.strip(), ())):
            stream.end(Unauthenticated(why))

    def listening(self) -> None:
        """LISTEN took effect (again): a revocation may have been missed meanwhile."""
        self._recheck_now.set()

    async def recheck(self) -> int:
        """The backstop: ends the streams of every key that is revoked, expired or gone; how many keys."""
        keys = list(self._by_key)
        dead = await self._store.dead_keys(keys) if keys else set()
        for key_id in dead:
            self.revoked(key_id, _DEAD)
        return len(dead)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="stream-key-recheck")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        pruned = loop.time()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._recheck_now.wait(), timeout=self._config.recheck_seconds)
            self._recheck_now.clear()
            try:
                await self.recheck()
                if loop.time() - pruned >= PRUNE_EVERY_SECONDS:
                    pruned = loop.time()
                    await self._store.prune_session_keys()
            except Exception as exc:
                _log.warning("re-checking the keys of open streams failed (%s); retrying", type(exc).__name__)
