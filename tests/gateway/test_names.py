"""Names that stay unique, renames, a retired agent, an archived room (issue 49), through the Gateway's
API against a real Room and PostgreSQL: the Room's rules decide who may, and another company's id is
answered exactly as a made-up one."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import asyncpg
import grpc

from quayutec.v1 import common_pb2, gateway_pb2
from tests.gateway.helpers import GatewayStub, create_room, expect_error, register_agent
from tests.harness.gateway import CompanyKey

EXISTS = grpc.StatusCode.ALREADY_EXISTS
NOT_FOUND = grpc.StatusCode.NOT_FOUND
DENIED = grpc.StatusCode.PERMISSION_DENIED
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def _agent(name: str, key: str = "") -> gateway_pb2.RegisterAgentRequest:
    return gateway_pb2.RegisterAgentRequest(
        name=name, provider=common_pb2.PROVIDER_ANTHROPIC, model="m", provider_key="sk-test", idempotency_key=key
    )


async def _invite(gw: GatewayStub, room_id: str, company_id: str) -> common_pb2.Invitation:
    got = await gw.InviteCompany(gateway_pb2.InviteCompanyRequest(room_id=room_id, company_id=company_id), timeout=10)
    invitation: common_pb2.Invitation = got.invitation
    return invitation


async def _join(inviter: GatewayStub, joiner: GatewayStub, room_id: str, company_id: str) -> None:
    invitation = await _invite(inviter, room_id, company_id)
    await joiner.AcceptInvitation(
        gateway_pb2.AcceptInvitationRequest(invitation_id=invitation.invitation_id), timeout=10
    )


async def test_a_second_room_or_agent_of_a_name_is_already_exists_naming_the_first(
    acme_gw: GatewayStub, globex_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw, "launch")
    failed = await expect_error(
        EXISTS, acme_gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="  LAUNCH "), timeout=10), room.room_id
    )
    assert "'launch'" in (failed.details() or "")
    # Another company's rooms are another scope.
    theirs = await create_room(globex_gw, "launch")
    assert theirs.room_id != room.room_id

    agent = await register_agent(acme_gw, "planner")
    failed = await expect_error(EXISTS, acme_gw.RegisterAgent(_agent(" Planner"), timeout=10), agent.agent_id)
    assert "'planner'" in (failed.details() or "")
    assert (await register_agent(globex_gw, "planner")).agent_id != agent.agent_id

    # Names are stored trimmed.
    spaced = await create_room(acme_gw, "  padded  ")
    assert spaced.name == "padded"
    listed = await acme_gw.ListRooms(gateway_pb2.ListRoomsRequest(page_size=500), timeout=10)
    assert sorted(r.name for r in listed.rooms) == ["launch", "padded"]
    agents = await acme_gw.ListAgents(gateway_pb2.ListAgentsRequest(page_size=500), timeout=10)
    assert [a.name for a in agents.agents] == ["planner"]


async def test_a_create_retried_with_its_idempotency_key_answers_the_first_not_already_exists(
    acme_gw: GatewayStub,
) -> None:
    key = f"names-{uuid.uuid4()}"
    first = await acme_gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="keyed", idempotency_key=key), timeout=10)
    again = await acme_gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="keyed", idempotency_key=key), timeout=10)
    assert again.room.room_id == first.room.room_id
    other_key = gateway_pb2.CreateRoomRequest(name="keyed", idempotency_key=f"{key}-other")
    await expect_error(EXISTS, acme_gw.CreateRoom(other_key, timeout=10), first.room.room_id)

    agent = await acme_gw.RegisterAgent(_agent("scribe", key), timeout=10)
    repeat = await acme_gw.RegisterAgent(_agent("scribe", key), timeout=10)
    assert repeat.agent.agent_id == agent.agent.agent_id
    await expect_error(EXISTS, acme_gw.RegisterAgent(_agent("scribe", f"{key}-other"), timeout=10), "scribe")


async def test_rooms_and_agents_are_renamed_and_a_taken_name_is_refused(
    acme_gw: GatewayStub, globex_gw: GatewayStub, globex: CompanyKey
) -> None:
    room = await create_room(acme_gw, "launch")
    other = await create_room(acme_gw, "other")
    rename = gateway_pb2.RenameRoomRequest(room_id=room.room_id, name=" liftoff ")
    renamed = await acme_gw.RenameRoom(rename, timeout=10)
    assert renamed.room.name == "liftoff" and renamed.room.room_id == room.room_id
    listed = await acme_gw.ListRooms(gateway_pb2.ListRoomsRequest(page_size=500), timeout=10)
    assert sorted(r.name for r in listed.rooms) == ["liftoff", "other"]
    taken = gateway_pb2.RenameRoomRequest(room_id=room.room_id, name="OTHER")
    await expect_error(EXISTS, acme_gw.RenameRoom(taken, timeout=10), other.room_id)
    # The old name is free again.
    assert (await create_room(acme_gw, "launch")).name == "launch"

    agent = await register_agent(acme_gw, "planner")
    second = await register_agent(acme_gw, "writer")
    moved = await acme_gw.RenameAgent(gateway_pb2.RenameAgentRequest(agent_id=agent.agent_id, name="lead"), timeout=10)
    assert moved.agent.name == "lead"
    clash = gateway_pb2.RenameAgentRequest(agent_id=agent.agent_id, name="Writer")
    await expect_error(EXISTS, acme_gw.RenameAgent(clash, timeout=10), second.agent_id)
    assert (await register_agent(acme_gw, "planner")).name == "planner"

    # A member company that did not create the room may not rename or archive it.
    await _join(acme_gw, globex_gw, room.room_id, globex.company_id)
    by_member = gateway_pb2.RenameRoomRequest(room_id=room.room_id, name="mine")
    await expect_error(DENIED, globex_gw.RenameRoom(by_member, timeout=10), "only the company that created room")
    archive = gateway_pb2.ArchiveRoomRequest(room_id=room.room_id)
    await expect_error(DENIED, globex_gw.ArchiveRoom(archive, timeout=10), "only the company that created room")


async def test_another_companys_agent_or_room_answers_as_a_made_up_id(
    acme_gw: GatewayStub, initech_gw: GatewayStub
) -> None:
    agent = await register_agent(acme_gw, "planner")
    room = await create_room(acme_gw, "launch")
    made_up = str(uuid.uuid4())
    gw = initech_gw

    async def refusal(call: Awaitable[object], real: str) -> tuple[grpc.StatusCode, str]:
        err = await expect_error(NOT_FOUND, call)
        return err.code(), (err.details() or "").replace(real, "<id>")

    calls: list[tuple[str, Callable[[str], Awaitable[object]]]] = [
        (agent.agent_id, lambda a: gw.RenameAgent(gateway_pb2.RenameAgentRequest(agent_id=a, name="x"), timeout=10)),
        (agent.agent_id, lambda a: gw.RetireAgent(gateway_pb2.RetireAgentRequest(agent_id=a), timeout=10)),
        (room.room_id, lambda r: gw.RenameRoom(gateway_pb2.RenameRoomRequest(room_id=r, name="x"), timeout=10)),
        (room.room_id, lambda r: gw.ArchiveRoom(gateway_pb2.ArchiveRoomRequest(room_id=r), timeout=10)),
    ]
    for real, call in calls:
        assert await refusal(call(real), real) == await refusal(call(made_up), made_up)
    # Nothing changed.
    agents = await acme_gw.ListAgents(gateway_pb2.ListAgentsRequest(), timeout=10)
    assert [(a.name, a.HasField("retired_at")) for a in agents.agents] == [("planner", False)]
    rooms = await acme_gw.ListRooms(gateway_pb2.ListRoomsRequest(), timeout=10)
    assert [(r.name, r.HasField("archived_at")) for r in rooms.rooms] == [("launch", False)]


async def test_a_retired_agent_wakes_no_more_and_its_record_stays(acme_gw: GatewayStub, database_url: str) -> None:
    agent = await register_agent(acme_gw, "planner")
    other = await register_agent(acme_gw, "writer")
    room = await create_room(acme_gw, "launch")
    before = await acme_gw.PostMessage(
        gateway_pb2.PostMessageRequest(
            room_id=room.room_id, person="ana", body="@planner hi", mention_agent_ids=[agent.agent_id]
        ),
        timeout=10,
    )
    assert len(before.wake_ids) == 1

    retired = await acme_gw.RetireAgent(gateway_pb2.RetireAgentRequest(agent_id=agent.agent_id), timeout=10)
    assert retired.agent.HasField("retired_at") and retired.agent.name == "planner"
    again = await acme_gw.RetireAgent(gateway_pb2.RetireAgentRequest(agent_id=agent.agent_id), timeout=10)
    assert again.agent.retired_at == retired.agent.retired_at

    # A post mentioning it is accepted and wakes only the agents that are not retired.
    after = await acme_gw.PostMessage(
        gateway_pb2.PostMessageRequest(
            room_id=room.room_id,
            person="ana",
            body="@planner @writer again",
            mention_agent_ids=[agent.agent_id, other.agent_id],
        ),
        timeout=10,
    )
    assert after.message.mention_agent_ids == [agent.agent_id, other.agent_id]
    assert len(after.wake_ids) == 1
    # The wakes of the others keep the mentions' order, the retired one left out.
    third = await register_agent(acme_gw, "reader")
    mentions = [other.agent_id, agent.agent_id, third.agent_id]
    ordered = await acme_gw.PostMessage(
        gateway_pb2.PostMessageRequest(room_id=room.room_id, person="ana", body="all", mention_agent_ids=mentions),
        timeout=10,
    )
    task = await acme_gw.SendTask(
        gateway_pb2.SendTaskRequest(room_id=room.room_id, person="ana", to_agent_id=agent.agent_id, title="t"),
        timeout=10,
    )
    assert task.task.task_id and list(task.wake_ids) == []

    conn = await asyncpg.connect(database_url)
    try:
        woken = await conn.fetch(
            "SELECT agent_id::text, delivered_at IS NOT NULL AS settled, last_error FROM wake_outbox"
            " WHERE agent_id = $1::uuid",
            agent.agent_id,
        )
        woken_for = {
            str(r["wake_id"]): str(r["agent_id"])
            for r in await conn.fetch(
                "SELECT wake_id, agent_id FROM wake_outbox WHERE source_id = $1", ordered.message.message_id
            )
        }
    finally:
        await conn.close()
    assert [woken_for[w] for w in ordered.wake_ids] == [other.agent_id, third.agent_id]
    # Its one wake, from before: settled by the retirement unless its delivery had begun.
    assert len(woken) == 1 and woken[0]["settled"]

    # Its record stays: listed, retired, and the messages that mention it.
    listed = await acme_gw.ListAgents(gateway_pb2.ListAgentsRequest(), timeout=10)
    assert {a.name: a.HasField("retired_at") for a in listed.agents} == {
        "planner": True,
        "writer": False,
        "reader": False,
    }
    messages = await acme_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)
    assert [m.message_id for m in messages.messages][:2] == [before.message.message_id, after.message.message_id]
    # Its name stays taken until it is renamed.
    await expect_error(EXISTS, acme_gw.RegisterAgent(_agent("planner"), timeout=10), agent.agent_id)
    await acme_gw.RenameAgent(gateway_pb2.RenameAgentRequest(agent_id=agent.agent_id, name="planner (old)"), timeout=10)
    assert (await register_agent(acme_gw, "planner")).agent_id != agent.agent_id


async def test_an_archived_room_refuses_writes_and_keeps_its_history(
    acme_gw: GatewayStub, globex_gw: GatewayStub, initech: CompanyKey, globex: CompanyKey
) -> None:
    agent = await register_agent(acme_gw, "planner")
    room = await create_room(acme_gw, "launch")
    key = f"post-{uuid.uuid4()}"
    post = gateway_pb2.PostMessageRequest(room_id=room.room_id, person="ana", body="first", idempotency_key=key)
    first = await acme_gw.PostMessage(post, timeout=10)
    task = await acme_gw.SendTask(
        gateway_pb2.SendTaskRequest(room_id=room.room_id, person="ana", to_agent_id=agent.agent_id, title="t"),
        timeout=10,
    )
    await acme_gw.UploadFile(
        gateway_pb2.UploadFileRequest(room_id=room.room_id, person="ana", name="a.txt", content=b"alpha"), timeout=10
    )
    await _join(acme_gw, globex_gw, room.room_id, globex.company_id)
    pending = await _invite(acme_gw, room.room_id, initech.company_id)

    archived = await acme_gw.ArchiveRoom(gateway_pb2.ArchiveRoomRequest(room_id=room.room_id), timeout=10)
    assert archived.room.HasField("archived_at") and archived.room.name == "launch"
    again = await acme_gw.ArchiveRoom(gateway_pb2.ArchiveRoomRequest(room_id=room.room_id), timeout=10)
    assert again.room.archived_at == archived.room.archived_at

    says = f"room {room.room_id} is archived"
    writes = [
        acme_gw.PostMessage(gateway_pb2.PostMessageRequest(room_id=room.room_id, person="ana", body="x"), timeout=10),
        globex_gw.PostMessage(gateway_pb2.PostMessageRequest(room_id=room.room_id, person="bo", body="x"), timeout=10),
        acme_gw.SendTask(
            gateway_pb2.SendTaskRequest(room_id=room.room_id, person="ana", to_agent_id=agent.agent_id, title="u"),
            timeout=10,
        ),
        acme_gw.UpdateTask(
            gateway_pb2.UpdateTaskRequest(room_id=room.room_id, task_id=task.task.task_id, person="ana", note="n"),
            timeout=10,
        ),
        acme_gw.UploadFile(
            gateway_pb2.UploadFileRequest(room_id=room.room_id, person="ana", name="b.txt", content=b"b"), timeout=10
        ),
        acme_gw.InviteCompany(
            gateway_pb2.InviteCompanyRequest(room_id=room.room_id, company_id=initech.company_id), timeout=10
        ),
    ]
    for write in writes:
        await expect_error(PRECONDITION, write, says)
    # A retry of a write made before the archiving answers that write.
    assert (await acme_gw.PostMessage(post, timeout=10)).message.message_id == first.message.message_id

    # Its pending invitation was withdrawn.
    invitations = await acme_gw.ListRoomInvitations(
        gateway_pb2.ListRoomInvitationsRequest(room_id=room.room_id, status=common_pb2.INVITATION_STATUS_WITHDRAWN),
        timeout=10,
    )
    assert [i.invitation_id for i in invitations.invitations] == [pending.invitation_id]

    # Its history stays readable, to every member.
    for gw in (acme_gw, globex_gw):
        messages = await gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)
        assert [m.body for m in messages.messages] == ["first"]
        tasks = await gw.ListTasks(gateway_pb2.ListTasksRequest(room_id=room.room_id), timeout=10)
        assert [t.title for t in tasks.tasks] == ["t"]
        files = await gw.ListFiles(gateway_pb2.ListFilesRequest(room_id=room.room_id), timeout=10)
        assert [f.name for f in files.files] == ["a.txt"]
        rooms = await gw.ListRooms(gateway_pb2.ListRoomsRequest(), timeout=10)
        assert [r.HasField("archived_at") for r in rooms.rooms if r.room_id == room.room_id] == [True]
    # Its creator may still rename it (to free its name).
    renamed = await acme_gw.RenameRoom(gateway_pb2.RenameRoomRequest(room_id=room.room_id, name="launch 1"), timeout=10)
    assert renamed.room.name == "launch 1"
    assert (await create_room(acme_gw, "launch")).name == "launch"
