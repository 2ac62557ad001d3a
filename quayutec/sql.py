"""Named SQL queries: one ``.sql`` file per component, loaded once, looked up by name.

Each loaded query is also known by its text (``query_name``): a database span that sent it is named
``<component>/<name>`` (e.g. ``room/post_check``) rather than by the SQL's first word.

A part several queries share is written once, under a ``-- fragment: <name>`` line, and named in each
query that uses it as ``{{<name>}}``, replaced by its text when the file is loaded (the Room's fenced
ledger write, for one, is the same CTEs in every statement that writes a run's row). ``{{<name>+<n>}}``
shifts the fragment's parameters by ``n`` (``$1`` becomes ``$<1+n>``), for a statement whose own
parameters come first. A fragment may name other fragments (not itself, however indirectly). A
fragment is not a query; a name that is not a fragment of the file is an error when it is loaded.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

# The text of every query loaded in this process -> "<component>/<name>" (constant texts, so the
# table only grows to the number of queries there are).
_LOADED: dict[str, str] = {}

_NAME_LINE = re.compile(r"^--\s*(?P<kind>name|fragment):\s*(?P<name>[a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
_FRAGMENT_USE = re.compile(r"\{\{(?P<name>[a-z_][a-z0-9_]*)(?:\+(?P<shift>[0-9]+))?\}\}")
_PARAMETER = re.compile(r"\$(?P<n>[0-9]+)")


class Queries(Mapping[str, str]):
    """The queries of one file, keyed by the ``-- name: <name>`` line above each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        text = path.read_text(encoding="utf-8")
        marks = list(_NAME_LINE.finditer(text))
        queries: dict[str, str] = {}
        fragments: dict[str, str] = {}
        for i, mark in enumerate(marks):
            end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
            body = _strip_comments(text[mark.end() : end])
            kind, name = mark.group("kind"), mark.group("name")
            into = queries if kind == "name" else fragments
            if name in into:
                raise ValueError(f"{path}: {'query' if kind == 'name' else 'fragment'} {name!r} defined twice")
            if not body:
                raise ValueError(f"{path}: {'query' if kind == 'name' else 'fragment'} {name!r} is empty")
            into[name] = body
        if not queries:
            raise ValueError(f"{path}: no '-- name: ...' queries found")

        def expand(text: str, within: tuple[str, ...]) -> str:
            def fragment(use: re.Match[str]) -> str:
                name = use.group("name")
                if name not in fragments:
                    raise ValueError(f"{path}: {use.group(0)} names no '-- fragment: {name}' of the file")
                if name in within:
                    raise ValueError(f"{path}: fragment {name!r} names itself (through {' -> '.join(within)})")
                body = expand(fragments[name], (*within, name))
                shift = int(use.group("shift") or 0)
                return _PARAMETER.sub(lambda p: f"${int(p.group('n')) + shift}", body) if shift else body

            return _FRAGMENT_USE.sub(fragment, text)

        self._queries = {name: expand(body, ()) for name, body in queries.items()}
        self.fragments: Mapping[str, str] = fragments
        component = path.parent.parent.name if path.parent.name == "sql" else path.stem
        for name, body in self._queries.items():
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
