"""The steps of one agent run as plain async functions on asyncpg and httpx, for the anchors that
``bench/runs.py`` sets beside ours: the DBOS workflow, the Restate handler and the floor run the same
sequence (claim, read the room, call the stand-in, post the reply, record the ledger row), each
wrapping every step in its own way (a DBOS step, a Restate ``ctx.run``, or nothing at all).

The statements are the Room's own (``services/room/sql/queries.sql``) and the Claims table's insert,
so every anchor does the database work ours does, without our gRPC hops or events.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx

from quayutec.crypto import MultiFernet
from quayutec.ledger import run_id_for
from quayutec.sql import Queries
from services.runtime.model import DECLARED_ACTIONS, ChatMessage, ModelRequest, ModelTarget
from services.runtime.model import anthropic as anthropic_wire

MAX_KEY = 2**63 - 1
CLAIM_SQL = (
    "INSERT INTO agent_run_locks (agent_id, wake_id) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING claimed_at"
)

# How a driver runs one named step: ``await do(name, step, *args)`` returns the step's result.
StepRunner = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class RunSteps:
    """What the steps use: the room database, the stand-in provider, the key cipher, the Room's queries."""

    pool: asyncpg.Pool
    http: httpx.AsyncClient
    standin_url: str
    cipher: MultiFernet
    q: Queries
    recent_messages: int = 20

    def named(self) -> dict[str, Callable[..., Awaitable[Any]]]:
        """The steps by the names ``agent_run`` gives them."""
        return {
            "claim": self.claim,
            "read_room": self.read_room,
            "call_model": self.call_model,
            "post_reply": self.post_reply,
            "record_run": self.record_run,
        }

    async def claim(self, agent_id: str, wake_id: str) -> bool:
        return await self.pool.fetchval(CLAIM_SQL, agent_id, wake_id) is not None

    async def read_room(self, agent_id: str, room_id: str, source_id: str) -> dict[str, Any]:
        q = self.q
        agent = await self.pool.fetchrow(q["get_agent_credentials"], uuid.UUID(agent_id))
        key = self.cipher.decrypt(agent["provider_key_encrypted"]).decode()
        company_id = agent["company_id"]
        messages, tasks, memory = await asyncio.gather(
            self.pool.fetch(q["list_messages_newest_first"], uuid.UUID(room_id), MAX_KEY, self.recent_messages + 1),
            self.pool.fetch(q["list_tasks"], uuid.UUID(room_id), uuid.UUID(agent_id), "open", 0, 51),
            self.pool.fetch(q["list_memory"], uuid.UUID(room_id), company_id, MAX_KEY, 51),
        )
        recent = list(reversed(messages[: self.recent_messages]))
        wake_text = next((m["body"] for m in recent if str(m["message_id"]) == source_id), "")
        passages: list[str] = []
        if wake_text.strip():
            found = await self.pool.fetch(q["search_passages_all_terms"], uuid.UUID(room_id), wake_text, 5)
            if not found:
                found = await self.pool.fetch(q["search_passages_any_term"], uuid.UUID(room_id), wake_text, 5)
            passages = [p["text"] for p in found]
        lines = ["Recent messages:", *(f"- [{m['author_person']}] {m['body']}" for m in recent)]
        lines += [f"- task {t['task_id']}: {t['title']}" for t in tasks]
        lines += [f"- {m['text']}" for m in memory] + [f"- {p}" for p in passages]
        lines.append(f"You were woken by: {wake_text}" if wake_text else "You were woken.")
        return {
            "company_id": str(company_id),
            "model": agent["model"],
            "system": agent["system_prompt"],
            "key": key,
            "prompt": "\n".join(lines),
        }

    async def call_model(self, view: dict[str, Any]) -> dict[str, Any]:
        target = ModelTarget(provider="anthropic", model=view["model"], api_key=view["key"], base_url=self.standin_url)
        request = ModelRequest(
            system=view["system"],
            messages=(ChatMessage(role="user", content=view["prompt"]),),
            tools=DECLARED_ACTIONS,
            max_tokens=1024,
        )
        url, headers, body = anthropic_wire.build(target, request)
        t0 = time.perf_counter()
        response = await self.http.post(url, headers=headers, json=body)
        duration_ms = int((time.perf_counter() - t0) * 1000)
        response.raise_for_status()
        reply = anthropic_wire.parse(response.content)
        return {"text": reply.text, "duration_ms": duration_ms}

    async def post_reply(self, room_id: str, company_id: str, agent_id: str, run_id: str, text: str) -> str:
        """The Room's own two statements for a post (its checks, then the message), without its events."""
        async with self.pool.acquire() as conn, conn.transaction():
            room_uuid, company_uuid, agent_uuid = uuid.UUID(room_id), uuid.UUID(company_id), uuid.UUID(agent_id)
            dedupe = f"run:{run_id}:reply"
            check = await conn.fetchrow(self.q["post_check"], room_uuid, company_uuid, agent_uuid, [], dedupe)
            if check["earlier"] is not None:
                return str(check["earlier"]["message_id"])
            message_id = uuid.uuid4()
            row = await conn.fetchrow(
                self.q["insert_message_with_wakes"],
                room_uuid,
                message_id,
                "agent",
                company_uuid,
                None,
                agent_uuid,
                text,
                [],
                run_id,
                dedupe,
                [],
                str(message_id),
                "",  # no traceparent: the anchors are not traced
                None,  # an agent's reply: no verified person
            )
            return str(row["message_id"])

    async def record_run(self, row: dict[str, Any]) -> None:
        await self.pool.fetchrow(
            self.q["upsert_run_with_before"],
            row["run_id"],
            uuid.UUID(row["agent_id"]),
            uuid.UUID(row["company_id"]),
            uuid.UUID(row["room_id"]),
            row["wake_id"],
            "message",
            row["source_id"],
            "succeeded",
            "ended",
            row["posted_message_id"],
            "[]",
            json.dumps([{"number": 1, "status_code": 200, "duration_ms": str(row["model_ms"])}]),
            "",
            "",
            row["active_ms"],
            datetime.fromisoformat(row["started_at"]),
            datetime.now(UTC),
            "anchor",  # the fence's attempt: one writer per run here
            [],  # no trace ids: the anchors are not traced
        )


async def agent_run(do: StepRunner, steps: RunSteps, agent_id: str, wake_id: str, room_id: str, source_id: str) -> str:
    """One run: claim, read the room, call the model, post the reply, record it; each step through ``do``."""
    run_id = run_id_for(agent_id, wake_id)
    if not await do("claim", steps.claim, agent_id, wake_id):
        return run_id
    started = time.monotonic()
    started_at = datetime.now(UTC).isoformat()  # after the claim, as our ledger's started_at
    view = await do("read_room", steps.read_room, agent_id, room_id, source_id)
    reply = await do("call_model", steps.call_model, view)
    posted = await do("post_reply", steps.post_reply, room_id, view["company_id"], agent_id, run_id, reply["text"])
    await do(
        "record_run",
        steps.record_run,
        {
            "run_id": run_id,
            "agent_id": agent_id,
            "company_id": view["company_id"],
            "room_id": room_id,
            "wake_id": wake_id,
            "source_id": source_id,
            "posted_message_id": posted,
            "model_ms": reply["duration_ms"],
            "active_ms": int((time.monotonic() - started) * 1000),
            "started_at": started_at,
        },
    )
    return run_id


async def direct(name: str, step: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """The floor's step runner: a plain call, nothing journaled."""
    return await step(*args)
