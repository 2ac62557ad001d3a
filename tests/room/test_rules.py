"""The room's rules (services/room/rules.py) at the Room itself: each rule refuses whoever the author is
(a person or an agent), with its code, its words and its id in the ``quayutec-rule`` trailer, and nothing
is written. docs/rules.md writes the same table out."""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import asyncpg
import grpc

from quayutec.errors import broken_rule
from quayutec.v1 import common_pb2, room_pb2
from services.room.rules import RULES
from tests.harness.room import add_member, room_state
from tests.room.conftest import Stub, World, agent_author, person

DOC = Path(__file__).resolve().parents[2] / "docs" / "rules.md"
NOT_FOUND, DENIED = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED
FAILED = grpc.StatusCode.FAILED_PRECONDITION


async def refused(call: Awaitable[Any], code: grpc.StatusCode, rule: str) -> str:
    """Awaits ``call``; it must be refused by ``rule`` with ``code``. Returns the rule's words."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        assert (exc.code(), broken_rule(exc)) == (code, rule), (exc.code(), exc.details(), exc.trailing_metadata())
        return exc.details() or ""
    raise AssertionError(f"expected {rule} to refuse it with {code.name}; it succeeded")


def test_docs_write_out_the_table() -> None:
    """docs/rules.md has one row per object, action and rule of RULES, with the same words and code."""
    rows = set()
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and re.fullmatch(r"`[a-z-]+`", cells[3]):
            rows.add((cells[0], cells[1], cells[2], cells[3].strip("`"), cells[4]))
    table = {(act.object, act.action, rule.who, rule.rule_id, rule.code.name) for rule in RULES for act in rule.acts}
    assert rows == table


def write_calls(room: Stub, world: World, author: common_pb2.Author, task_id: str) -> list[Awaitable[Any]]:
    """One write of each kind a member may make to a room's content, by ``author``."""
    r = room_pb2
    create = r.RoomServiceCreateTaskRequest(room_id=world.room_id, to_agent_id=world.acme_agent.agent_id, title="t")
    getattr(create, "from").CopyFrom(author)
    return [
        room.PostMessage(r.RoomServicePostMessageRequest(room_id=world.room_id, author=author, body="hi")),
        room.CreateTask(create),
        room.UpdateTask(r.RoomServiceUpdateTaskRequest(task_id=task_id, author=author, note="mine now")),
        room.UpdateTask(
            r.RoomServiceUpdateTaskRequest(task_id=task_id, author=author, status=common_pb2.TASK_STATUS_CANCELLED)
        ),
        room.WriteMemory(
            r.RoomServiceWriteMemoryRequest(
                room_id=world.room_id, author=author, text="x", visibility=common_pb2.MEMORY_VISIBILITY_ROOM
            )
        ),
        room.UploadFile(r.RoomServiceUploadFileRequest(room_id=world.room_id, author=author, name="a", content=b"a")),
    ]


async def send_task(room: Stub, world: World, sender: common_pb2.Author, to_agent_id: str) -> str:
    create = room_pb2.RoomServiceCreateTaskRequest(room_id=world.room_id, to_agent_id=to_agent_id, title="job")
    getattr(create, "from").CopyFrom(sender)
    return str((await room.CreateTask(create)).task.task_id)


async def test_member_writes(room: Stub, world: World, pool: asyncpg.Pool) -> None:
    task_id = await send_task(room, world, person(world.acme.company_id), world.acme_agent.agent_id)
    before = await room_state(pool)
    for author in (person(world.crow.company_id), agent_author(world.crow_agent)):
        for call in write_calls(room, world, author, task_id):
            words = await refused(call, DENIED, "member-writes")
            assert f"company {world.crow.company_id} is not a member of room {world.room_id}" == words
    assert await room_state(pool) == before


async def test_mentions_in_room(room: Stub, world: World, pool: asyncpg.Pool) -> None:
    before = await room_state(pool)
    for author in (person(world.acme.company_id), agent_author(world.bolt_agent)):
        for outsider in (world.crow_agent.agent_id, str(uuid.uuid4())):
            request = room_pb2.RoomServicePostMessageRequest(
                room_id=world.room_id, author=author, body="hi", mention_agent_ids=[world.bolt_agent.agent_id, outsider]
            )
            words = await refused(room.PostMessage(request), NOT_FOUND, "mentions-in-room")
            assert outsider in words
    assert await room_state(pool) == before


