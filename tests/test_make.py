"""The Makefile as a person meets it: `make help` lists the targets, `make clean` leaves the tree as a
clone has it. Run on a copy of the Makefile in a folder of its own, so this checkout is never touched."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _make(folder: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    # scripts/jaeger.py (make clean stops a Jaeger first) imports the quayutec package: this checkout's.
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(["make", "-s", *targets], cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def _tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def _copy(tmp_path: Path) -> Path:
    """The Makefile and the files it reads to name its stamps, in a folder of their own."""
    for name in (
        "Makefile",
        "pyproject.toml",
        "clients/python/pyproject.toml",
        "tools/jaeger/go.mod",
        "tools/jaeger/go.sum",
        "scripts/jaeger.py",  # make clean stops a Jaeger of make jaeger first
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def test_make_help_lists_every_target_a_person_runs_with_one_line(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    done = _make(folder)  # `make` alone is `make help`
    assert done.returncode == 0, done.stderr
    assert done.stdout == _make(folder, "help").stdout
    listed = dict(re.findall(r"^  make (\S+)\s+(.+)$", done.stdout, re.M))
    assert len(listed) == len(done.stdout.splitlines()), done.stdout  # one line each
    text = (REPO / "Makefile").read_text()
    phony = set(re.search(r"^\.PHONY: (.+)$", text, re.M).group(1).split())  # type: ignore[union-attr]
    defined = set(re.findall(r"^([a-z][a-z0-9-]*):", text, re.M))
    assert {"demo", "test", "clean", "help"} <= set(listed)
    assert phony & defined - set(listed) == set()  # every target defined here is listed
    assert all(line.strip() for line in listed.values())


def test_make_clean_leaves_the_tree_as_a_clone_has_it(tmp_path: Path) -> None:
    folder = _copy(tmp_path)
    kept = _tree(folder) | {"deploy/k8s/overlays/dev/mtls/ca.crt", "services/x.py"}
    made = [
        ".venv/pyvenv.cfg",
        ".quayutec/stack.log",
        "build/jaeger-0123456789ab/jaeger",
        "quayutec_rooms.egg-info/PKG-INFO",
        "clients/python/src/quayutec_client.egg-info/PKG-INFO",
        "services/__pycache__/x.cpython-311.pyc",
        ".pytest_cache/README.md",
        ".mypy_cache/x",
        ".ruff_cache/x",
        "docs/examples/node/node_modules/x/index.js",
        "clients/typescript/node_modules/x/index.js",
        "clients/typescript/dist/index.js",
        "tests/oidc/node_modules/x/index.js",
    ]
    for name in [*made, "deploy/k8s/overlays/dev/mtls/ca.crt", "services/x.py"]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("x")
    done = _make(folder, "clean")
    assert done.returncode == 0, done.stderr
    assert _tree(folder) == kept
    assert not (folder / "build").exists() and not (folder / "quayutec_rooms.egg-info").exists()
