"""The console's rename, retire and archive forms (issue 49) over HTTP: a real console, Gateway, Room and
PostgreSQL. Each is offered only where the Room's rules allow it, and what the Room refuses is shown in
words on the page."""

from __future__ import annotations

import html

from quayutec.v1 import gateway_pb2
from tests.console.browser import running_console
from tests.console.test_sessions import browser, signed_in, world
from tests.gateway.helpers import create_room, register_agent
from tests.harness.gateway import join_room


async def test_rooms_and_agents_are_renamed_retired_and_archived_from_the_console(database_url: str) -> None:
    async with world(database_url) as w, running_console(w.gateway_addr) as base:
        ours = await create_room(w.acme_gw, "launch")
        await create_room(w.acme_gw, "other")
        theirs = await create_room(w.globex_gw, "their room")
        await join_room(w.globex_gw, w.acme_gw, theirs.room_id)
        agent = await register_agent(w.acme_gw, "planner")
        async with browser(base) as client:
            csrf = await signed_in(client, w.acme.secret)
            listed = (await client.get("/rooms")).text
            # Rename and archive are offered for the room Acme created, not for the one it joined.
            assert f'name="room_id" value="{ours.room_id}"' in listed
            assert f'name="room_id" value="{theirs.room_id}"' not in listed
            assert listed.count('value="archive"') == 2

            renamed = await client.post("/rooms", data={"csrf": csrf, "room_id": ours.room_id, "name": "liftoff"})
            assert renamed.status_code == 200 and "Renamed to liftoff." in renamed.text
            taken = await client.post("/rooms", data={"csrf": csrf, "room_id": ours.room_id, "name": "Other"})
            assert taken.status_code == 400 and "already created a room named" in html.unescape(taken.text)
            # A forged form for the joined room: the Room's rule refuses it, in words.
            forged = await client.post("/rooms", data={"csrf": csrf, "room_id": theirs.room_id, "action": "archive"})
            assert forged.status_code == 400 and "only the company that created room" in html.unescape(forged.text)

            archived = await client.post("/rooms", data={"csrf": csrf, "room_id": ours.room_id, "action": "archive"})
            assert archived.status_code == 200 and "liftoff is archived" in archived.text
            assert archived.text.count('value="archive"') == 1  # offered for "other" only now
            refused = await client.post(
                f"/rooms/{ours.room_id}", data={"csrf": csrf, "person": "Ana", "idem": "k1", "body": "late"}
            )
            assert refused.status_code == 400 and "is archived" in html.unescape(refused.text)

            agents = (await client.get("/agents")).text
            assert f'name="agent_id" value="{agent.agent_id}"' in agents and 'value="retire"' in agents
            moved = await client.post("/agents", data={"csrf": csrf, "agent_id": agent.agent_id, "name": "lead"})
            assert moved.status_code == 200 and "Renamed to lead." in moved.text
            retired = await client.post("/agents", data={"csrf": csrf, "agent_id": agent.agent_id, "action": "retire"})
            assert retired.status_code == 200 and "lead is retired" in retired.text
            assert 'value="retire"' not in retired.text and "retired" in retired.text

        rooms = await w.acme_gw.ListRooms(gateway_pb2.ListRoomsRequest(), timeout=10)
        assert {r.name: r.HasField("archived_at") for r in rooms.rooms} == {
            "liftoff": True,
            "other": False,
            "their room": False,
        }
        agents_now = await w.acme_gw.ListAgents(gateway_pb2.ListAgentsRequest(), timeout=10)
        assert [(a.name, a.HasField("retired_at")) for a in agents_now.agents] == [("lead", True)]
