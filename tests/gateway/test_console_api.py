"""The Gateway API the console reads by: names (company names of members, agents and invitations; the
room's agents as the Room's rule `room-agents` shows them), one message, the runs filtered and paged,
a run with its approval, invitations sent, and a company's own API keys (a session key may list and
revoke, never make one)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import grpc
import pytest

from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc
from services.gateway.auth import parse_key_id
from tests.gateway.conftest import NOWHERE
from tests.gateway.helpers import GatewayStub, create_room, expect_error, register_agent
from tests.harness.channels import service_channel
from tests.harness.gateway import CompanyKey, authed_gateway, join_room, running_gateway

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
DENIED = grpc.StatusCode.PERMISSION_DENIED
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def at(minutes: int) -> common_pb2.Run:
    """A Run whose started_at is ``minutes`` after T0 (only the time set)."""
    run = common_pb2.Run()
    run.started_at.FromDatetime(T0 + timedelta(minutes=minutes))
    return run


async def test_names_of_members_agents_and_invitations(
    acme_gw: GatewayStub, globex_gw: GatewayStub, acme: CompanyKey, globex: CompanyKey
) -> None:
    room = await create_room(acme_gw, "Launch")
    planner = await register_agent(acme_gw, "planner")
    writer = await register_agent(globex_gw, "writer")
    assert (planner.company_name, writer.company_name) == ("Acme", "Globex")
    own = (await acme_gw.ListAgents(gateway_pb2.ListAgentsRequest(), timeout=10)).agents
    assert [(a.name, a.company_name, a.model) for a in own] == [("planner", "Acme", "claude-test")]

    invited = await acme_gw.InviteCompany(
        gateway_pb2.InviteCompanyRequest(room_id=room.room_id, company_id=globex.company_id), timeout=10
    )
    assert (invited.invitation.company_name, invited.invitation.invited_by_company_name) == ("Globex", "Acme")
    received = await globex_gw.ListInvitations(gateway_pb2.ListInvitationsRequest(), timeout=10)
    assert [(i.room_name, i.company_name, i.invited_by_company_name) for i in received.invitations] == [
        ("Launch", "Globex", "Acme")
    ]
    # Sent: the inviter sees what it sent, by status; the invited company sent nothing.
    sent = gateway_pb2.ListInvitationsRequest(sent=True)
    assert [i.company_id for i in (await acme_gw.ListInvitations(sent, timeout=10)).invitations] == [globex.company_id]
    assert not (await globex_gw.ListInvitations(sent, timeout=10)).invitations
    assert not (await acme_gw.ListInvitations(gateway_pb2.ListInvitationsRequest(), timeout=10)).invitations
    await globex_gw.AcceptInvitation(
        gateway_pb2.AcceptInvitationRequest(invitation_id=invited.invitation.invitation_id), timeout=10
    )
    assert not (await acme_gw.ListInvitations(sent, timeout=10)).invitations
    answered = await acme_gw.ListInvitations(
        gateway_pb2.ListInvitationsRequest(sent=True, status=common_pb2.INVITATION_STATUS_ACCEPTED), timeout=10
    )
    assert [(i.company_name, i.status) for i in answered.invitations] == [
        ("Globex", common_pb2.INVITATION_STATUS_ACCEPTED)
    ]

    members = await globex_gw.ListMembers(gateway_pb2.ListMembersRequest(room_id=room.room_id), timeout=10)
    assert [m.company_name for m in members.members] == ["Acme", "Globex"]
    # The room's agents carry their company's name; another company's agent is trimmed by the Room.
    listed = await globex_gw.ListAgents(gateway_pb2.ListAgentsRequest(room_id=room.room_id), timeout=10)
    seen = {a.name: a for a in listed.agents}
    assert (seen["planner"].company_name, seen["writer"].company_name) == ("Acme", "Globex")
    assert (seen["planner"].model, seen["writer"].model) == ("", "claude-test")


async def test_the_room_trims_another_companys_agents_for_the_reader(
    room_addr: str, acme_gw: GatewayStub, globex_gw: GatewayStub, acme: CompanyKey, globex: CompanyKey
) -> None:
    """The rule lives in the Room: asked with a reader, it returns another company's agent by id, name
    and company only, and refuses a reader that is not a member, whoever calls."""
    room = await create_room(acme_gw)
    planner = await register_agent(acme_gw, "planner")
    await register_agent(globex_gw, "writer")
    await join_room(acme_gw, globex_gw, room.room_id)
    listing = room_pb2.RoomServiceListAgentsRequest
    async with service_channel(room_addr, "gateway") as channel:
        internal = room_pb2_grpc.RoomServiceStub(channel)
        as_globex = await internal.ListAgents(
            listing(room_id=room.room_id, reader_company_id=globex.company_id), timeout=10
        )
        other = next(a for a in as_globex.agents if a.agent_id == planner.agent_id)
        trimmed = common_pb2.Agent(
            agent_id=planner.agent_id, company_id=acme.company_id, company_name="Acme", name="planner"
        )
        trimmed.created_at.CopyFrom(planner.created_at)
        assert other == trimmed
        stranger = str(uuid.uuid4())
        refused = await expect_error(
            NOT_FOUND, internal.ListAgents(listing(room_id=room.room_id, reader_company_id=stranger), timeout=10)
        )
        assert refused.details() == f"room {room.room_id} not found"


async def test_get_message(acme_gw: GatewayStub, globex_gw: GatewayStub) -> None:
    room = await create_room(acme_gw)
    other = await create_room(acme_gw, "other")
    posted = (
        await acme_gw.PostMessage(
            gateway_pb2.PostMessageRequest(room_id=room.room_id, person="Ana", body="hello"), timeout=10
        )
    ).message
    got = await acme_gw.GetMessage(
        gateway_pb2.GetMessageRequest(room_id=room.room_id, message_id=posted.message_id), timeout=10
    )
    assert got.message == posted
    ask = gateway_pb2.GetMessageRequest
    await expect_error(
        NOT_FOUND, acme_gw.GetMessage(ask(room_id=other.room_id, message_id=posted.message_id)), "message"
    )
    await expect_error(NOT_FOUND, acme_gw.GetMessage(ask(room_id=room.room_id, message_id="nope")), "message")
    await expect_error(NOT_FOUND, globex_gw.GetMessage(ask(room_id=room.room_id, message_id=posted.message_id)), "room")
    await expect_error(INVALID, acme_gw.GetMessage(ask(room_id=room.room_id)), "message_id")


async def test_runs_filtered_by_room_status_and_time_and_paged(
    acme_gw: GatewayStub, globex_gw: GatewayStub, room_addr: str, acme: CompanyKey, globex: CompanyKey
) -> None:
    launch = await create_room(acme_gw, "launch")
    ops = await create_room(acme_gw, "ops")
    planner = await register_agent(acme_gw, "planner")
    helper = await register_agent(acme_gw, "helper")
    theirs = await register_agent(globex_gw, "theirs")
    failed, succeeded = common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STATUS_SUCCEEDED
    # run id, agent, room, status, minutes after T0 it started
    rows = [
        ("r1", planner, launch, succeeded, 0),
        ("r2", planner, ops, failed, 10),
        ("r3", helper, launch, failed, 20),
        ("r4", planner, launch, failed, 30),
        ("r5", helper, ops, succeeded, 40),
        ("r6", planner, launch, succeeded, 50),
    ]
    async with service_channel(room_addr, "runtime") as channel:
        internal = room_pb2_grpc.RoomServiceStub(channel)
        for run_id, agent, room, status, minutes in [*rows, ("g1", theirs, launch, failed, 25)]:
            run = at(minutes)
            run.MergeFrom(
                common_pb2.Run(
                    run_id=run_id,
                    agent_id=agent.agent_id,
                    company_id=agent.company_id,
                    room_id=room.room_id,
                    wake_id=str(uuid.uuid4()),
                    status=status,
                    step=common_pb2.RUN_STEP_ENDED,
                )
            )
            await internal.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run), timeout=10)

    async def ids(**filters: object) -> list[str]:
        request = gateway_pb2.ListRunsRequest(**filters)  # type: ignore[arg-type]
        return [r.run_id for r in (await acme_gw.ListRuns(request, timeout=10)).runs]

    assert await ids() == ["r6", "r5", "r4", "r3", "r2", "r1"]
    assert await ids(room_id=launch.room_id) == ["r6", "r4", "r3", "r1"]
    assert await ids(status=failed) == ["r4", "r3", "r2"]
    assert await ids(room_id=launch.room_id, status=failed) == ["r4", "r3"]
    assert await ids(agent_id=planner.agent_id, status=failed) == ["r4", "r2"]
    window = {"started_after": at(10).started_at, "started_before": at(40).started_at}
    assert await ids(**window) == ["r4", "r3", "r2"]  # from 10 inclusive to 40 exclusive
    assert await ids(room_id=launch.room_id, **window) == ["r4", "r3"]
    assert await ids(started_after=at(45).started_at) == ["r6"]
    assert await ids(room_id=str(uuid.uuid4())) == []
    # Globex's failed run in the same room is never Acme's.
    assert [r.run_id for r in (await globex_gw.ListRuns(gateway_pb2.ListRunsRequest(), timeout=10)).runs] == ["g1"]

    # Paged with its filters, newest first; a token is only good with the filters it came with.
    first = await acme_gw.ListRuns(gateway_pb2.ListRunsRequest(page_size=3, room_id=launch.room_id), timeout=10)
    assert [r.run_id for r in first.runs] == ["r6", "r4", "r3"] and first.next_page_token
    rest = await acme_gw.ListRuns(
        gateway_pb2.ListRunsRequest(page_size=3, page_token=first.next_page_token, room_id=launch.room_id), timeout=10
    )
    assert [r.run_id for r in rest.runs] == ["r1"] and not rest.next_page_token
    await expect_error(
        INVALID,
        acme_gw.ListRuns(gateway_pb2.ListRunsRequest(page_token=first.next_page_token, status=failed), timeout=10),
        "page_token",
    )
    await expect_error(
        INVALID,
        acme_gw.ListRuns(gateway_pb2.ListRunsRequest(status=common_pb2.RunStatus.ValueType(99)), timeout=10),
        "status",
    )
    await expect_error(INVALID, acme_gw.ListRuns(gateway_pb2.ListRunsRequest(room_id="nope"), timeout=10), "room_id")
    backwards = gateway_pb2.ListRunsRequest(started_after=at(20).started_at, started_before=at(10).started_at)
    await expect_error(INVALID, acme_gw.ListRuns(backwards, timeout=10), "started_before")


async def test_get_run_shows_the_approval_it_parked_on(acme_gw: GatewayStub, room_addr: str, acme: CompanyKey) -> None:
    room = await create_room(acme_gw)
    planner = await register_agent(acme_gw, "planner")
    run = common_pb2.Run(
        run_id=str(uuid.uuid4()),
        agent_id=planner.agent_id,
        company_id=acme.company_id,
        room_id=room.room_id,
        wake_id=str(uuid.uuid4()),
        status=common_pb2.RUN_STATUS_RUNNING,
        step=common_pb2.RUN_STEP_ACTIONS_DECIDED,
        actions=[
            common_pb2.DeclaredAction(
                index=0,
                kind=common_pb2.ACTION_KIND_REMEMBER,
                arguments_json='{"text": "x"}',
                outcome=common_pb2.ACTION_OUTCOME_HELD,
            )
        ],
    )
    async with service_channel(room_addr, "runtime") as channel:
        internal = room_pb2_grpc.RoomServiceStub(channel)
        await internal.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run), timeout=10)
        assert not (await acme_gw.GetRun(gateway_pb2.GetRunRequest(run_id=run.run_id), timeout=10)).HasField("approval")
        parked = common_pb2.Run()
        parked.CopyFrom(run)
        parked.status, parked.step = common_pb2.RUN_STATUS_PARKED, common_pb2.RUN_STEP_PARKED
        held = common_pb2.HeldAction(index=0, kind=common_pb2.ACTION_KIND_REMEMBER, arguments_json='{"text": "x"}')
        made = await internal.CreateWaitpoint(
            room_pb2.RoomServiceCreateWaitpointRequest(
                run_id=run.run_id, held=[held], expires_in_seconds=3600, run=parked
            ),
            timeout=10,
        )
    got = await acme_gw.GetRun(gateway_pb2.GetRunRequest(run_id=run.run_id), timeout=10)
    assert got.run.status == common_pb2.RUN_STATUS_PARKED
    assert got.approval.token == made.waitpoint.token and got.approval.held[0].index == 0
    await acme_gw.DecideApproval(
        gateway_pb2.DecideApprovalRequest(token=made.waitpoint.token, index=0, person="Ana", approve=True), timeout=10
    )
    decided = (await acme_gw.GetRun(gateway_pb2.GetRunRequest(run_id=run.run_id), timeout=10)).approval
    assert decided.status == common_pb2.WAITPOINT_STATUS_COMPLETED
    assert decided.held[0].decided_by == "Ana" and decided.held[0].decided_at.seconds > 0


@pytest.fixture
async def few_keys_gateway(database_url: str, room_addr: str) -> AsyncIterator[str]:
    """A Gateway whose companies may have at most 3 live API keys."""
    async with running_gateway(
        database_url,
        room_addr,
        NOWHERE,
        QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false",
        QUAYUTEC_GATEWAY_POST_RATE="0",
        QUAYUTEC_GATEWAY_MAX_API_KEYS="3",
    ) as addr:
        yield addr


async def test_a_company_manages_its_own_api_keys(few_keys_gateway: str, acme: CompanyKey, globex: CompanyKey) -> None:
    async with (
        authed_gateway(few_keys_gateway, acme.secret) as acme_gw,
        authed_gateway(few_keys_gateway, globex.secret) as globex_gw,
    ):
        made = await acme_gw.CreateApiKey(gateway_pb2.CreateApiKeyRequest(label="ci"), timeout=10)
        assert made.secret.startswith("qyk_") and str(parse_key_id(made.secret)) == made.key.key_id
        assert (made.key.label, made.key.session, made.key.current) == ("ci", False, False)
        async with authed_gateway(few_keys_gateway, made.secret) as ci_gw:
            who = await ci_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)
            assert who.company.company_id == acme.company_id

        # A session key lists (no secret anywhere), marks the sign-in's own company key, and cannot make one.
        session = await acme_gw.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=600), timeout=10)
        async with authed_gateway(few_keys_gateway, session.secret) as session_gw:
            refused = await expect_error(
                DENIED, session_gw.CreateApiKey(gateway_pb2.CreateApiKeyRequest(label="x"), timeout=10), "session key"
            )
            assert "company API key" in (refused.details() or "")
            listed = await session_gw.ListApiKeys(gateway_pb2.ListApiKeysRequest(), timeout=10)
            assert [(k.key_id, k.label, k.current) for k in listed.keys] == [
                (acme.key_id, f"test key of {acme.name}", True),
                (made.key.key_id, "ci", False),
            ]
            assert made.secret.split("_")[-1] not in str(listed)
            with_sessions = await session_gw.ListApiKeys(
                gateway_pb2.ListApiKeysRequest(include_sessions=True), timeout=10
            )
            mine = next(k for k in with_sessions.keys if k.key_id == session.key_id)
            assert mine.session and mine.current and mine.parent_key_id == acme.key_id
            # A session may revoke a key that leaked.
            revoked = await session_gw.RevokeApiKey(gateway_pb2.RevokeApiKeyRequest(key_id=made.key.key_id), timeout=10)
            assert revoked.key.revoked_at.seconds > 0
        async with authed_gateway(few_keys_gateway, made.secret) as ci_gw:
            await expect_error(UNAUTHENTICATED, ci_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10), "revoked")
        again = await acme_gw.RevokeApiKey(gateway_pb2.RevokeApiKeyRequest(key_id=made.key.key_id), timeout=10)
        assert again.key.revoked_at == revoked.key.revoked_at

        # Another company's key answers as an unknown one, and stays live.
        words = (
            await expect_error(NOT_FOUND, acme_gw.RevokeApiKey(gateway_pb2.RevokeApiKeyRequest(key_id=globex.key_id)))
        ).details()
        unknown = str(uuid.uuid4())
        assert (
            await expect_error(NOT_FOUND, acme_gw.RevokeApiKey(gateway_pb2.RevokeApiKeyRequest(key_id=unknown)))
        ).details() == (words or "").replace(globex.key_id, unknown)
        await globex_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)
        assert globex.key_id not in str(await acme_gw.ListApiKeys(gateway_pb2.ListApiKeysRequest(), timeout=10))
        await expect_error(INVALID, acme_gw.RevokeApiKey(gateway_pb2.RevokeApiKeyRequest(), timeout=10), "key_id")

        # At most QUAYUTEC_GATEWAY_MAX_API_KEYS live company keys (a revoked one does not count).
        for label in ("two", "three"):
            await acme_gw.CreateApiKey(gateway_pb2.CreateApiKeyRequest(label=label), timeout=10)
        full = await expect_error(EXHAUSTED, acme_gw.CreateApiKey(gateway_pb2.CreateApiKeyRequest(), timeout=10))
        assert "QUAYUTEC_GATEWAY_MAX_API_KEYS" in (full.details() or "")
        await expect_error(
            INVALID, acme_gw.CreateApiKey(gateway_pb2.CreateApiKeyRequest(label="x" * 201), timeout=10), "label"
        )

        # Paged oldest first; a token of the listing without sessions is refused with sessions.
        first = await acme_gw.ListApiKeys(gateway_pb2.ListApiKeysRequest(page_size=2), timeout=10)
        rest = await acme_gw.ListApiKeys(
            gateway_pb2.ListApiKeysRequest(page_size=2, page_token=first.next_page_token), timeout=10
        )
        labels = [k.label for k in (*first.keys, *rest.keys)]
        assert labels == [f"test key of {acme.name}", "ci", "two", "three"] and not rest.next_page_token
        await expect_error(
            INVALID,
            acme_gw.ListApiKeys(
                gateway_pb2.ListApiKeysRequest(include_sessions=True, page_token=first.next_page_token), timeout=10
            ),
            "page_token",
        )
