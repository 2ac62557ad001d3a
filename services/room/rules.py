"""The room's rules: who may do what to each object of a room, for every author alike.

A person through the Gateway, an A2A client, an agent's declared action through the Runtime: each
write reaches the Room's store, which calls ``enforce`` with the facts read in the write's own
transaction (the author's membership row locked FOR SHARE to commit), so no write follows a check that
has stopped holding. Where the write is one statement (a post, a memory line, a new task), that
statement writes only under facts these rules allow, and ``enforce`` decides from the facts it returns.
``RULES`` is the only place these rules live; docs/rules.md writes the table out, and
tests/room/test_rules.py keeps the two the same.

What a rule does not cover is data, not permission: an id that names nothing (NOT_FOUND), a closed
task or an expired approval (FAILED_PRECONDITION), a malformed request (INVALID_ARGUMENT).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import asdict, dataclass

import grpc

from quayutec.errors import RuleBroken


class Act(enum.Enum):
    """What is done to which object of a room: (object, action) as docs/rules.md names them."""

    POST_MESSAGE = ("message", "post")
    CREATE_TASK = ("task", "create")
    UPDATE_TASK = ("task", "update or close")
    WRITE_MEMORY = ("memory", "write")
    UPLOAD_FILE = ("file", "upload")
    DECIDE_APPROVAL = ("approval", "decide")
    INVITE = ("membership", "invite a company")
    ANSWER_INVITATION = ("membership", "accept or decline an invitation")
    MANAGE_INVITATIONS = ("membership", "list or withdraw a room's invitations")
    LEAVE = ("membership", "leave")
    REMOVE_MEMBER = ("membership", "remove a member")
    SET_RIGHTS = ("agent rights", "set or read")
    SEE_ROOM_AGENTS = ("agent", "see in a room")
    MANAGE_AGENT = ("agent", "rename or retire")
    MANAGE_ROOM = ("room", "rename or archive")

    @property
    def object(self) -> str:
        return self.value[0]

    @property
    def action(self) -> str:
        return self.value[1]


@dataclass(frozen=True)
class Facts:
    """What the rules look at, read by the store in the write's transaction. ``company_id`` is the
    acting company: a person's, an agent author's own company, the deciding or inviting company."""

    company_id: str
    room_id: str = ""
    # The acting company is a member of the room (its membership row locked FOR SHARE).
    member: bool = False
    # The company that created the room.
    creator_id: str = ""
    # The company a membership change is about (removed).
    target_id: str = ""
    task_id: str = ""
    # The task's sender's company, and its assignee's company.
    sender_id: str = ""
    assignee_company_id: str = ""
    # The agent a task is sent to, and whether it is in the room (its company a member).
    assignee_id: str = ""
    assignee_in_room: bool = False
    # The first mentioned agent that is not in the room ("" when all are).
    mention_not_in_room: str = ""
    # The object named (approval token, invitation id, agent id) and the company that owns it ("" when
    # the id names nothing: an unknown id is refused exactly like another company's).
    object_id: str = ""
    owner_id: str = ""
    # On a repeat: the company whose earlier write holds the dedupe key ("" when the write is new).
    repeat_of_company_id: str = ""
    # The room was archived by its creator (read-only).
    archived: bool = False


@dataclass(frozen=True)
class Rule:
    """One row of the table: the acts it governs, who may do them, and the refusal otherwise."""

    rule_id: str
    acts: tuple[Act, ...]
    who: str
    code: grpc.StatusCode
    refusal: str  # formatted with the Facts' fields
    allows: Callable[[Facts], bool]
    # Checked on a repeat too (a write whose dedupe key the room already holds), before the earlier
    # write is answered; the other rules were checked when that write was made.
    on_repeat: bool = False


def _owner(facts: Facts) -> bool:
    return bool(facts.owner_id) and facts.owner_id == facts.company_id


CONTENT = (Act.POST_MESSAGE, Act.CREATE_TASK, Act.UPDATE_TASK, Act.WRITE_MEMORY, Act.UPLOAD_FILE)

# Checked in this order: for each act, the first rule that does not allow it refuses it.
RULES: tuple[Rule, ...] = (
    Rule(
        "member-writes",
        CONTENT,
        "a member company of the room: its people, its agents",
        grpc.StatusCode.PERMISSION_DENIED,
        "company {company_id} is not a member of room {room_id}",
        lambda f: f.member,
        on_repeat=True,
    ),
    Rule(
        "room-open",
        (*CONTENT, Act.INVITE),
        "in a room that is not archived (an archived room is read-only; its history stays readable)",
        grpc.StatusCode.FAILED_PRECONDITION,
        "room {room_id} is archived: it is read-only (its messages, tasks, memory and files stay readable)",
        lambda f: not f.archived,
    ),
    Rule(
        "repeat-own-write",
        CONTENT,
        "a repeat (a dedupe key the room holds) answers only the same company's earlier write",
        grpc.StatusCode.ALREADY_EXISTS,
        "that dedupe_key is taken in room {room_id} by another company's write; use keys of your own",
        lambda f: not f.repeat_of_company_id or f.repeat_of_company_id == f.company_id,
        on_repeat=True,
    ),
    Rule(
        "mentions-in-room",
        (Act.POST_MESSAGE,),
        "mentioning only agents whose company is a member",
        grpc.StatusCode.NOT_FOUND,
        "mentioned agent {mention_not_in_room} is not in room {room_id} (unknown, or its company is not a member)",
        lambda f: not f.mention_not_in_room,
    ),
    Rule(
        "assignee-in-room",
        (Act.CREATE_TASK,),
        "to an agent whose company is a member",
        grpc.StatusCode.NOT_FOUND,
        "agent {assignee_id} is not in room {room_id} (unknown, or its company is not a member)",
        lambda f: f.assignee_in_room,
    ),
    Rule(
        "task-sender-or-assignee",
        (Act.UPDATE_TASK,),
        "the company that sent the task, or the company of the agent it is assigned to",
        grpc.StatusCode.PERMISSION_DENIED,
        "only the company that sent task {task_id} or the company of its assignee may update or close it; "
        "company {company_id} is neither",
        lambda f: f.company_id in (f.sender_id, f.assignee_company_id),
    ),
    Rule(
        "approval-owner",
        (Act.DECIDE_APPROVAL,),
        "the company whose agent's run is parked on it",
        grpc.StatusCode.NOT_FOUND,
        "approval {object_id} not found",
        _owner,
    ),
    Rule(
        "member-manages",
        (Act.INVITE, Act.LEAVE, Act.REMOVE_MEMBER, Act.MANAGE_INVITATIONS, Act.MANAGE_ROOM),
        "a member company of the room",
        grpc.StatusCode.NOT_FOUND,
        "room {room_id} not found",
        lambda f: f.member,
    ),
    Rule(
        "invitee-answers",
        (Act.ANSWER_INVITATION,),
        "the invited company",
        grpc.StatusCode.NOT_FOUND,
        "invitation {object_id} not found among your company's invitations",
        _owner,
    ),
    Rule(
        "creator-manages-invitations",
        (Act.MANAGE_INVITATIONS,),
        "the room's creator; an invitation's sender may withdraw it too",
        grpc.StatusCode.PERMISSION_DENIED,
        "only the company that created room {room_id} (or, to withdraw one, the invitation's sender) may do this; "
        "company {company_id} is neither",
        lambda f: f.company_id == f.creator_id or _owner(f),
    ),
    Rule(
        "creator-stays",
        (Act.LEAVE,),
        "any member but the room's creator",
        grpc.StatusCode.FAILED_PRECONDITION,
        "your company created room {room_id}; its creator cannot leave it (remove the other members instead)",
        lambda f: f.company_id != f.creator_id,
    ),
    Rule(
        "creator-removes",
        (Act.REMOVE_MEMBER,),
        "the room's creator",
        grpc.StatusCode.PERMISSION_DENIED,
        "only the company that created room {room_id} may remove its members",
        lambda f: f.company_id == f.creator_id,
    ),
    Rule(
        "creator-not-removed",
        (Act.REMOVE_MEMBER,),
        "another member than the creator",
        grpc.StatusCode.FAILED_PRECONDITION,
        "the creator of room {room_id} cannot remove itself",
        lambda f: f.target_id != f.creator_id,
    ),
    Rule(
        "creator-manages-room",
        (Act.MANAGE_ROOM,),
        "the room's creator",
        grpc.StatusCode.PERMISSION_DENIED,
        "only the company that created room {room_id} may rename or archive it; company {company_id} did not",
        lambda f: f.company_id == f.creator_id,
    ),
    Rule(
        "room-agents",
        (Act.SEE_ROOM_AGENTS,),
        "a member company of the room sees every member company's agents by id, name and company; an "
        "agent's provider, model, address, prompt and key only its own company",
        grpc.StatusCode.NOT_FOUND,
        "room {room_id} not found",
        lambda f: f.member,
    ),
    Rule(
        "own-agent-rights",
        (Act.SET_RIGHTS,),
        "the agent's own company",
        grpc.StatusCode.NOT_FOUND,
        "agent {object_id} not found in company {company_id}",
        _owner,
    ),
    Rule(
        "own-agent",
        (Act.MANAGE_AGENT,),
        "the agent's own company",
        grpc.StatusCode.NOT_FOUND,
        "agent {object_id} not found in company {company_id}",
        _owner,
    ),
)


# What a member company sees of another member company's agent in the room (the rule `room-agents`);
# its own agents it sees whole. The names are the fields of quayutec.v1.Agent.
AGENT_FIELDS_SEEN_BY_OTHERS = ("agent_id", "company_id", "company_name", "name", "created_at", "retired_at")


def agent_fields_seen(reader_id: str, owner_id: str) -> tuple[str, ...] | None:
    """The fields of an agent of ``owner_id`` that company ``reader_id`` sees in a room they share:
    None for every field (its own agent), else AGENT_FIELDS_SEEN_BY_OTHERS."""
    return None if reader_id == owner_id else AGENT_FIELDS_SEEN_BY_OTHERS


def rules_of(act: Act) -> list[Rule]:
    """The rules that govern ``act``, in the order they are checked."""
    return [rule for rule in RULES if act in rule.acts]


def enforce(act: Act, facts: Facts, *, repeat: bool = False) -> None:
    """Raise the refusal of ``act`` by the first rule that does not allow it (a RuleBroken naming the
    rule, in its words); return when every rule allows it. A ``repeat`` (``facts.repeat_of_company_id``
    set) is checked by the rules marked ``on_repeat``, before the earlier write is answered."""
    for rule in rules_of(act):
        if repeat and not rule.on_repeat:
            continue
        if not rule.allows(facts):
            raise RuleBroken(rule.code, rule.rule_id, rule.refusal.format(**asdict(facts)))