async def test_assignee_in_room(room: Stub, world: World, pool: asyncpg.Pool) -> None:
    before = await room_state(pool)
    for author in (person(world.acme.company_id), agent_author(world.acme_agent)):
        for outsider in (world.crow_agent.agent_id, str(uuid.uuid4())):
            words = await refused(send_task(room, world, author, outsider), NOT_FOUND, "assignee-in-room")
            assert outsider in words and "unknown, or its company is not a member" in words
    assert await room_state(pool) == before


async def test_task_sender_or_assignee_with_three_companies(room: Stub, world: World, pool: asyncpg.Pool) -> None:
    """A task from Acme to its own agent, and one from Acme to Crow's agent: Bolt, a member, may touch
    neither, by a person or by its agent; the sender's and the assignee's companies may."""
    await add_member(room, world.room_id, world.crow.company_id, invited_by=world.acme.company_id)
    acme_to_acme = await send_task(room, world, person(world.acme.company_id), world.acme_agent.agent_id)
    acme_to_crow = await send_task(room, world, person(world.acme.company_id), world.crow_agent.agent_id)
    before = await room_state(pool)
    for author in (person(world.bolt.company_id), agent_author(world.bolt_agent)):
        for task_id in (acme_to_acme, acme_to_crow):
            for fields in ({"note": "B was here"}, {"status": common_pb2.TASK_STATUS_CANCELLED}):
                update = room_pb2.RoomServiceUpdateTaskRequest(task_id=task_id, author=author, **fields)
                words = await refused(room.UpdateTask(update), DENIED, "task-sender-or-assignee")
                assert f"company {world.bolt.company_id} is neither" in words
    assert await room_state(pool) == before

    allowed = [
        (acme_to_acme, agent_author(world.acme_agent)),  # the assignee (and sender) company's agent
        (acme_to_crow, agent_author(world.crow_agent)),  # the assignee
        (acme_to_crow, person(world.acme.company_id)),  # the sender's company
    ]
    for task_id, author in allowed:
        update = room_pb2.RoomServiceUpdateTaskRequest(task_id=task_id, author=author, note="fine")
        assert (await room.UpdateTask(update)).update.note == "fine"
    # Closed by its assignee, the task still answers Bolt with the rule, not with its state.
    close = room_pb2.RoomServiceUpdateTaskRequest(
        task_id=acme_to_crow, author=agent_author(world.crow_agent), status=common_pb2.TASK_STATUS_DONE
    )
    await room.UpdateTask(close)
    bolt_note = room_pb2.RoomServiceUpdateTaskRequest(
        task_id=acme_to_crow, author=agent_author(world.bolt_agent), note="late"
    )
    await refused(room.UpdateTask(bolt_note), DENIED, "task-sender-or-assignee")


async def park(room: Stub, world: World) -> str:
    """A parked run of Acme's agent holding one action; its waitpoint token."""
    run = common_pb2.Run(
        run_id=f"run-{uuid.uuid4()}",
        agent_id=world.acme_agent.agent_id,
        room_id=world.room_id,
        wake_id=str(uuid.uuid4()),
        wake_kind=common_pb2.WAKE_KIND_MESSAGE,
        status=common_pb2.RUN_STATUS_PARKED,
        step=common_pb2.RUN_STEP_PARKED,
    )
    run.actions.add(index=0, kind=common_pb2.ACTION_KIND_REMEMBER, outcome=common_pb2.ACTION_OUTCOME_HELD)
    held = [common_pb2.HeldAction(index=0, kind=common_pb2.ACTION_KIND_REMEMBER, arguments_json="{}")]
    created = await room.CreateWaitpoint(
        room_pb2.RoomServiceCreateWaitpointRequest(run_id=run.run_id, held=held, expires_in_seconds=3600, run=run)
    )
    return str(created.waitpoint.token)


async def test_approval_owner_answers_another_companys_token_as_a_made_up_one(
    room: Stub, world: World, pool: asyncpg.Pool
) -> None:
    token = await park(room, world)
    made_up = str(uuid.uuid4())
    before = await room_state(pool)

    def decide(t: str, company_id: str, index: int, approve: bool) -> Awaitable[Any]:
        call: Awaitable[Any] = room.DecideHeldAction(
            room_pb2.RoomServiceDecideHeldActionRequest(
                token=t, index=index, company_id=company_id, decided_by="bo", approve=approve
            )
        )
        return call

    for index in (0, 7):
        for approve in (True, False):
            unknown = await refused(decide(made_up, world.bolt.company_id, index, approve), NOT_FOUND, "approval-owner")
            foreign = await refused(decide(token, world.bolt.company_id, index, approve), NOT_FOUND, "approval-owner")
            assert foreign.replace(token, "<t>") == unknown.replace(made_up, "<t>")
    assert await room_state(pool) == before
    assert (await decide(token, world.acme.company_id, 0, True)).completed


