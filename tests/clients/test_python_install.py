"""`pip install ./clients/python` into a fresh venv brings grpcio and protobuf (and what they need)
and nothing else, imports nothing of this repository, and the Python client guide's examples
(docs/clients-python.md) run from that venv against the real stack."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.clients.conftest import check_guide_examples
from tests.harness.sdk_stack import SdkStack

REPO = Path(__file__).resolve().parent.parent.parent
WHEELHOUSE = REPO / ".venv" / "wheelhouse"
EXAMPLES = REPO / "docs" / "examples" / "python_sdk"
CLIENT = str(REPO / "clients" / "python")
# Run in the fresh venv: which of our packages (or their dependencies) it can import, and whether the
# client ships its type marker.
_FOREIGN = "quayutec", "services", "asyncpg", "httpx", "opentelemetry"
_PROBE = f"import importlib.util as u; print([m for m in {_FOREIGN!r} if u.find_spec(m)])"
_TYPED = "import quayutec_client, pathlib; print((pathlib.Path(quayutec_client.__file__).parent / 'py.typed').exists())"
_DISTRIBUTIONS = (
    "import importlib.metadata as m, json; "
    "print(json.dumps({d.metadata['Name'].lower().replace('_', '-'): d.requires or [] for d in m.distributions()}))"
)


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kwargs)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    return done  # type: ignore[no-any-return]


def _installed(python: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = json.loads(_run([str(python), "-c", _DISTRIBUTIONS]).stdout)
    return found


def _needed_by(roots: set[str], installed: dict[str, list[str]]) -> set[str]:
    """``roots`` and everything they require (without extras), by the installed distributions' metadata."""
    needed, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        for text in installed.get(name, []):
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name.lower().replace("_", "-"))
    return needed


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str]]:
    """A fresh venv with ./clients/python installed from the wheelhouse (no index), and what it added."""
    if not (WHEELHOUSE / ".complete").exists():
        pytest.fail("the wheelhouse of the client's packages is missing: run `make test` (it downloads them once)")
    venv = tmp_path_factory.mktemp("client") / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    before = set(_installed(python))
    _run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(WHEELHOUSE), CLIENT],
        cwd=venv,
    )
    return python, set(_installed(python)) - before


def test_installing_the_client_brings_only_grpcio_and_protobuf(client_venv: tuple[Path, set[str]]) -> None:
    python, added = client_venv
    installed = _installed(python)
    assert {"grpcio", "protobuf"} <= _needed_by({"quayutec-client"}, installed)
    assert added == _needed_by({"quayutec-client"}, installed), f"the client pulled in {sorted(added)}"
    assert added - _needed_by({"grpcio", "protobuf"}, installed) == {"quayutec-client"}
    assert _run([str(python), "-c", _PROBE], cwd="/").stdout.strip() == "[]"
    typed = _run([str(python), "-c", _TYPED], cwd="/")
    assert typed.stdout.strip() == "True"


async def test_the_python_guides_examples_run_from_the_fresh_venv(
    client_venv: tuple[Path, set[str]], stack: SdkStack, tmp_path: Path
) -> None:
    python, _ = client_venv

    async def run(name: str, env: dict[str, str]) -> list[str]:
        done = await asyncio.to_thread(
            subprocess.run,
            [str(python), str(EXAMPLES / name)],
            cwd=tmp_path,
            env={"PATH": os.environ.get("PATH", ""), **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, f"{name}: {done.stdout}\n{done.stderr}"
        return done.stdout.splitlines()

    await check_guide_examples(stack, run, "quickstart.py", "follow.py", "follow_rooms.py", tmp_path)
