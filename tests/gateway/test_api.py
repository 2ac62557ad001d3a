"""Every GatewayService RPC through the public door, against a real Room: happy paths and errors."""

from __future__ import annotations

import uuid
from typing import Any

import grpc

from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc
from tests.gateway.helpers import GatewayStub, create_room, expect_error, register_agent
from tests.harness.channels import service_channel
from tests.harness.gateway import CompanyKey, join_room

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND


async def test_who_am_i(acme_gw: GatewayStub, acme: CompanyKey) -> None:
    response = await acme_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)
    assert response.company.company_id == acme.company_id
    assert response.company.name == "Acme"


async def test_create_and_list_rooms(acme_gw: GatewayStub, globex_gw: GatewayStub, acme: CompanyKey) -> None:
    rooms = [await create_room(acme_gw, f"room {n}") for n in range(3)]
    assert rooms[0].created_by_company_id == acme.company_id and rooms[0].name == "room 0"
    first = await acme_gw.ListRooms(gateway_pb2.ListRoomsRequest(page_size=2), timeout=10)
    assert len(first.rooms) == 2 and first.next_page_token
    rest = await acme_gw.ListRooms(gateway_pb2.ListRoomsRequest(page_token=first.next_page_token), timeout=10)
    listed = {r.room_id for r in (*first.rooms, *rest.rooms)}
    assert listed == {r.room_id for r in rooms}
    assert not (await globex_gw.ListRooms(gateway_pb2.ListRoomsRequest(), timeout=10)).rooms

    await expect_error(INVALID, acme_gw.CreateRoom(gateway_pb2.CreateRoomRequest(name=" "), timeout=10), "name")
    await expect_error(INVALID, acme_gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="x" * 201), timeout=10), "name")
    for size in (-1, 501):
        await expect_error(
            INVALID, acme_gw.ListRooms(gateway_pb2.ListRoomsRequest(page_size=size), timeout=10), "page_size"
        )
    await expect_error(INVALID, acme_gw.ListRooms(gateway_pb2.ListRoomsRequest(page_token="garbage!"), timeout=10))


async def test_invite_and_list_members(
    acme_gw: GatewayStub, globex_gw: GatewayStub, acme: CompanyKey, globex: CompanyKey
) -> None:
    room = await create_room(acme_gw)
    invited = await acme_gw.InviteCompany(
        gateway_pb2.InviteCompanyRequest(room_id=room.room_id, company_id=globex.company_id), timeout=10
    )
    assert invited.invitation.company_id == globex.company_id
    assert invited.invitation.status == common_pb2.INVITATION_STATUS_PENDING
    members = await acme_gw.ListMembers(gateway_pb2.ListMembersRequest(room_id=room.room_id), timeout=10)
    assert [m.company_id for m in members.members] == [acme.company_id]  # not before it accepts
    accepted = await globex_gw.AcceptInvitation(
        gateway_pb2.AcceptInvitationRequest(invitation_id=invited.invitation.invitation_id), timeout=10
    )
    assert accepted.member.company_id == globex.company_id
    members = await globex_gw.ListMembers(gateway_pb2.ListMembersRequest(room_id=room.room_id), timeout=10)
    assert [m.company_id for m in members.members] == [acme.company_id, globex.company_id]
    assert [r.room_id for r in (await globex_gw.ListRooms(gateway_pb2.ListRoomsRequest(), timeout=10)).rooms] == [
        room.room_id
    ]

    invite = gateway_pb2.InviteCompanyRequest
    await expect_error(INVALID, acme_gw.InviteCompany(invite(room_id=room.room_id), timeout=10), "company_id")
    await expect_error(
        NOT_FOUND, acme_gw.InviteCompany(invite(room_id=room.room_id, company_id=str(uuid.uuid4())), timeout=10)
    )
    await expect_error(
        NOT_FOUND, acme_gw.InviteCompany(invite(room_id="nope", company_id=globex.company_id), timeout=10), "room"
    )
    await expect_error(
        INVALID,
        acme_gw.ListMembers(gateway_pb2.ListMembersRequest(room_id=room.room_id, page_size=1000), timeout=10),
        "page_size",
    )


