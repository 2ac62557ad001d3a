"""A database outage longer than the Runtime's Room retries: runs caught in it end in the ledger once
the database is back (their end is written again until it lands), instead of staying open until the
Gateway's sweep abandons them minutes later. Nothing is acted on twice."""

from __future__ import annotations

import asyncio

import grpc

from quayutec.ledger import run_id_for
from services.runtime.standin import StandinProvider
from tests.harness.claims import running_claims
from tests.harness.gateway import running_gateway
from tests.harness.postgres import OwnPostgres
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime
from tests.runtime.test_durability import (
    GATEWAY_ENV,
    count_from_database,
    own_database_url,
    wait_all_ended,
    wait_for,
)
from tests.runtime.test_takeover import script_replies
from tests.runtime.world import make_world

__all__ = ["own_database_url"]

WAKES = 10
# The Runtime gives up a Room call after this; the outage is several times longer.
ROOM_RETRY_SECONDS = 1.0
OUTAGE_SECONDS = 6.0
# Far less than the Gateway's sweep (QUAYUTEC_GATEWAY_ABANDON_AFTER_SECONDS, 600 by default): without
# the repeated end, these runs would stay open past it.
END_LIMIT_SECONDS = 45.0


async def test_runs_cut_off_longer_than_their_room_retries_end_when_the_database_is_back(
    own_postgres: OwnPostgres, own_database_url: str, standin: StandinProvider
) -> None:
    channels: list[grpc.aio.Channel] = []
    async with (
        running_claims(own_database_url) as claims_addr,
        running_room(own_database_url) as room_addr,
    ):
        w = await make_world(room_addr, claims_addr, channels)
        script_replies(standin, w, WAKES, delay=2.0)
        try:
            async with (
                running_runtime(
                    claims_addr,
                    room_addr,
                    standin_url=standin.base_url,
                    backend_timeout_seconds=1.0,
                    room_retry_seconds=ROOM_RETRY_SECONDS,
                ) as rt,
                running_gateway(own_database_url, room_addr, rt, **GATEWAY_ENV),
            ):
                posted = await asyncio.gather(
                    *(w.post(f"@planner note {i}", [w.agent_a.agent_id]) for i in range(WAKES))
                )
                run_ids = [run_id_for(p.wakes[0].agent_id, p.wakes[0].wake_id) for p in posted]
                await wait_for(lambda: len(standin.requests(w.model_a)) >= WAKES, limit=30.0)
                # Every run is in its model call: its reply and its end meet the outage.
                await asyncio.to_thread(own_postgres.stop)
                await asyncio.sleep(OUTAGE_SECONDS)
                await asyncio.to_thread(own_postgres.start)
                await wait_all_ended(own_database_url, run_ids, END_LIMIT_SECONDS)
        finally:
            for channel in channels:
                await channel.close()
    acted, lost, doubled, claims = await count_from_database(own_database_url, w, run_ids)
    print(f"\noutage {OUTAGE_SECONDS:g} s: acted {acted}, ended not acted {lost}, doubled {doubled}, claims {claims}")
    assert doubled == 0 and claims == WAKES
    assert len(standin.requests(w.model_a)) == WAKES