async def test_membership_rules(room: Stub, world: World, pool: asyncpg.Pool) -> None:
    acme, bolt, crow = world.acme.company_id, world.bolt.company_id, world.crow.company_id
    r = room_pb2
    invitation = (
        await room.CreateInvitation(
            r.RoomServiceCreateInvitationRequest(room_id=world.room_id, company_id=crow, invited_by_company_id=acme)
        )
    ).invitation
    before = await room_state(pool)
    # Crow is not a member: it invites, leaves and removes nothing; the room is as if it did not exist.
    invite = r.RoomServiceCreateInvitationRequest(room_id=world.room_id, company_id=bolt, invited_by_company_id=crow)
    await refused(room.CreateInvitation(invite), NOT_FOUND, "member-manages")
    leave = r.RoomServiceLeaveRoomRequest(room_id=world.room_id, company_id=crow)
    await refused(room.LeaveRoom(leave), NOT_FOUND, "member-manages")
    remove = r.RoomServiceRemoveMemberRequest(room_id=world.room_id, company_id=bolt, removed_by_company_id=crow)
    await refused(room.RemoveMember(remove), NOT_FOUND, "member-manages")
    # Only the invited company answers its invitation, and an unknown one reads the same.
    for invitation_id in (invitation.invitation_id, str(uuid.uuid4())):
        answers = [
            room.AcceptInvitation(r.RoomServiceAcceptInvitationRequest(invitation_id=invitation_id, company_id=bolt)),
            room.DeclineInvitation(r.RoomServiceDeclineInvitationRequest(invitation_id=invitation_id, company_id=bolt)),
        ]
        for answer in answers:
            words = await refused(answer, NOT_FOUND, "invitee-answers")
            assert words == f"invitation {invitation_id} not found among your company's invitations"
    creator_leaves = r.RoomServiceLeaveRoomRequest(room_id=world.room_id, company_id=acme)
    await refused(room.LeaveRoom(creator_leaves), FAILED, "creator-stays")
    by_bolt = r.RoomServiceRemoveMemberRequest(room_id=world.room_id, company_id=acme, removed_by_company_id=bolt)
    await refused(room.RemoveMember(by_bolt), DENIED, "creator-removes")
    itself = r.RoomServiceRemoveMemberRequest(room_id=world.room_id, company_id=acme, removed_by_company_id=acme)
    await refused(room.RemoveMember(itself), FAILED, "creator-not-removed")
    # A room's invitations: listed and withdrawn by its creator (or, withdrawn, by their sender) only.
    listing = r.RoomServiceListRoomInvitationsRequest(room_id=world.room_id, company_id=crow)
    await refused(room.ListRoomInvitations(listing), NOT_FOUND, "member-manages")
    listing = r.RoomServiceListRoomInvitationsRequest(room_id=world.room_id, company_id=bolt)
    await refused(room.ListRoomInvitations(listing), DENIED, "creator-manages-invitations")
    by_bolt_withdraw = r.RoomServiceWithdrawInvitationRequest(invitation_id=invitation.invitation_id, company_id=bolt)
    await refused(room.WithdrawInvitation(by_bolt_withdraw), DENIED, "creator-manages-invitations")
    assert await room_state(pool) == before


async def test_own_agent_rights(room: Stub, world: World, pool: asyncpg.Pool) -> None:
    before = await room_state(pool)
    for agent_id in (world.bolt_agent.agent_id, str(uuid.uuid4())):
        rights = common_pb2.AgentRights(
            company_id=world.acme.company_id, agent_id=agent_id, remember=common_pb2.ACTION_RIGHT_DENY
        )
        words = await refused(
            room.SetAgentRights(room_pb2.RoomServiceSetAgentRightsRequest(rights=rights)), NOT_FOUND, "own-agent-rights"
        )
        assert words == f"agent {agent_id} not found in company {world.acme.company_id}"
        get = room_pb2.RoomServiceGetAgentRightsRequest(company_id=world.acme.company_id, agent_id=agent_id)
        await refused(room.GetAgentRights(get), NOT_FOUND, "own-agent-rights")
    assert await room_state(pool) == before
