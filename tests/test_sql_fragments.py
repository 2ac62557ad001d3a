"""quayutec/sql.py's fragments: a shared part of several statements written once, its parameters
shifted for a statement whose own parameters come first."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from quayutec.sql import Queries

ROOM_QUERIES = Path(__file__).resolve().parent.parent / "services" / "room" / "sql" / "queries.sql"


def load(tmp_path: Path, text: str) -> Queries:
    path = tmp_path / "queries.sql"
    path.write_text(text, encoding="utf-8")
    return Queries(path)


def test_a_fragment_is_named_as_is_or_with_its_parameters_shifted(tmp_path: Path) -> None:
    queries = load(
        tmp_path,
        "-- fragment: pair\n-- a comment is not part of it\nx = $1 AND y = $2 AND z = $10\n\n"
        "-- name: alone\nSELECT 1 FROM t WHERE {{pair}};\n\n"
        "-- name: after_three\nSELECT $1, $2, $3 FROM t WHERE {{pair+3}};\n",
    )
    assert queries["alone"] == "SELECT 1 FROM t WHERE x = $1 AND y = $2 AND z = $10"
    assert queries["after_three"] == "SELECT $1, $2, $3 FROM t WHERE x = $4 AND y = $5 AND z = $13"
    assert queries.fragments["pair"] == "x = $1 AND y = $2 AND z = $10"


def test_a_fragment_may_name_another_but_never_itself(tmp_path: Path) -> None:
    queries = load(
        tmp_path,
        "-- fragment: inner\nb = $2\n\n-- fragment: outer\na = $1 AND {{inner}}\n\n"
        "-- name: q\nSELECT 1 FROM t WHERE {{outer+1}};\n",
    )
    assert queries["q"] == "SELECT 1 FROM t WHERE a = $2 AND b = $3"
    with pytest.raises(ValueError, match="names itself"):
        load(tmp_path, "-- fragment: a\nx AND {{b}}\n\n-- fragment: b\ny AND {{a}}\n\n-- name: q\nSELECT {{a}};\n")


@pytest.mark.parametrize("use", ["{{missing}}", "{{missing+2}}"])
def test_a_name_that_is_no_fragment_is_refused_at_load(tmp_path: Path, use: str) -> None:
    with pytest.raises(ValueError, match=re.escape(use)):
        load(tmp_path, f"-- name: q\nSELECT 1 FROM {use};\n")


def test_both_run_context_statements_read_the_room_with_the_same_text() -> None:
    # ReadRunContext without a ledger row, and with one (whose 21 parameters come first): one view of the room.
    queries = Queries(ROOM_QUERIES)
    view, columns = queries.fragments["run_context_view"], queries.fragments["run_context_columns"]

    def shifted(text: str) -> str:
        return re.sub(r"\$(\d+)", lambda m: f"${int(m.group(1)) + 21}", text)

    assert view in queries["run_context"] and columns in queries["run_context"]
    assert shifted(view) in queries["run_context_with_run"] and shifted(columns) in queries["run_context_with_run"]
    assert "$10" in view and "$31" in shifted(view)  # its last parameter, past the ledger row's 21