async def test_register_and_list_agents(acme_gw: GatewayStub, globex_gw: GatewayStub, acme: CompanyKey) -> None:
    agent = await register_agent(acme_gw, "negotiator")
    assert agent.company_id == acme.company_id and agent.has_provider_key
    compatible = await acme_gw.RegisterAgent(
        gateway_pb2.RegisterAgentRequest(
            name="local",
            provider=common_pb2.PROVIDER_OPENAI_COMPATIBLE,
            model="llama",
            base_url="https://models.acme.test/v1",  # resolves to a public address (tests.harness.egress)
            provider_key="k",
            system_prompt="be brief",
        ),
        timeout=10,
    )
    assert compatible.agent.base_url == "https://models.acme.test/v1"
    assert "sk-test-secret" not in str(compatible) + str(agent)
    listed = await acme_gw.ListAgents(gateway_pb2.ListAgentsRequest(), timeout=10)
    assert {a.agent_id for a in listed.agents} == {agent.agent_id, compatible.agent.agent_id}
    assert not (await globex_gw.ListAgents(gateway_pb2.ListAgentsRequest(), timeout=10)).agents

    good: dict[str, Any] = {"name": "a", "provider": common_pb2.PROVIDER_OPENAI, "model": "gpt", "provider_key": "k"}
    changes: list[tuple[dict[str, Any], str]] = [
        ({"name": ""}, "name"),
        ({"provider": common_pb2.PROVIDER_UNSPECIFIED}, "provider"),
        ({"provider": 42}, "provider"),
        ({"model": ""}, "model"),
        ({"base_url": "ftp://example.com"}, "base_url"),
        ({"base_url": "not a url"}, "base_url"),
        ({"base_url": "http://127.0.0.1:8000/v1"}, "plain_http"),  # the Room's egress rules, passed on
        ({"base_url": "https://169.254.169.254/v1"}, "metadata"),
        ({"provider": common_pb2.PROVIDER_OPENAI_COMPATIBLE}, "base_url"),
        ({"provider_key": ""}, "provider_key"),
    ]
    for change, field in changes:
        request = gateway_pb2.RegisterAgentRequest(**{**good, **change})
        await expect_error(INVALID, acme_gw.RegisterAgent(request, timeout=10), field)
    await expect_error(
        INVALID, acme_gw.ListAgents(gateway_pb2.ListAgentsRequest(page_size=501), timeout=10), "page_size"
    )


async def test_the_agents_in_a_room_are_listed_to_its_members_only(
    acme_gw: GatewayStub, globex_gw: GatewayStub, acme: CompanyKey, globex: CompanyKey
) -> None:
    """Every member company's agents, so a person can mention them by name; another company's agent
    shows who it is, never how it is configured."""
    room = await create_room(acme_gw)
    planner = await register_agent(acme_gw, "planner")
    writer = await register_agent(globex_gw, "writer")
    agents_in = gateway_pb2.ListAgentsRequest
    # Not a member yet: the room answers as if it did not exist.
    await expect_error(NOT_FOUND, globex_gw.ListAgents(agents_in(room_id=room.room_id), timeout=10), "room")
    mine = await acme_gw.ListAgents(agents_in(room_id=room.room_id), timeout=10)
    assert [a.agent_id for a in mine.agents] == [planner.agent_id]
    await join_room(acme_gw, globex_gw, room.room_id)
    for gw, own_id in ((acme_gw, planner.agent_id), (globex_gw, writer.agent_id)):
        listed = {a.agent_id: a for a in (await gw.ListAgents(agents_in(room_id=room.room_id), timeout=10)).agents}
        assert set(listed) == {planner.agent_id, writer.agent_id}
        own = listed.pop(own_id)
        assert own.model == "claude-test" and own.has_provider_key
        [other] = listed.values()
        assert other.name in ("planner", "writer") and other.company_id in (acme.company_id, globex.company_id)
        assert other.created_at.seconds > 0
        assert (other.model, other.provider, other.base_url, other.system_prompt, other.has_provider_key) == (
            "",
            common_pb2.PROVIDER_UNSPECIFIED,
            "",
            "",
            False,
        )
    # Paged like every listing, and without a room still the caller's own agents only.
    first = await acme_gw.ListAgents(agents_in(room_id=room.room_id, page_size=1), timeout=10)
    rest = await acme_gw.ListAgents(
        agents_in(room_id=room.room_id, page_size=1, page_token=first.next_page_token), timeout=10
    )
    assert [a.agent_id for a in (*first.agents, *rest.agents)] == [planner.agent_id, writer.agent_id]
    assert [a.agent_id for a in (await globex_gw.ListAgents(agents_in(), timeout=10)).agents] == [writer.agent_id]
    await expect_error(NOT_FOUND, acme_gw.ListAgents(agents_in(room_id="nope"), timeout=10), "room")
    # A company that leaves takes its agents out of the room.
    await globex_gw.LeaveRoom(gateway_pb2.LeaveRoomRequest(room_id=room.room_id), timeout=10)
    after = await acme_gw.ListAgents(agents_in(room_id=room.room_id), timeout=10)
    assert [a.agent_id for a in after.agents] == [planner.agent_id]


