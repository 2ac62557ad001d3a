"""The room's rules from the A2A door, and what an A2A task shows as its agent's answer: only what the
task's assignee agent wrote. Three companies: Acme's agent is the A2A agent, Globex is the A2A client
(the task's sender), Initech a third company."""

from __future__ import annotations

import asyncpg
import grpc
import pytest
from a2a.types import a2a_pb2
from a2a.utils.errors import A2AError, TaskNotFoundError

from quayutec.v1 import common_pb2, gateway_pb2
from services.gateway.a2a import tenant_of
from services.runtime.standin import ScriptedReply, StandinProvider, asked
from tests.gateway.helpers import GatewayStub, create_room, eventually, expect_error
from tests.gateway.test_a2a import FAST, _message, a2a_client, send_once
from tests.harness.gateway import CompanyKey, join_room, running_gateway
from tests.harness.room import room_state
from tests.harness.runtime import running_runtime

T = 10


async def agent_of(gw: GatewayStub, name: str) -> common_pb2.Agent:
    """An agent of the company with a model of its own, so the stand-in answers it alone."""
    response = await gw.RegisterAgent(
        gateway_pb2.RegisterAgentRequest(
            name=name, provider=common_pb2.PROVIDER_ANTHROPIC, model=f"model-{name}", provider_key="sk-test"
        ),
        timeout=T,
    )
    agent: common_pb2.Agent = response.agent
    return agent


async def ended_run(gw: GatewayStub, agent_id: str, after: set[str]) -> common_pb2.Run:
    """The agent's one ended run not in ``after`` (waited for, bounded)."""
    found: list[common_pb2.Run] = []

    async def ended() -> bool:
        runs = (await gw.ListRuns(gateway_pb2.ListRunsRequest(agent_id=agent_id), timeout=T)).runs
        found[:] = [r for r in runs if r.run_id not in after and r.ended_at.seconds > 0]
        return bool(found)

    await eventually(ended)
    return found[0]


async def wake(gw: GatewayStub, room_id: str, agent: common_pb2.Agent) -> common_pb2.Run:
    """Mention ``agent`` (as a person of its own company) and wait for the run that follows."""
    runs = await gw.ListRuns(gateway_pb2.ListRunsRequest(agent_id=agent.agent_id), timeout=T)
    before = {r.run_id for r in runs.runs}
    mention = gateway_pb2.PostMessageRequest(
        room_id=room_id, person="Pat", body="@you", mention_agent_ids=[agent.agent_id]
    )
    await gw.PostMessage(mention, timeout=T)
    return await ended_run(gw, agent.agent_id, before)


def notes(task_id: str, text: str, *, cancel: bool) -> ScriptedReply:
    """A reply that notes ``text`` on the task and, with ``cancel``, cancels it."""
    calls: list[dict[str, object]] = [{"name": "update_task", "arguments": {"task_id": task_id, "note": text}}]
    if cancel:
        calls.append({"name": "close_task", "arguments": {"task_id": task_id, "status": "cancelled", "note": ""}})
    return ScriptedReply("", tool_calls=tuple(calls))


