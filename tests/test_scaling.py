"""docs/scaling.md's plan past one database, held to the SQL: every hot-path statement the plan calls
single-key touches one value of the distribution key (reads PostgreSQL's own parse of it, through
pglast), and every one it lists as not single-key is not, so neither the code nor the plan drifts.

Single-key means: every reference to a distributed table is pinned to one key by an equality with a
query parameter (``room_id = $1``), or, for an INSERT, takes its key from that parameter; every
distributed table of the statement is pinned to the same parameter; reference tables and tables on a
server of their own are free. The check looks for the equality anywhere in the statement, not
scope by scope: a reader of the SQL can confirm what it reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pglast import parse_sql
from pglast.ast import (
    A_Expr,
    ColumnRef,
    DeleteStmt,
    InsertStmt,
    Node,
    ParamRef,
    RangeVar,
    ResTarget,
    SelectStmt,
    String,
    UpdateStmt,
)

from quayutec.sql import Queries

REPO = Path(__file__).resolve().parent.parent
SCALING = REPO / "docs" / "scaling.md"

# The Room's database on Citus: distributed tables and their distribution column; the rest of its
# tables are reference tables (companies, agents, agent_rights). Claims and Gateway keep a
# PostgreSQL each, undistributed (their hot statements are single-row by primary key).
DISTRIBUTED: dict[str, str] = {
    "rooms": "room_id",
    "room_members": "room_id",
    "room_invitations": "room_id",
    "messages": "room_id",
    "tasks": "room_id",
    "task_updates": "room_id",
    "memory_lines": "room_id",
    "files": "room_id",
    "passages": "room_id",
    "runs": "room_id",
    "wake_outbox": "room_id",
    "waitpoints": "room_id",
    "held_actions": "room_id",
    "room_events": "room_id",
}
REFERENCE = ("companies", "agents", "agent_rights")
STATEMENTS = (SelectStmt, UpdateStmt, DeleteStmt, InsertStmt)
OWN_SERVER = ("agent_run_locks", "api_keys", "sign_in_providers", "sign_in_domains")

# The hot path of one wake (docs/architecture.md, "The path of one wake"), statement by statement:
# True where the plan says it touches one room, False where it does not (docs/scaling.md says why and
# what would change).
HOT_PATH: dict[tuple[str, str], bool] = {
    ("gateway", "get_api_key"): True,
    ("room", "is_member"): True,
    ("room", "post_check"): False,
    ("room", "insert_message_with_wakes"): True,
    ("room", "append_room_events"): True,
    ("room", "read_room_events"): True,
    ("room", "room_event_bounds"): True,
    ("room", "lease_wakes"): False,
    ("room", "settle_wake_delivered"): False,
    ("room", "settle_wake_retry"): False,
    ("claims", "claim_once"): True,
    ("claims", "claim_many"): True,
    ("room", "run_context"): False,
    ("room", "upsert_run_with_before"): False,
    ("room", "post_message"): False,
    ("room", "record_run"): False,
    ("room", "run_context_with_run"): False,
    ("room", "write_memory"): False,
    ("room", "create_task"): False,
    ("room", "update_task"): False,
}


def _walk(node: Any, *, into_statements: bool = True) -> list[Any]:
    """Every AST node under ``node`` (itself included); without ``into_statements``, not the nodes of
    the statements nested in it (subqueries keep their own conditions)."""
    found: list[Any] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple | list):
            stack.extend(item)
        elif isinstance(item, Node):
            if not into_statements and found and isinstance(item, STATEMENTS):
                continue
            found.append(item)
            stack.extend(getattr(item, name) for name in item)
    return found


def _children(node: Any) -> list[Any]:
    """The AST nodes directly under ``node`` (through its lists)."""
    found: list[Any] = []
    stack = [getattr(node, name) for name in node] if isinstance(node, Node) else list(node)
    while stack:
        item = stack.pop()
        if isinstance(item, tuple | list):
            stack.extend(item)
        elif isinstance(item, Node):
            found.append(item)
    return found


def _parents(root: Any) -> dict[int, Any]:
    """Each node's parent node, by id."""
    parents: dict[int, Any] = {}
    stack = list(_children(root))
    for top in stack:
        parents[id(top)] = None
    while stack:
        item = stack.pop()
        for child in _children(item):
            parents[id(child)] = item
            stack.append(child)
    return parents


def _column(ref: Any) -> tuple[str | None, str] | None:
    """``(qualifier, column)`` of a ColumnRef (``m.room_id`` -> ``("m", "room_id")``)."""
    if not isinstance(ref, ColumnRef):
        return None
    names = [str(f.sval) for f in ref.fields or () if isinstance(f, String)]
    if not names:
        return None
    return (names[-2] if len(names) > 1 else None, names[-1])


def _param(node: Any) -> int | None:
    """The number of a query parameter, seen through casts (``$1::uuid``)."""
    while node is not None and not isinstance(node, ParamRef):
        node = getattr(node, "arg", None)
    return node.number if isinstance(node, ParamRef) else None


