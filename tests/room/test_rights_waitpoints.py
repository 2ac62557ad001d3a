"""Agent rights (company default, per-agent rules, effective rights) and waitpoints (park, decide, expire)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import grpc
from google.protobuf.field_mask_pb2 import FieldMask

from quayutec.v1 import common_pb2, room_pb2
from tests.room.conftest import Stub, World, expect_error

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
DENIED = grpc.StatusCode.PERMISSION_DENIED
FAILED = grpc.StatusCode.FAILED_PRECONDITION

AUTO, HOLD, DENY = common_pb2.ACTION_RIGHT_AUTO, common_pb2.ACTION_RIGHT_HOLD, common_pb2.ACTION_RIGHT_DENY
UNSET = common_pb2.ACTION_RIGHT_UNSPECIFIED
PENDING, APPROVED = common_pb2.DECISION_PENDING, common_pb2.DECISION_APPROVED


async def set_rights(room: Stub, **fields: Any) -> common_pb2.AgentRights:
    request = room_pb2.RoomServiceSetAgentRightsRequest(rights=common_pb2.AgentRights(**fields))
    rights: common_pb2.AgentRights = (await room.SetAgentRights(request)).rights
    return rights


async def get_rights(room: Stub, company_id: str, agent_id: str = "") -> room_pb2.RoomServiceGetAgentRightsResponse:
    request = room_pb2.RoomServiceGetAgentRightsRequest(company_id=company_id, agent_id=agent_id)
    response: room_pb2.RoomServiceGetAgentRightsResponse = await room.GetAgentRights(request)
    return response


def rights_of(r: common_pb2.AgentRights) -> tuple[int, ...]:
    return (r.remember, r.create_task, r.update_task, r.close_task, r.cross_company_task)


def parked_run(world: World, run_id: str, **fields: Any) -> common_pb2.Run:
    base: dict[str, Any] = {
        "run_id": run_id,
        "agent_id": world.acme_agent.agent_id,
        "room_id": world.room_id,
        "wake_id": str(uuid.uuid4()),
        "wake_kind": common_pb2.WAKE_KIND_MESSAGE,
        "status": common_pb2.RUN_STATUS_PARKED,
        "step": common_pb2.RUN_STEP_PARKED,
        "posted_message_id": str(uuid.uuid4()),
    }
    run = common_pb2.Run(**{**base, **fields})
    run.actions.add(index=0, kind=common_pb2.ACTION_KIND_REMEMBER, outcome=common_pb2.ACTION_OUTCOME_DONE)
    run.actions.add(index=1, kind=common_pb2.ACTION_KIND_CREATE_TASK, outcome=common_pb2.ACTION_OUTCOME_HELD)
    run.actions.add(index=2, kind=common_pb2.ACTION_KIND_CLOSE_TASK, outcome=common_pb2.ACTION_OUTCOME_HELD)
    return run


def held_of(run: common_pb2.Run) -> list[common_pb2.HeldAction]:
    return [
        common_pb2.HeldAction(index=a.index, kind=a.kind, arguments_json='{"title": "ship it"}')
        for a in run.actions
        if a.outcome == common_pb2.ACTION_OUTCOME_HELD
    ]


async def park(room: Stub, world: World, run_id: str = "run-park", **fields: Any) -> common_pb2.Waitpoint:
    run = parked_run(world, run_id, **fields)
    request = room_pb2.RoomServiceCreateWaitpointRequest(
        run_id=run_id, held=held_of(run), expires_in_seconds=3600, run=run
    )
    waitpoint: common_pb2.Waitpoint = (await room.CreateWaitpoint(request)).waitpoint
    return waitpoint


async def decide(
    room: Stub, token: str, index: int, company_id: str, approve: bool = True, by: str = "ana"
) -> room_pb2.RoomServiceDecideHeldActionResponse:
    request = room_pb2.RoomServiceDecideHeldActionRequest(
        token=token, index=index, company_id=company_id, decided_by=by, approve=approve
    )
    response: room_pb2.RoomServiceDecideHeldActionResponse = await room.DecideHeldAction(request)
    return response


async def decision_wakes(pool: asyncpg.Pool, token: str) -> list[asyncpg.Record]:
    return list(
        await pool.fetch("SELECT agent_id, room_id FROM wake_outbox WHERE kind = 'decision' AND source_id = $1", token)
    )


# -- agent rights -------------------------------------------------------------------------------------------


async def test_rights_default_to_auto_when_nothing_is_set(room: Stub, world: World) -> None:
    got = await get_rights(room, world.acme.company_id, world.acme_agent.agent_id)
    assert rights_of(got.company_default) == (UNSET,) * 5
    assert rights_of(got.agent) == (UNSET,) * 5 and got.agent.agent_id == world.acme_agent.agent_id
    assert rights_of(got.effective) == (AUTO,) * 5
    default_only = await get_rights(room, world.acme.company_id)
    assert not default_only.HasField("agent") and rights_of(default_only.effective) == (AUTO,) * 5


async def test_agent_rules_override_the_company_default_field_by_field(room: Stub, world: World) -> None:
    acme, agent_id = world.acme.company_id, world.acme_agent.agent_id
    stored = await set_rights(room, company_id=acme, remember=HOLD, create_task=HOLD, cross_company_task=DENY)
    assert stored.agent_id == "" and rights_of(stored) == (HOLD, HOLD, UNSET, UNSET, DENY)
    await set_rights(room, company_id=acme, agent_id=agent_id, create_task=AUTO, close_task=DENY)
    got = await get_rights(room, acme, agent_id)
    assert rights_of(got.company_default) == (HOLD, HOLD, UNSET, UNSET, DENY)
    assert rights_of(got.agent) == (UNSET, AUTO, UNSET, DENY, UNSET)
    assert rights_of(got.effective) == (HOLD, AUTO, AUTO, DENY, DENY)
    # Setting again replaces the whole row: unspecified fields fall back again.
    await set_rights(room, company_id=acme, agent_id=agent_id, update_task=HOLD)
    got = await get_rights(room, acme, agent_id)
    assert rights_of(got.effective) == (HOLD, HOLD, HOLD, AUTO, DENY)
    # Another company's rules do not touch Acme's agent.
    await set_rights(room, company_id=world.bolt.company_id, remember=DENY)
    assert (await get_rights(room, acme, agent_id)).effective.remember == HOLD


async def test_rights_of_an_agent_outside_the_company_are_not_found(room: Stub, world: World) -> None:
    acme = world.acme.company_id
    await expect_error(NOT_FOUND, set_rights(room, company_id=acme, agent_id=world.bolt_agent.agent_id, remember=HOLD))
    await expect_error(NOT_FOUND, get_rights(room, acme, world.bolt_agent.agent_id))
    await expect_error(NOT_FOUND, get_rights(room, acme, str(uuid.uuid4())))
    await expect_error(NOT_FOUND, set_rights(room, company_id=str(uuid.uuid4()), remember=HOLD))
    await expect_error(INVALID, set_rights(room, company_id=acme, remember=7), "remember")
    await expect_error(INVALID, set_rights(room, company_id="acme"))


async def set_masked(room: Stub, paths: list[str], **fields: Any) -> common_pb2.AgentRights:
    request = room_pb2.RoomServiceSetAgentRightsRequest(
        rights=common_pb2.AgentRights(**fields), update_mask=FieldMask(paths=paths)
    )
    rights: common_pb2.AgentRights = (await room.SetAgentRights(request)).rights
    return rights


async def test_an_update_mask_changes_only_the_rights_it_names(room: Stub, world: World) -> None:
    acme, agent_id = world.acme.company_id, world.acme_agent.agent_id
    # A first masked write of an agent's rules sets what it names and nothing else.
    first = await set_masked(room, ["remember"], company_id=acme, agent_id=agent_id, remember=HOLD, close_task=DENY)
    assert rights_of(first) == (HOLD, UNSET, UNSET, UNSET, UNSET)
    second = await set_masked(room, ["create_task"], company_id=acme, agent_id=agent_id, create_task=HOLD)
    assert rights_of(second) == (HOLD, HOLD, UNSET, UNSET, UNSET)
    # A named right sent unspecified is cleared: inherited again.
    cleared = await set_masked(room, ["remember", "close_task"], company_id=acme, agent_id=agent_id, close_task=DENY)
    assert rights_of(cleared) == (UNSET, HOLD, UNSET, DENY, UNSET)
    # Without a mask (an older client), every right is replaced, as before.
    assert rights_of(await set_rights(room, company_id=acme, agent_id=agent_id, update_task=HOLD)) == (
        UNSET,
        UNSET,
        HOLD,
        UNSET,
        UNSET,
    )
    await expect_error(INVALID, set_masked(room, ["remember", "admin"], company_id=acme, remember=HOLD), "admin")
    await expect_error(INVALID, set_masked(room, ["remember"], company_id=acme, remember=HOLD, create_task=9), "create")
    assert rights_of((await get_rights(room, acme)).company_default) == (UNSET,) * 5


async def test_two_writers_of_different_rights_never_undo_each_other(room: Stub, world: World) -> None:
    acme = world.acme.company_id
    for right in (HOLD, DENY, AUTO, HOLD):
        await asyncio.gather(
            *(set_masked(room, ["remember"], company_id=acme, remember=right) for _ in range(4)),
            *(set_masked(room, ["cross_company_task"], company_id=acme, cross_company_task=right) for _ in range(4)),
        )
        stored = (await get_rights(room, acme)).company_default
        assert (stored.remember, stored.cross_company_task) == (right, right)


# -- waitpoints ---------------------------------------------------------------------------------------------


async def test_create_waitpoint_parks_the_run_and_is_idempotent(room: Stub, world: World) -> None:
    wp = await park(room, world)
    assert wp.status == common_pb2.WAITPOINT_STATUS_PENDING
    assert (wp.run_id, wp.agent_id, wp.company_id, wp.room_id) == (
        "run-park",
        world.acme_agent.agent_id,
        world.acme.company_id,
        world.room_id,
    )
    assert [(h.index, h.kind, h.decision) for h in wp.held] == [
        (1, common_pb2.ACTION_KIND_CREATE_TASK, PENDING),
        (2, common_pb2.ACTION_KIND_CLOSE_TASK, PENDING),
    ]
    assert wp.expires_at.seconds - wp.created_at.seconds == 3600
    run = (await room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id="run-park"))).run
    assert (run.status, run.step, run.company_id) == (
        common_pb2.RUN_STATUS_PARKED,
        common_pb2.RUN_STEP_PARKED,
        world.acme.company_id,
    )
    assert await park(room, world) == wp
    got = (await room.GetWaitpoint(room_pb2.RoomServiceGetWaitpointRequest(token=wp.token))).waitpoint
    assert got == wp


async def test_create_waitpoint_writes_nothing_when_it_fails(room: Stub, world: World) -> None:
    # The room does not exist: the ledger row written first in the transaction is rolled back too.
    await expect_error(NOT_FOUND, park(room, world, "run-orphan", room_id=str(uuid.uuid4())), "room")
    await expect_error(NOT_FOUND, room.GetRun(room_pb2.RoomServiceGetRunRequest(run_id="run-orphan")))
    # Without a run to write, the ledger row must exist already.
    request = room_pb2.RoomServiceCreateWaitpointRequest(
        run_id="run-missing", held=held_of(parked_run(world, "x")), expires_in_seconds=60
    )
    await expect_error(NOT_FOUND, room.CreateWaitpoint(request), "run")


async def test_create_waitpoint_checks_its_request(room: Stub, world: World) -> None:
    run = parked_run(world, "run-bad")
    held = held_of(run)

    async def create(**fields: Any) -> Any:
        base: dict[str, Any] = {"run_id": "run-bad", "held": held, "expires_in_seconds": 60, "run": run}
        return await room.CreateWaitpoint(room_pb2.RoomServiceCreateWaitpointRequest(**{**base, **fields}))

    await expect_error(INVALID, create(held=[]), "held")
    await expect_error(INVALID, create(expires_in_seconds=0), "expires_in_seconds")
    await expect_error(INVALID, create(expires_in_seconds=2592001), "expires_in_seconds")
    await expect_error(INVALID, create(held=[held[0], held[0]]), "distinct")
    await expect_error(
        INVALID,
        create(held=[common_pb2.HeldAction(index=1, kind=common_pb2.ACTION_KIND_REMEMBER, arguments_json="{nope")]),
        "JSON",
    )
    await expect_error(INVALID, create(held=[common_pb2.HeldAction(index=1)]), "kind")
    await expect_error(INVALID, create(run_id="other"), "run_id")
    running = parked_run(world, "run-bad", status=common_pb2.RUN_STATUS_RUNNING)
    await expect_error(INVALID, create(run=running), "PARKED")


async def test_a_run_that_ended_cannot_park(room: Stub, world: World) -> None:
    ended = parked_run(world, "run-ended", status=common_pb2.RUN_STATUS_SUCCEEDED, step=common_pb2.RUN_STEP_ENDED)
    ended.ended_at.GetCurrentTime()
    await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=ended))
    await expect_error(FAILED, park(room, world, "run-ended"), "ended")


async def test_deciding_every_held_action_completes_the_token_with_one_wake(
    room: Stub, world: World, pool: asyncpg.Pool
) -> None:
    wp = await park(room, world)
    acme = world.acme.company_id
    first = await decide(room, wp.token, 1, acme, approve=True, by="ana")
    assert not first.completed and not first.already_decided
    assert first.waitpoint.status == common_pb2.WAITPOINT_STATUS_PENDING
    assert first.waitpoint.held[0].decision == APPROVED and first.waitpoint.held[0].decided_by == "ana"
    assert first.waitpoint.held[0].decided_at.seconds > 0
    assert await decision_wakes(pool, wp.token) == []
    # The same decision again changes nothing; the other way is refused.
    again = await decide(room, wp.token, 1, acme, approve=True, by="bea")
    assert again.already_decided and not again.completed and again.waitpoint.held[0].decided_by == "ana"
    await expect_error(FAILED, decide(room, wp.token, 1, acme, approve=False), "approved")
    last = await decide(room, wp.token, 2, acme, approve=False, by="bea")
    assert last.completed and last.waitpoint.status == common_pb2.WAITPOINT_STATUS_COMPLETED
    assert [h.decision for h in last.waitpoint.held] == [APPROVED, common_pb2.DECISION_DENIED]
    wakes = await decision_wakes(pool, wp.token)
    assert [(str(w["agent_id"]), str(w["room_id"])) for w in wakes] == [(world.acme_agent.agent_id, world.room_id)]
    repeat = await decide(room, wp.token, 2, acme, approve=False)
    assert repeat.already_decided and not repeat.completed
    assert len(await decision_wakes(pool, wp.token)) == 1


async def test_only_the_owning_company_decides(room: Stub, world: World, pool: asyncpg.Pool) -> None:
    wp = await park(room, world)
    # Another company's real token is answered exactly as a made-up one: no oracle of what exists.
    made_up = str(uuid.uuid4())
    unknown = await expect_error(NOT_FOUND, decide(room, made_up, 1, world.acme.company_id))
    for index in (1, 99):
        foreign = await expect_error(NOT_FOUND, decide(room, wp.token, index, world.bolt.company_id))
        assert foreign.replace(wp.token, "<token>") == unknown.replace(made_up, "<token>")
    await expect_error(NOT_FOUND, decide(room, wp.token, 99, world.acme.company_id), "index")
    await expect_error(INVALID, decide(room, wp.token, 1, world.acme.company_id, by=""), "decided_by")
    got = (await room.GetWaitpoint(room_pb2.RoomServiceGetWaitpointRequest(token=wp.token))).waitpoint
    assert [h.decision for h in got.held] == [PENDING, PENDING]


async def test_concurrent_last_decisions_complete_the_token_once(room: Stub, world: World, pool: asyncpg.Pool) -> None:
    wp = await park(room, world)
    acme = world.acme.company_id
    await decide(room, wp.token, 1, acme)
    results = await asyncio.gather(*(decide(room, wp.token, 2, acme, by=f"p{i}") for i in range(20)))
    assert sum(r.completed for r in results) == 1
    assert sum(r.already_decided for r in results) == 19
    assert len(await decision_wakes(pool, wp.token)) == 1
    assert await pool.fetchval("SELECT count(*) FROM wake_outbox WHERE kind = 'decision'") == 1


async def test_expired_tokens_end_with_one_wake_each(room: Stub, world: World, pool: asyncpg.Pool) -> None:
    old = await park(room, world, "run-old")
    fresh = await park(room, world, "run-fresh")
    await pool.execute("UPDATE waitpoints SET expires_at = now() - interval '1 minute' WHERE token = $1", old.token)
    expire = room_pb2.RoomServiceExpireWaitpointsRequest()
    assert (await room.ExpireWaitpoints(expire)).expired == 1
    assert (await room.ExpireWaitpoints(expire)).expired == 0
    got = (await room.GetWaitpoint(room_pb2.RoomServiceGetWaitpointRequest(token=old.token))).waitpoint
    assert got.status == common_pb2.WAITPOINT_STATUS_EXPIRED
    assert len(await decision_wakes(pool, old.token)) == 1
    await expect_error(FAILED, decide(room, old.token, 1, world.acme.company_id), "expired")
    still = (await room.GetWaitpoint(room_pb2.RoomServiceGetWaitpointRequest(token=fresh.token))).waitpoint
    assert still.status == common_pb2.WAITPOINT_STATUS_PENDING and await decision_wakes(pool, fresh.token) == []
    await expect_error(INVALID, room.ExpireWaitpoints(room_pb2.RoomServiceExpireWaitpointsRequest(limit=1001)))


async def test_a_decision_after_expiry_expires_the_token(room: Stub, world: World, pool: asyncpg.Pool) -> None:
    wp = await park(room, world)
    await pool.execute("UPDATE waitpoints SET expires_at = now() - interval '1 second' WHERE token = $1", wp.token)
    await expect_error(FAILED, decide(room, wp.token, 1, world.acme.company_id), "expired")
    got = (await room.GetWaitpoint(room_pb2.RoomServiceGetWaitpointRequest(token=wp.token))).waitpoint
    assert got.status == common_pb2.WAITPOINT_STATUS_EXPIRED and got.held[0].decision == PENDING
    assert len(await decision_wakes(pool, wp.token)) == 1
    assert (await room.ExpireWaitpoints(room_pb2.RoomServiceExpireWaitpointsRequest())).expired == 0


async def test_list_waitpoints_pages_a_company_s_pending_approvals(room: Stub, world: World) -> None:
    tokens = [(await park(room, world, f"run-{i}")).token for i in range(5)]
    await park(room, world, "run-bolt", agent_id=world.bolt_agent.agent_id)
    acme = world.acme.company_id
    for index in (1, 2):
        await decide(room, tokens[0], index, acme)
    seen: list[str] = []
    page_token = ""
    while True:
        page = await room.ListWaitpoints(
            room_pb2.RoomServiceListWaitpointsRequest(company_id=acme, page_size=2, page_token=page_token)
        )
        seen += [w.token for w in page.waitpoints]
        assert all(len(w.held) == 2 for w in page.waitpoints)
        page_token = page.next_page_token
        if not page_token:
            break
    assert seen == tokens[1:]
    done = await room.ListWaitpoints(
        room_pb2.RoomServiceListWaitpointsRequest(company_id=acme, status=common_pb2.WAITPOINT_STATUS_COMPLETED)
    )
    assert [w.token for w in done.waitpoints] == tokens[:1]
    bolt = await room.ListWaitpoints(room_pb2.RoomServiceListWaitpointsRequest(company_id=world.bolt.company_id))
    assert [w.run_id for w in bolt.waitpoints] == ["run-bolt"]
    await expect_error(
        INVALID,
        room.ListWaitpoints(
            room_pb2.RoomServiceListWaitpointsRequest(company_id=acme, status=common_pb2.WaitpointStatus.ValueType(9))
        ),
    )