async def test_the_a2a_answer_is_only_what_the_assignee_agent_wrote(
    database_url: str,
    room_addr: str,
    claims_addr: str,
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    initech_gw: GatewayStub,
    globex: CompanyKey,
) -> None:
    """Issue 21, #1: a third company's agent once sat its note on the task, and A2A showed it as the
    agent's own answer. Now the Room refuses it, and A2A shows the assignee agent's words only: never a
    note of anyone else, even of those the rules let note the task (the sender's agent, the assignee's
    company's people)."""
    room = await create_room(acme_gw)
    await join_room(acme_gw, globex_gw, room.room_id)
    await join_room(acme_gw, initech_gw, room.room_id)
    helper = await agent_of(acme_gw, "helper")
    scribe = await agent_of(globex_gw, "scribe")
    intruder = await agent_of(initech_gw, "intruder")
    task_ids: list[str] = []

    with StandinProvider() as standin:
        standin.set_responder(helper.model, lambda body: ScriptedReply(f"answer to {asked(body)}"))
        standin.set_responder(intruder.model, lambda body: notes(task_ids[0], "INTRUDER: stop", cancel=True))
        standin.set_responder(scribe.model, lambda body: notes(task_ids[0], "SCRIBE: sender's note", cancel=False))
        async with (
            running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as runtime_addr,
            running_gateway(database_url, room_addr, runtime_addr, **FAST) as addr,
            a2a_client(addr, tenant_of(room.room_id, helper.agent_id), globex.secret) as (client, card),
        ):
            sent = await send_once(card, globex.secret, _message("summarise the offer"), wait=True, deadline=60)
            assert sent.status.state == a2a_pb2.TASK_STATE_INPUT_REQUIRED, sent.status
            task_ids.append(sent.id)

            # A third company touches the task neither through its people nor through its agent.
            await expect_error(
                grpc.StatusCode.PERMISSION_DENIED,
                initech_gw.UpdateTask(
                    gateway_pb2.UpdateTaskRequest(room_id=room.room_id, task_id=sent.id, person="Ivy", note="INITECH"),
                    timeout=T,
                ),
            )
            refused = await wake(initech_gw, room.room_id, intruder)
            assert [(a.outcome, a.rule) for a in refused.actions] == [
                (common_pb2.ACTION_OUTCOME_REFUSED, "task-sender-or-assignee")
            ] * 2, refused
            # Those the rules let note it: the assignee's company's people, the sender's agent.
            await acme_gw.UpdateTask(
                gateway_pb2.UpdateTaskRequest(room_id=room.room_id, task_id=sent.id, person="Ada", note="ACME: noted"),
                timeout=T,
            )
            written = await wake(globex_gw, room.room_id, scribe)
            assert [a.outcome for a in written.actions] == [common_pb2.ACTION_OUTCOME_DONE], written

            room_task = (
                await acme_gw.GetTask(gateway_pb2.GetTaskRequest(room_id=room.room_id, task_id=sent.id), timeout=T)
            ).task
            assert [u.note for u in room_task.updates] == ["ACME: noted", "SCRIBE: sender's note"]
            assert room_task.status == common_pb2.TASK_STATUS_OPEN

            got = await client.get_task(a2a_pb2.GetTaskRequest(id=sent.id))
            agent_said = [m.parts[0].text for m in got.history if m.role == a2a_pb2.ROLE_AGENT]
            assert agent_said == ["answer to summarise the offer"]
            assert [a.parts[0].text for a in got.artifacts] == ["answer to summarise the offer"]
            assert got.status.state == a2a_pb2.TASK_STATE_INPUT_REQUIRED
            assert got.status.message.parts[0].text == "answer to summarise the offer"
            listed = await client.list_tasks(a2a_pb2.ListTasksRequest(include_artifacts=True, history_length=10))
            for view in listed.tasks:
                shown = [p.text for m in view.history for p in m.parts] + [
                    p.text for a in view.artifacts for p in a.parts
                ]
                assert not [text for text in shown if text.startswith(("INTRUDER", "INITECH", "ACME", "SCRIBE"))]


async def test_the_a2a_door_writes_nothing_a_rule_refuses(
    database_url: str,
    room_addr: str,
    acme: CompanyKey,
    acme_gw: GatewayStub,
    globex: CompanyKey,
    globex_gw: GatewayStub,
    initech: CompanyKey,
    initech_gw: GatewayStub,
    pool: asyncpg.Pool,
) -> None:
    """member-writes (a client whose company is not a member), assignee-in-room (a tenant agent whose
    company is not), and CancelTask by anyone but the task's sender: refused, and nothing written."""
    room = await create_room(acme_gw)
    await join_room(acme_gw, globex_gw, room.room_id)
    helper = await agent_of(acme_gw, "helper")
    outsider = await agent_of(initech_gw, "outsider")
    tenant = tenant_of(room.room_id, helper.agent_id)
    async with running_gateway(
        database_url, room_addr, "127.0.0.1:9", QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false", **FAST
    ) as addr:
        async with a2a_client(addr, tenant, globex.secret) as (_, card):
            sent = await send_once(card, globex.secret, _message("a task for Acme's helper"), wait=False)
        before = await room_state(pool)
        # Initech is not a member: it sends nothing to the room's agent.
        with pytest.raises(A2AError, match=r"NOT_FOUND.*room"):
            await send_once(card, initech.secret, _message("let me in"), wait=False)
        # Initech's agent is not in the room: no task is sent to it.
        out_card = a2a_pb2.AgentCard()
        out_card.CopyFrom(card)
        out_card.supported_interfaces[0].tenant = tenant_of(room.room_id, outsider.agent_id)
        with pytest.raises(A2AError, match=r"NOT_FOUND.*agent not found in this room"):
            await send_once(out_card, globex.secret, _message("for the outsider"), wait=False)
        assert await room_state(pool) == before

        # Only the sender cancels: neither Acme (the agent's own company) nor Initech, once a member.
        await join_room(acme_gw, initech_gw, room.room_id)
        before = await room_state(pool)
        for secret in (acme.secret, initech.secret):
            async with a2a_client(addr, tenant, secret) as (client, _):
                with pytest.raises(TaskNotFoundError):
                    await client.cancel_task(a2a_pb2.CancelTaskRequest(id=sent.id))
        assert await room_state(pool) == before
    task = (await acme_gw.GetTask(gateway_pb2.GetTaskRequest(room_id=room.room_id, task_id=sent.id), timeout=T)).task
    assert task.status == common_pb2.TASK_STATUS_OPEN and list(task.updates) == []