async def test_post_and_list_messages(
    acme_gw: GatewayStub, globex_gw: GatewayStub, acme: CompanyKey, globex: CompanyKey
) -> None:
    room = await create_room(acme_gw)
    agent = await register_agent(acme_gw)
    post = gateway_pb2.PostMessageRequest
    first = await acme_gw.PostMessage(
        post(room_id=room.room_id, person="Ada", body="hello @helper", mention_agent_ids=[agent.agent_id]),
        timeout=10,
    )
    assert first.message.author.kind == common_pb2.AUTHOR_KIND_PERSON
    assert first.message.author.company_id == acme.company_id and first.message.author.person == "Ada"
    assert len(first.wake_ids) == 1
    # A retried call with the same idempotency key posts once.
    keyed = post(room_id=room.room_id, person="Ada", body="second", idempotency_key="k-1")
    a = await acme_gw.PostMessage(keyed, timeout=10)
    again = await acme_gw.PostMessage(keyed, timeout=10)
    assert again.message.message_id == a.message.message_id
    # Another company's same key is its own.
    await join_room(acme_gw, globex_gw, room.room_id)
    theirs = await globex_gw.PostMessage(
        post(room_id=room.room_id, person="Bob", body="third", idempotency_key="k-1"), timeout=10
    )
    assert theirs.message.message_id != a.message.message_id
    assert theirs.message.author.company_id == globex.company_id

    listed = await acme_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)
    assert [m.body for m in listed.messages] == ["hello @helper", "second", "third"]
    newest = await globex_gw.ListMessages(
        gateway_pb2.ListMessagesRequest(room_id=room.room_id, newest_first=True, page_size=2), timeout=10
    )
    assert [m.body for m in newest.messages] == ["third", "second"] and newest.next_page_token

    for request, field in [
        (post(room_id=room.room_id, person="Ada", body=""), "body"),
        (post(room_id=room.room_id, person="Ada", body="x" * (64 * 1024 + 1)), "body"),
        (post(room_id=room.room_id, person="", body="hi"), "person"),
        (post(room_id=room.room_id, person="x" * 201, body="hi"), "person"),
        (post(room_id=room.room_id, person="Ada", body="hi", mention_agent_ids=["bad"]), "mention_agent_ids"),
        (post(room_id=room.room_id, person="Ada", body="hi", idempotency_key="k" * 201), "idempotency_key"),
    ]:
        await expect_error(INVALID, acme_gw.PostMessage(request, timeout=10), field)
    # A 64 KiB body is fine.
    await acme_gw.PostMessage(post(room_id=room.room_id, person="Ada", body="x" * (64 * 1024)), timeout=10)
    # A mentioned agent not in the room: NOT_FOUND.
    await expect_error(
        NOT_FOUND,
        acme_gw.PostMessage(
            post(room_id=room.room_id, person="Ada", body="hi", mention_agent_ids=[str(uuid.uuid4())]), timeout=10
        ),
    )
    await expect_error(
        INVALID,
        acme_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id, page_size=501), timeout=10),
        "page_size",
    )


