"""The ledger against the room: every run's ledger row compared with the rows the room holds for that run.

A run writes into a room through the Room only, each write carrying its run id (``run_id`` of the
message, memory line, task or task update) and recording it in the run's row in the same transaction:
the reply's id as ``posted_message_id``, each declared action done as ``ACTION_OUTCOME_DONE`` with the
written row's id as its ``result_id``. So, whatever failed on the way, each run's row must name exactly
what the room holds with its run id, and the room must hold nothing with a run id that has no row.

``ledger_disagreements`` reads both from the database (any asyncpg connection or pool on the Room's
database, a test's or a cluster bed's surviving primary) and says, in words, each place they disagree;
the crash and lost-answer tests require none (tests/runtime/test_crash.py, test_lost_answers.py), and
the cluster's fault tests can call it on the surviving primary the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# Where the room keeps what each kind of declared action writes.
_TABLE_OF_KIND = {
    "ACTION_KIND_REMEMBER": "memory_lines",
    "ACTION_KIND_CREATE_TASK": "tasks",
    "ACTION_KIND_UPDATE_TASK": "task_updates",
    "ACTION_KIND_CLOSE_TASK": "task_updates",
}

_READ = """
WITH scoped AS (
    SELECT r.run_id, r.status, r.posted_message_id, r.actions FROM runs AS r
    WHERE $1::uuid[] IS NULL OR r.room_id = ANY($1::uuid[])
), written AS (
    SELECT m.run_id, 'messages' AS place, m.message_id::text AS id FROM messages AS m
    WHERE m.author_kind = 'agent' AND m.run_id IS NOT NULL AND ($1::uuid[] IS NULL OR m.room_id = ANY($1::uuid[]))
    UNION ALL
    SELECT l.run_id, 'memory_lines', l.memory_id::text FROM memory_lines AS l
    WHERE l.run_id IS NOT NULL AND ($1::uuid[] IS NULL OR l.room_id = ANY($1::uuid[]))
    UNION ALL
    SELECT t.run_id, 'tasks', t.task_id::text FROM tasks AS t
    WHERE t.run_id IS NOT NULL AND ($1::uuid[] IS NULL OR t.room_id = ANY($1::uuid[]))
    UNION ALL
    SELECT u.run_id, 'task_updates', u.update_id::text FROM task_updates AS u JOIN tasks AS t USING (task_id)
    WHERE u.run_id IS NOT NULL AND ($1::uuid[] IS NULL OR t.room_id = ANY($1::uuid[]))
)
SELECT s.run_id, s.status, s.posted_message_id, s.actions::text AS actions,
    COALESCE((SELECT jsonb_agg(jsonb_build_array(w.place, w.id)) FROM written AS w WHERE w.run_id = s.run_id),
        '[]'::jsonb)::text AS written
FROM scoped AS s
UNION ALL
SELECT w.run_id, NULL, NULL, NULL, jsonb_agg(jsonb_build_array(w.place, w.id))::text
FROM written AS w
WHERE NOT EXISTS (SELECT 1 FROM runs AS r WHERE r.run_id = w.run_id)
GROUP BY w.run_id
"""


async def ledger_disagreements(db: Any, room_ids: Sequence[str] | None = None) -> list[str]:
    """Each disagreement between a run's ledger row and the room's rows of that run, in words (none: they
    agree). ``db``: an asyncpg connection or pool on the Room's database; ``room_ids``: only these rooms
    (None: every room)."""
    rows = await db.fetch(_READ, None if room_ids is None else list(room_ids))
    found: list[str] = []
    for row in rows:
        run_id = row["run_id"]
        written: dict[str, str] = {id_: place for place, id_ in json.loads(row["written"])}
        if row["status"] is None:
            found.append(f"run {run_id}: the room holds {sorted(written.items())} but the ledger has no row for it")
            continue
        replies = sorted(i for i, place in written.items() if place == "messages")
        if len(replies) > 1:
            found.append(f"run {run_id}: {len(replies)} replies in the room ({replies}); a run posts one")
        named = row["posted_message_id"]
        if named != (replies[0] if replies else ""):
            held = f"reply {replies[0]}" if replies else "no reply"
            found.append(f"run {run_id} ({row['status']}): the ledger names reply {named!r}, the room holds {held}")
        done: dict[str, str] = {}
        for action in json.loads(row["actions"]):
            index = action.get("index", 0)
            kind = action.get("kind", "")
            outcome = action.get("outcome", "")
            result = action.get("result_id", "")
            if outcome == "ACTION_OUTCOME_DONE":
                if result not in written:
                    found.append(
                        f"run {run_id}: action {index} ({kind}) is recorded done as {result!r}, which the room "
                        "does not hold for this run"
                    )
                elif written[result] != _TABLE_OF_KIND.get(kind):
                    found.append(f"run {run_id}: action {index} ({kind}) names {result}, a row of {written[result]}")
                done[result] = kind
        for id_, place in sorted(written.items()):
            if place != "messages" and id_ not in done:
                found.append(
                    f"run {run_id} ({row['status']}): the room holds {place} {id_} of this run, which no action of "
                    "its ledger row records done"
                )
    return found