def _pins(statement: Any) -> list[tuple[str | None, str, int]]:
    """``(qualifier, column, parameter)`` of each ``column = $n`` in ``statement``'s own conditions."""
    pins = []
    for node in _walk(statement, into_statements=False):
        if isinstance(node, A_Expr) and [getattr(n, "sval", None) for n in node.name or ()] == ["="]:
            for a, b in ((node.lexpr, node.rexpr), (node.rexpr, node.lexpr)):
                column, param = _column(a), _param(b)
                if column is not None and param is not None:
                    pins.append((column[0], column[1], param))
    return pins


def keys_of(sql: str) -> tuple[set[int], list[str]]:
    """The parameters that pin distributed tables in ``sql``, and the distributed table references
    that nothing pins (``[]`` when all are). A reference is pinned by an equality in the statement
    (SELECT, UPDATE, DELETE) whose FROM or target it is, not by one in another."""
    tree = parse_sql(sql)
    nodes = _walk(tree)
    parents = _parents(tree)
    keys: set[int] = set()
    unpinned: list[str] = []
    inserted = {id(n.relation) for n in nodes if isinstance(n, InsertStmt)}
    for node in nodes:
        target = str(node.relation.relname) if isinstance(node, InsertStmt) and node.relation is not None else ""
        if isinstance(node, InsertStmt) and target in DISTRIBUTED:
            key = _inserted_key(node, DISTRIBUTED[target])
            if key is None:
                unpinned.append(f"INSERT INTO {target}")
            else:
                keys.add(key)
        elif isinstance(node, RangeVar) and node.relname in DISTRIBUTED and id(node) not in inserted:
            owner = parents.get(id(node))
            while owner is not None and not isinstance(owner, STATEMENTS):
                owner = parents.get(id(owner))
            alias = node.alias.aliasname if node.alias is not None else None
            column = DISTRIBUTED[node.relname]
            found = {p for q, c, p in _pins(owner) if c == column and q in (None, alias, node.relname)}
            if found:
                keys |= found
            else:
                unpinned.append(node.relname + (f" {alias}" if alias else ""))
    return keys, unpinned


def _inserted_key(insert: InsertStmt, column: str) -> int | None:
    """The parameter an INSERT puts in its distribution column (VALUES or SELECT list), if one."""
    names = [c.name for c in insert.cols or () if isinstance(c, ResTarget)]
    if column not in names:
        return None
    index = names.index(column)
    select = insert.selectStmt
    if not isinstance(select, SelectStmt):
        return None
    if select.valuesLists:
        rows = {_param(row[index]) for row in select.valuesLists}
        return rows.pop() if len(rows) == 1 else None
    targets = select.targetList or ()
    return _param(targets[index].val) if index < len(targets) else None


def single_key(sql: str) -> bool:
    keys, unpinned = keys_of(sql)
    return not unpinned and len(keys) <= 1


def _statement(service: str, name: str) -> str:
    return Queries(REPO / "services" / service / "sql" / "queries.sql")[name]


def test_the_checker_tells_one_key_from_many() -> None:
    assert single_key("SELECT * FROM messages m WHERE m.room_id = $1 AND m.seq > $2")
    assert single_key("INSERT INTO memory_lines (room_id, text) VALUES ($1, $2)")
    assert single_key("SELECT a.name FROM agents a WHERE a.agent_id = $1")  # a reference table
    assert not single_key("SELECT * FROM messages WHERE message_id = $1")
    assert not single_key("SELECT * FROM messages m JOIN runs r ON r.run_id = m.run_id WHERE m.room_id = $1")
    assert not single_key(
        "SELECT 1 FROM messages WHERE room_id = $1 UNION ALL SELECT 1 FROM messages WHERE room_id = $2"
    )
    assert not single_key("INSERT INTO memory_lines (room_id, text) SELECT room_id, text FROM memory_lines")


@pytest.mark.parametrize(("service", "name"), sorted(HOT_PATH))
def test_each_hot_path_statement_is_as_single_key_as_the_plan_says(service: str, name: str) -> None:
    sql = _statement(service, name)
    keys, unpinned = keys_of(sql)
    if HOT_PATH[(service, name)]:
        assert single_key(sql), (
            f"{service}/{name} is on the hot path and docs/scaling.md plans it on one shard, but it touches "
            f"{'unpinned ' + ', '.join(unpinned) if unpinned else 'keys ' + str(sorted(keys))}: pin every "
            "distributed table to the same room_id parameter, or change the plan"
        )
    else:
        assert not single_key(sql), f"{service}/{name} is single-key now: say so in docs/scaling.md and here"


def test_every_table_has_its_place_in_the_plan() -> None:
    tables = set()
    for schema in (REPO / "services").glob("*/sql/schema.sql"):
        for node in _walk(parse_sql(schema.read_text())):
            if type(node).__name__ == "CreateStmt":
                tables.add(node.relation.relname)
    assert tables == set(DISTRIBUTED) | set(REFERENCE) | set(OWN_SERVER)


def test_docs_state_the_same_plan() -> None:
    text = SCALING.read_text()
    for table, column in DISTRIBUTED.items():
        assert f"| `{table}` | `{column}` |" in text, table
    for table in REFERENCE:
        assert f"| `{table}` | reference |" in text, table
    for (service, name), one in HOT_PATH.items():
        assert f"| `{service}/{name}` | {'one key' if one else 'not one key'} |" in text, name
