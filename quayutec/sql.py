"""Named SQL queries: one ``.sql`` file per component, loaded once, looked up by name.

Each loaded query is also known by its text (``query_name``): a database span that sent it is named
``<component>/<name>`` (e.g. ``room/post_check``) rather than by the SQL's first word.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

# The text of every query loaded in this process -> "<component>/<name>" (constant texts, so the
# table only grows to the number of queries there are).
_LOADED: dict[str, str] = {}

_NAME_LINE = re.compile(r"^--\s*name:\s*(?P<name>[a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


class Queries(Mapping[str, str]):
    """The queries of one file, keyed by the ``-- name: <name>`` line above each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        text = path.read_text(encoding="utf-8")
        marks = list(_NAME_LINE.finditer(text))
        if not marks:
            raise ValueError(f"{path}: no '-- name: ...' queries found")
        queries: dict[str, str] = {}
        for i, mark in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
            body = _strip_comments(text[mark.end() : end])
            name = mark.group("name")
            if name in queries:
                raise ValueError(f"{path}: query {name!r} defined twice")
            if not body:
                raise ValueError(f"{path}: query {name!r} is empty")
            queries[name] = body
        self._queries = queries
        component = path.parent.parent.name if path.parent.name == "sql" else path.stem
        for name, body in queries.items():
            _LOADED.setdefault(body, f"{component}/{name}")

    def __getitem__(self, name: str) -> str:
        try:
            return self._queries[name]
        except KeyError:
            raise KeyError(f"{self.path.name} has no query named {name!r}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._queries)

    def __len__(self) -> int:
        return len(self._queries)


def _strip_comments(body: str) -> str:
    lines = [line for line in body.strip().splitlines() if not line.lstrip().startswith("--")]
    return "\n".join(lines).strip().rstrip(";").strip()


def query_name(sql: str) -> str | None:
    """``<component>/<name>`` of a loaded named query whose text is ``sql``; None for any other SQL."""
    return _LOADED.get(sql)