async def test_mentioning_an_agent_of_a_company_outside_the_room_is_not_found(
    acme_gw: GatewayStub, globex_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw)
    theirs = await register_agent(globex_gw, "theirs")
    details = set()
    for agent_id in (theirs.agent_id, str(uuid.uuid4())):
        err = await expect_error(
            NOT_FOUND,
            acme_gw.PostMessage(
                gateway_pb2.PostMessageRequest(
                    room_id=room.room_id, person="Ada", body="hi", mention_agent_ids=[agent_id]
                ),
                timeout=10,
            ),
        )
        details.add(err.details())
        err = await expect_error(
            NOT_FOUND,
            acme_gw.SendTask(
                gateway_pb2.SendTaskRequest(room_id=room.room_id, person="Ada", to_agent_id=agent_id, title="t"),
                timeout=10,
            ),
        )
        details.add(err.details())
    # An agent of a company outside the room reads exactly like one that does not exist.
    assert len(details) == 1, details


async def test_tasks(
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    initech_gw: GatewayStub,
    globex: CompanyKey,
    initech: CompanyKey,
) -> None:
    room = await create_room(acme_gw)
    for invitee in (globex_gw, initech_gw):
        await join_room(acme_gw, invitee, room.room_id)
    acme_agent = await register_agent(acme_gw, "acme-agent")
    send = gateway_pb2.SendTaskRequest
    sent = await globex_gw.SendTask(
        send(room_id=room.room_id, person="Bob", to_agent_id=acme_agent.agent_id, title="quote", body="for 10 units"),
        timeout=10,
    )
    task = sent.task
    assert task.to_agent_id == acme_agent.agent_id and task.status == common_pb2.TASK_STATUS_OPEN
    assert getattr(task, "from").company_id == globex.company_id and len(sent.wake_ids) == 1
    keyed = send(room_id=room.room_id, person="Bob", to_agent_id=acme_agent.agent_id, title="t2", idempotency_key="x")
    assert (await globex_gw.SendTask(keyed, timeout=10)).task.task_id == (
        await globex_gw.SendTask(keyed, timeout=10)
    ).task.task_id

    listed = await initech_gw.ListTasks(gateway_pb2.ListTasksRequest(room_id=room.room_id), timeout=10)
    assert {t.title for t in listed.tasks} == {"quote", "t2"}
    only = await acme_gw.ListTasks(
        gateway_pb2.ListTasksRequest(room_id=room.room_id, to_agent_id=acme_agent.agent_id, page_size=1), timeout=10
    )
    assert len(only.tasks) == 1 and only.next_page_token

    update = gateway_pb2.UpdateTaskRequest
    # The assignee's company and the sender's company may update; a third member may not.
    await acme_gw.UpdateTask(update(room_id=room.room_id, task_id=task.task_id, person="Ada", note="on it"), timeout=10)
    await expect_error(
        grpc.StatusCode.PERMISSION_DENIED,
        initech_gw.UpdateTask(update(room_id=room.room_id, task_id=task.task_id, person="Ivy", note="me?"), timeout=10),
    )
    done = await globex_gw.UpdateTask(
        update(room_id=room.room_id, task_id=task.task_id, person="Bob", status=common_pb2.TASK_STATUS_DONE),
        timeout=10,
    )
    assert done.task.status == common_pb2.TASK_STATUS_DONE
    got = await initech_gw.GetTask(gateway_pb2.GetTaskRequest(room_id=room.room_id, task_id=task.task_id), timeout=10)
    assert [u.note for u in got.task.updates][:1] == ["on it"] and got.task.status == common_pb2.TASK_STATUS_DONE
    await expect_error(
        grpc.StatusCode.FAILED_PRECONDITION,
        acme_gw.UpdateTask(update(room_id=room.room_id, task_id=task.task_id, person="Ada", note="again"), timeout=10),
    )

    for request, field in [
        (send(room_id=room.room_id, person="Bob", to_agent_id=acme_agent.agent_id, title=""), "title"),
        (send(room_id=room.room_id, person="Bob", to_agent_id=acme_agent.agent_id, title="x" * 501), "title"),
        (send(room_id=room.room_id, person="Bob", title="t"), "to_agent_id"),
        (send(room_id=room.room_id, to_agent_id=acme_agent.agent_id, title="t"), "person"),
    ]:
        await expect_error(INVALID, globex_gw.SendTask(request, timeout=10), field)
    await expect_error(
        NOT_FOUND,
        globex_gw.SendTask(
            send(room_id=room.room_id, person="B", to_agent_id=str(uuid.uuid4()), title="t"), timeout=10
        ),
    )
    await expect_error(
        INVALID, acme_gw.UpdateTask(update(room_id=room.room_id, task_id=task.task_id, person="A"), timeout=10), "note"
    )
    await expect_error(
        INVALID, acme_gw.UpdateTask(update(room_id=room.room_id, person="A", note="n"), timeout=10), "task_id"
    )
    await expect_error(
        NOT_FOUND,
        acme_gw.UpdateTask(update(room_id=room.room_id, task_id=str(uuid.uuid4()), person="A", note="n"), timeout=10),
    )
    await expect_error(
        NOT_FOUND, acme_gw.GetTask(gateway_pb2.GetTaskRequest(room_id=room.room_id, task_id="nope"), timeout=10)
    )
    await expect_error(INVALID, acme_gw.GetTask(gateway_pb2.GetTaskRequest(room_id=room.room_id), timeout=10))
    # A task of another room is not found through this room.
    other_room = await create_room(acme_gw, "other room")
    await expect_error(
        NOT_FOUND,
        acme_gw.GetTask(gateway_pb2.GetTaskRequest(room_id=other_room.room_id, task_id=task.task_id), timeout=10),
    )
    await expect_error(
        INVALID,
        acme_gw.ListTasks(gateway_pb2.ListTasksRequest(room_id=room.room_id, status=9), timeout=10),  # type: ignore[arg-type]
        "status",
    )


