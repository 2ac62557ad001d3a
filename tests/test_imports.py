"""The modules of the common package import each other without a circle: every import counts, those
inside functions and under TYPE_CHECKING too (a circle hidden in a function still ties the modules
together, and works only by the order in which they happen to load)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "quayutec"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in it (``from a import b`` may name the module a.b)."""
    found: set[str] = set()
    package = module_name(path).rpartition(".")[0] if path.name != "__init__.py" else module_name(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name in modules)
    found.discard(module_name(path))
    return found


def import_graph() -> dict[str, set[str]]:
    paths = [p for p in PACKAGE.rglob("*.py") if "v1" not in p.relative_to(PACKAGE).parts]
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


def test_the_common_package_has_no_import_circle() -> None:
    graph = import_graph()
    assert {"quayutec.config", "quayutec.settings", "quayutec.tls", "quayutec.envread"} <= set(graph)
    # The three that once imported each other (two of them inside functions).
    assert "quayutec.config" not in graph["quayutec.settings"] | graph["quayutec.tls"]
    found = circle(graph)
    assert found is None, "import circle: " + " -> ".join(found or ())


def test_a_circle_is_found_even_inside_a_function() -> None:
    """The checker itself: a circle through a function-level import is reported."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circle(graph) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": set()}) is None
    source = PACKAGE / "tls.py"
    assert "quayutec.settings" in imports_of(source, {"quayutec.settings", "quayutec.tls"})
