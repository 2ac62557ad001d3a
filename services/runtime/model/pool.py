"""Provider connections for thousands of runs in flight: the pool split into shards.

httpcore's connection pool looks at every one of its connections (is it idle, has it expired, is
its socket readable: a poll() each) whenever a request starts or ends, so one pool of N
connections costs O(N) per event and O(N^2) per burst: at 2,000 runs in flight that scan took most
of the Runtime's CPU (bench/inflight.py with QY_BENCH_PROFILE=runtime). Shards of at most
``SHARD_CONNECTIONS`` keep each scan short; a request goes to the shard with the fewest requests
open, which always has a free connection while fewer than ``max_connections`` are open in all.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx

# Connections per shard: a scan of 64 is cheap beside the request it serves.
SHARD_CONNECTIONS = 64


class ShardedTransport(httpx.AsyncBaseTransport):
    """``max_connections`` connections in shards of at most SHARD_CONNECTIONS, as one transport.

    ``shard`` makes one shard from its limits (default: httpx's own transport); the Runtime's client
    for owner-supplied addresses shards its egress-guarded transport the same way."""

    def __init__(
        self,
        max_connections: int,
        *,
        trust_env: bool = True,
        shard: Callable[[httpx.Limits], httpx.AsyncBaseTransport] | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        count = -(-max_connections // SHARD_CONNECTIONS)
        size = -(-max_connections // count)
        limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
        make = shard or (lambda limits: httpx.AsyncHTTPTransport(limits=limits, trust_env=trust_env))
        self.shards = [make(limits) for _ in range(count)]
        self.open = [0] * count  # requests whose response is not closed yet, per shard

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        index = min(range(len(self.shards)), key=self.open.__getitem__)
        self.open[index] += 1
        try:
            response = await self.shards[index].handle_async_request(request)
        except BaseException:
            self.open[index] -= 1
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=_Counted(response.stream, self, index),
            extensions=response.extensions,
        )

    def _closed(self, index: int) -> None:
        self.open[index] -= 1

    async def aclose(self) -> None:
        for shard in self.shards:
            await shard.aclose()


class _Counted(httpx.AsyncByteStream):
    """A response body that gives its shard's slot back once, when it is closed."""

    def __init__(self, stream: httpx.AsyncByteStream, owner: ShardedTransport, index: int) -> None:
        self._stream = stream
        self._owner = owner
        self._index = index
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._stream:
            yield part

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            if not self._closed:
                self._closed = True
                self._owner._closed(self._index)