async def test_private_memory_reaches_only_its_company(
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    room_addr: str,
    acme: CompanyKey,
    globex: CompanyKey,
) -> None:
    """Guards the public path end to end. The Gateway drops another company's private lines itself
    (defence in depth), so a leak in the Room alone does not fail this test: the Room's own filter is
    guarded by tests/room/test_memory_files.py::test_private_memory_is_invisible_to_other_companies,
    which reads through the Room directly. (The Gateway's extra filter is not forced by any test: that
    would take a Room that leaks.)"""
    room = await create_room(acme_gw)
    await join_room(acme_gw, globex_gw, room.room_id)
    async with service_channel(room_addr, "runtime") as channel:
        internal = room_pb2_grpc.RoomServiceStub(channel)
        for company, text, visibility in [
            (acme, "shared: delivery in May", common_pb2.MEMORY_VISIBILITY_ROOM),
            (acme, "acme only: our floor price is 90", common_pb2.MEMORY_VISIBILITY_COMPANY),
            (globex, "globex only: budget is 120", common_pb2.MEMORY_VISIBILITY_COMPANY),
        ]:
            await internal.WriteMemory(
                room_pb2.RoomServiceWriteMemoryRequest(
                    room_id=room.room_id,
                    author=common_pb2.Author(
                        kind=common_pb2.AUTHOR_KIND_PERSON, company_id=company.company_id, person="p"
                    ),
                    text=text,
                    visibility=visibility,
                ),
                timeout=10,
            )

    async def texts(gw: GatewayStub, query: str = "") -> set[str]:
        response = await gw.ListMemory(gateway_pb2.ListMemoryRequest(room_id=room.room_id, query=query), timeout=10)
        return {line.text for line in response.lines}

    assert await texts(acme_gw) == {"shared: delivery in May", "acme only: our floor price is 90"}
    assert await texts(globex_gw) == {"shared: delivery in May", "globex only: budget is 120"}
    assert await texts(globex_gw, "price") == set()
    assert await texts(acme_gw, "price") == {"acme only: our floor price is 90"}
    await expect_error(
        INVALID,
        acme_gw.ListMemory(gateway_pb2.ListMemoryRequest(room_id=room.room_id, page_size=501), timeout=10),
        "page_size",
    )


