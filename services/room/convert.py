"""Rows to protos and back: enum names as stored in the database, timestamps, authors."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp

from quayutec.v1 import common_pb2

Row = Mapping[str, Any]

PROVIDER_PREFIX = "PROVIDER_"
AUTHOR_KIND_PREFIX = "AUTHOR_KIND_"
TASK_STATUS_PREFIX = "TASK_STATUS_"
VISIBILITY_PREFIX = "MEMORY_VISIBILITY_"
WAKE_KIND_PREFIX = "WAKE_KIND_"
RUN_STATUS_PREFIX = "RUN_STATUS_"
RUN_STEP_PREFIX = "RUN_STEP_"
ACTION_RIGHT_PREFIX = "ACTION_RIGHT_"
ACTION_KIND_PREFIX = "ACTION_KIND_"
DECISION_PREFIX = "DECISION_"
WAITPOINT_STATUS_PREFIX = "WAITPOINT_STATUS_"
INVITATION_STATUS_PREFIX = "INVITATION_STATUS_"

# The rights of AgentRights, each a column of agent_rights.
RIGHT_FIELDS = ("remember", "create_task", "update_task", "close_task", "cross_company_task")
# What applies when neither the agent nor its company set a right.
BUILT_IN_RIGHT = "auto"


def enum_to_text(enum: Any, value: int, prefix: str) -> str:
    """``PROVIDER_OPENAI`` -> ``openai``: the name a row stores."""
    return str(enum.Name(value)).removeprefix(prefix).lower()


def text_to_enum(enum: Any, text: str, prefix: str) -> Any:
    """``openai`` -> ``PROVIDER_OPENAI`` (the enum's value type)."""
    return enum.Value(prefix + text.upper())


# Whole seconds and microseconds since the epoch by integer arithmetic: a third of the CPU of
# Timestamp.FromDatetime (which goes through a time tuple), the same value; a naive datetime is UTC.
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NAIVE_EPOCH = datetime(1970, 1, 1)


def timestamp(dt: datetime | None) -> Timestamp | None:
    if dt is None:
        return None
    since = dt - (_NAIVE_EPOCH if dt.tzinfo is None else _EPOCH)
    return Timestamp(seconds=since.days * 86400 + since.seconds, nanos=since.microseconds * 1000)


def _s(value: Any) -> str:
    return "" if value is None else str(value)


def author(row: Row, prefix: str = "author_") -> common_pb2.Author:
    return common_pb2.Author(
        kind=text_to_enum(common_pb2.AuthorKind, row[f"{prefix}kind"], AUTHOR_KIND_PREFIX),
        company_id=_s(row[f"{prefix}company_id"]),
        person=_s(row[f"{prefix}person"]),
        agent_id=_s(row[f"{prefix}agent_id"]),
        # Kept for persons' messages and tasks only (other rows have no such column).
        verified_by=_s(row.get(f"{prefix}verified_by")),
    )


def company(row: Row) -> common_pb2.Company:
    return common_pb2.Company(
        company_id=str(row["company_id"]), name=row["name"], created_at=timestamp(row["created_at"])
    )


def room(row: Row) -> common_pb2.Room:
    return common_pb2.Room(
        room_id=str(row["room_id"]),
        name=row["name"],
        created_by_company_id=str(row["created_by_company_id"]),
        created_at=timestamp(row["created_at"]),
        archived_at=timestamp(row.get("archived_at")),
    )


def member(row: Row) -> common_pb2.RoomMember:
    return common_pb2.RoomMember(
        room_id=str(row["room_id"]),
        company_id=str(row["company_id"]),
        joined_at=timestamp(row["joined_at"]),
        company_name=_s(row.get("company_name")),
    )


def invitation(row: Row) -> common_pb2.Invitation:
    return common_pb2.Invitation(
        invitation_id=str(row["invitation_id"]),
        room_id=str(row["room_id"]),
        room_name=row["room_name"],
        company_id=str(row["company_id"]),
        company_name=row["company_name"],
        invited_by_company_id=str(row["invited_by_company_id"]),
        invited_by_company_name=row["invited_by_company_name"],
        status=text_to_enum(common_pb2.InvitationStatus, row["status"], INVITATION_STATUS_PREFIX),
        created_at=timestamp(row["created_at"]),
        responded_at=timestamp(row["responded_at"]),
    )


def agent(row: Row) -> common_pb2.Agent:
    return common_pb2.Agent(
        agent_id=str(row["agent_id"]),
        company_id=str(row["company_id"]),
        name=row["name"],
        provider=text_to_enum(common_pb2.Provider, row["provider"], PROVIDER_PREFIX),
        model=row["model"],
        base_url=_s(row["base_url"]),
        system_prompt=row["system_prompt"],
        has_provider_key=bool(row["has_provider_key"]),
        created_at=timestamp(row["created_at"]),
        company_name=_s(row.get("company_name")),
        retired_at=timestamp(row.get("retired_at")),
    )


def message(row: Row) -> common_pb2.Message:
    return common_pb2.Message(
        message_id=str(row["message_id"]),
        room_id=str(row["room_id"]),
        seq=row["seq"],
        author=author(row),
        body=row["body"],
        mention_agent_ids=[str(a) for a in row["mention_agent_ids"]],
        run_id=_s(row["run_id"]),
        created_at=timestamp(row["created_at"]),
    )


def wake(row: Row) -> common_pb2.Wake:
    return common_pb2.Wake(
        wake_id=str(row["wake_id"]),
        agent_id=str(row["agent_id"]),
        room_id=str(row["room_id"]),
        kind=text_to_enum(common_pb2.WakeKind, row["kind"], WAKE_KIND_PREFIX),
        source_id=row["source_id"],
        delivery_attempts=row["delivery_attempts"],
        created_at=timestamp(row["created_at"]),
        traceparent=row["traceparent"],
    )


def task_update(row: Row) -> common_pb2.TaskUpdate:
    return common_pb2.TaskUpdate(
        update_id=str(row["update_id"]),
        task_id=str(row["task_id"]),
        author=author(row),
        note=row["note"],
        status=text_to_enum(common_pb2.TaskStatus, row["status"], TASK_STATUS_PREFIX),
        run_id=_s(row["run_id"]),
        created_at=timestamp(row["created_at"]),
    )


def task(row: Row, updates: Sequence[Row] = ()) -> common_pb2.Task:
    fields: dict[str, Any] = {
        "task_id": str(row["task_id"]),
        "room_id": str(row["room_id"]),
        "from": author(row, "from_"),
        "to_agent_id": str(row["to_agent_id"]),
        "title": row["title"],
        "body": row["body"],
        "status": text_to_enum(common_pb2.TaskStatus, row["status"], TASK_STATUS_PREFIX),
        "updates": [task_update(u) for u in updates],
        "run_id": _s(row["run_id"]),
        "created_at": timestamp(row["created_at"]),
        "updated_at": timestamp(row["updated_at"]),
    }
    return common_pb2.Task(**fields)


def memory_line(row: Row) -> common_pb2.MemoryLine:
    return common_pb2.MemoryLine(
        memory_id=str(row["memory_id"]),
        room_id=str(row["room_id"]),
        author=author(row),
        text=row["text"],
        visibility=text_to_enum(common_pb2.MemoryVisibility, row["visibility"], VISIBILITY_PREFIX),
        run_id=_s(row["run_id"]),
        created_at=timestamp(row["created_at"]),
    )


def file(row: Row) -> common_pb2.File:
    return common_pb2.File(
        file_id=str(row["file_id"]),
        room_id=str(row["room_id"]),
        author=author(row),
        name=row["name"],
        content_type=row["content_type"],
        size_bytes=row["size_bytes"],
        passage_count=row["passage_count"],
        created_at=timestamp(row["created_at"]),
    )


def passage(row: Row) -> common_pb2.Passage:
    return common_pb2.Passage(
        passage_id=str(row["passage_id"]),
        file_id=str(row["file_id"]),
        file_name=row["file_name"],
        ordinal=row["ordinal"],
        text=row["text"],
        rank=float(row["rank"]),
    )


def run(row: Row) -> common_pb2.Run:
    return common_pb2.Run(
        run_id=row["run_id"],
        agent_id=str(row["agent_id"]),
        company_id=_s(row["company_id"]),
        room_id=str(row["room_id"]),
        wake_id=row["wake_id"],
        wake_kind=text_to_enum(common_pb2.WakeKind, row["wake_kind"], WAKE_KIND_PREFIX),
        wake_source_id=row["wake_source_id"],
        status=text_to_enum(common_pb2.RunStatus, row["status"], RUN_STATUS_PREFIX),
        step=text_to_enum(common_pb2.RunStep, row["step"], RUN_STEP_PREFIX),
        posted_message_id=row["posted_message_id"],
        actions=[json_format.ParseDict(a, common_pb2.DeclaredAction()) for a in json.loads(row["actions"])],
        model_attempts=[json_format.ParseDict(a, common_pb2.ModelAttempt()) for a in json.loads(row["model_attempts"])],
        error=row["error"],
        trace_id=row["trace_id"],
        trace_ids=row["trace_ids"],
        active_ms=row["active_ms"],
        started_at=timestamp(row["started_at"]),
        updated_at=timestamp(row["updated_at"]),
        ended_at=timestamp(row["ended_at"]),
        attempt=row["attempt"],
    )


def messages_json(items: Any) -> str:
    """Repeated proto messages as the jsonb array a runs row stores (field names as in the proto)."""
    return json.dumps([json_format.MessageToDict(m, preserving_proto_field_name=True) for m in items])


def _right(text: str | None) -> Any:
    if text is None:
        return common_pb2.ACTION_RIGHT_UNSPECIFIED
    return text_to_enum(common_pb2.ActionRight, text, ACTION_RIGHT_PREFIX)


def agent_rights(row: Row | None, company_id: str, agent_id: str | None) -> common_pb2.AgentRights:
    """Stored rules as a proto; no row means nothing set (every right unspecified)."""
    rights = common_pb2.AgentRights(company_id=company_id, agent_id=agent_id or "")
    for field in RIGHT_FIELDS:
        setattr(rights, field, _right(None if row is None else row[field]))
    return rights


def effective_rights(
    company_default: Row | None, agent_rules: Row | None, company_id: str, agent_id: str | None
) -> common_pb2.AgentRights:
    """Each right from the agent's rules, else the company default, else the built-in ``auto``."""
    rights = common_pb2.AgentRights(company_id=company_id, agent_id=agent_id or "")
    for field in RIGHT_FIELDS:
        chosen = next(
            (r[field] for r in (agent_rules, company_default) if r is not None and r[field] is not None),
            BUILT_IN_RIGHT,
        )
        setattr(rights, field, _right(chosen))
    return rights


def held_action(row: Row) -> common_pb2.HeldAction:
    return common_pb2.HeldAction(
        index=row["action_index"],
        kind=text_to_enum(common_pb2.ActionKind, row["kind"], ACTION_KIND_PREFIX),
        arguments_json=row["arguments_json"],
        decision=text_to_enum(common_pb2.Decision, row["decision"], DECISION_PREFIX),
        decided_by=_s(row["decided_by"]),
        decided_by_verified_by=_s(row.get("decided_by_verified_by")),
        decided_at=timestamp(row["decided_at"]),
    )


def waitpoint(row: Row, held: Sequence[Row]) -> common_pb2.Waitpoint:
    return common_pb2.Waitpoint(
        token=str(row["token"]),
        run_id=row["run_id"],
        agent_id=str(row["agent_id"]),
        company_id=str(row["company_id"]),
        room_id=str(row["room_id"]),
        held=[held_action(h) for h in held],
        status=text_to_enum(common_pb2.WaitpointStatus, row["status"], WAITPOINT_STATUS_PREFIX),
        created_at=timestamp(row["created_at"]),
        expires_at=timestamp(row["expires_at"]),
        traceparent=row["traceparent"],
    )


def room_event(row: Row) -> common_pb2.RoomEvent | None:
    """A read_room_events row as the event it records (None when the reader may not see it): its serialized
    RoomEvent, or its kind with the row it carries (a message, a ledger row, a memory line, or a task with
    its updates, stored as a snapshot).
    The cursor, room and time are the caller's to fill in."""
    if not row["visible"]:
        return None
    if row["detail"] is not None:
        return common_pb2.RoomEvent.FromString(bytes(row["detail"]))
    event = common_pb2.RoomEvent(kind=text_to_enum(common_pb2.RoomEventKind, row["kind"], "ROOM_EVENT_KIND_"))
    if row["message"] is not None:
        event.message.CopyFrom(message(row["message"]))
    elif row["run"] is not None:
        event.run.CopyFrom(run(row["run"]))
    elif row["memory"] is not None:
        event.memory.CopyFrom(memory_line(row["memory"]))
    elif row["task"] is not None:
        event.task.CopyFrom(task(row["task"], row["task_updates"] or ()))
    else:
        raise ValueError(f"room event {row['seq']} ({row['kind']}) carries neither a RoomEvent nor a row it knows")
    return event