async def test_files_and_passages(acme_gw: GatewayStub, acme: CompanyKey) -> None:
    room = await create_room(acme_gw)
    upload = gateway_pb2.UploadFileRequest
    content = b"Terms.\n\nPayment is due within thirty days of delivery.\n\nPenalties apply after that."
    uploaded = await acme_gw.UploadFile(
        upload(room_id=room.room_id, person="Ada", name="terms.txt", content=content), timeout=30
    )
    assert uploaded.file.size_bytes == len(content) and uploaded.file.author.company_id == acme.company_id
    files = await acme_gw.ListFiles(gateway_pb2.ListFilesRequest(room_id=room.room_id), timeout=10)
    assert [f.name for f in files.files] == ["terms.txt"]
    found = await acme_gw.SearchPassages(
        gateway_pb2.SearchPassagesRequest(room_id=room.room_id, query="payment"), timeout=10
    )
    assert found.passages and "thirty days" in found.passages[0].text

    for request, field in [
        (upload(room_id=room.room_id, person="Ada", name="big.txt", content=b"x" * (10 * 1024 * 1024 + 1)), "content"),
        (upload(room_id=room.room_id, person="Ada", name="bin.dat", content=b"\xff\xfe\x00"), "UTF-8"),
        (upload(room_id=room.room_id, person="Ada", name="", content=b"x"), "name"),
        (upload(room_id=room.room_id, name="a.txt", content=b"x"), "person"),
    ]:
        await expect_error(INVALID, acme_gw.UploadFile(request, timeout=60), field)
    search = gateway_pb2.SearchPassagesRequest
    await expect_error(INVALID, acme_gw.SearchPassages(search(room_id=room.room_id), timeout=10), "query")
    await expect_error(
        INVALID, acme_gw.SearchPassages(search(room_id=room.room_id, query="x", limit=51), timeout=10), "limit"
    )
    await expect_error(
        INVALID,
        acme_gw.ListFiles(gateway_pb2.ListFilesRequest(room_id=room.room_id, page_size=501), timeout=10),
        "page_size",
    )


async def test_runs_only_of_the_callers_agents(
    acme_gw: GatewayStub, globex_gw: GatewayStub, room_addr: str, acme: CompanyKey, globex: CompanyKey
) -> None:
    room = await create_room(acme_gw)
    mine = await register_agent(acme_gw, "mine")
    theirs = await register_agent(globex_gw, "theirs")
    async with service_channel(room_addr, "runtime") as channel:
        internal = room_pb2_grpc.RoomServiceStub(channel)
        for run_id, agent, company in [
            ("run-a1", mine, acme),
            ("run-a2", mine, acme),
            ("run-g1", theirs, globex),
        ]:
            await internal.RecordRun(
                room_pb2.RoomServiceRecordRunRequest(
                    run=common_pb2.Run(
                        run_id=run_id,
                        agent_id=agent.agent_id,
                        company_id=company.company_id,
                        room_id=room.room_id,
                        wake_id=str(uuid.uuid4()),
                        status=common_pb2.RUN_STATUS_RUNNING,
                        step=common_pb2.RUN_STEP_CLAIMED,
                    )
                ),
                timeout=10,
            )
    listed = await acme_gw.ListRuns(gateway_pb2.ListRunsRequest(), timeout=10)
    assert [r.run_id for r in listed.runs] == ["run-a2", "run-a1"]
    by_agent = await acme_gw.ListRuns(gateway_pb2.ListRunsRequest(agent_id=mine.agent_id, page_size=1), timeout=10)
    assert [r.run_id for r in by_agent.runs] == ["run-a2"] and by_agent.next_page_token
    assert (await acme_gw.GetRun(gateway_pb2.GetRunRequest(run_id="run-a1"), timeout=10)).run.agent_id == mine.agent_id

    await expect_error(NOT_FOUND, acme_gw.ListRuns(gateway_pb2.ListRunsRequest(agent_id=theirs.agent_id), timeout=10))
    await expect_error(NOT_FOUND, acme_gw.ListRuns(gateway_pb2.ListRunsRequest(agent_id="nope"), timeout=10))
    await expect_error(NOT_FOUND, acme_gw.GetRun(gateway_pb2.GetRunRequest(run_id="run-g1"), timeout=10))
    await expect_error(NOT_FOUND, acme_gw.GetRun(gateway_pb2.GetRunRequest(run_id="run-unknown"), timeout=10))
    await expect_error(INVALID, acme_gw.GetRun(gateway_pb2.GetRunRequest(), timeout=10), "run_id")
    await expect_error(INVALID, acme_gw.ListRuns(gateway_pb2.ListRunsRequest(page_size=501), timeout=10), "page_size")
    assert [r.run_id for r in (await globex_gw.ListRuns(gateway_pb2.ListRunsRequest(), timeout=10)).runs] == ["run-g1"]
