"""The docs explain themselves and stay true: every relative link resolves inside the repository,
no file outside it is referred to, and the API guide's grpcurl, Python and Node examples run as
shown against a real Room and Gateway on loopback."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quayutec.db import create_pool
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc
from services.gateway.a2a import tenant_of
from services.gateway.auth import create_api_key
from tests.harness.channels import service_channel
from tests.harness.gateway import authed_gateway, running_gateway
from tests.harness.room import running_room

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
NODE_EXAMPLES = DOCS / "examples" / "node"
MARKDOWN = sorted(
    p for p in REPO.rglob("*.md") if not {".venv", "node_modules", ".pytest_cache"} & set(p.relative_to(REPO).parts)
)
# Written on another branch (the durability contract); linked from docs/README.md before it lands.
PENDING = {DOCS / "durability.md"}
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_EXAMPLE = re.compile(r"<!-- example: (\S+) -->\n```[a-z]*\n(.*?)```", re.S)


def broken_links(md: Path) -> list[str]:
    """Relative links of ``md`` that point at nothing, or outside the repository."""
    broken = []
    for target in _LINK.findall(md.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (md.parent / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(REPO):
            broken.append(f"{target} (outside the repository)")
        elif not path.exists() and path not in PENDING:
            broken.append(f"{target} (no such file)")
    return broken


def test_the_link_check_catches_a_broken_link() -> None:
    probe = DOCS / "examples" / "_probe.md"
    probe.write_text("[a](missing.md) [b](../../../outside.md) [c](https://example.org) [d](#here) [e](../api.md)")
    try:
        assert broken_links(probe) == ["missing.md (no such file)", "../../../outside.md (outside the repository)"]
    finally:
        probe.unlink()


def test_every_relative_link_resolves_inside_the_repository() -> None:
    assert {"README.md", "architecture.md", "api.md", "operations.md"} <= {p.name for p in DOCS.glob("*.md")}
    found = {f"{md.relative_to(REPO)}: {b}" for md in MARKDOWN for b in broken_links(md)}
    assert found == set()


def test_nothing_refers_to_a_design_document_outside_the_project() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    outside = "DESIGN" + ".md"  # spelled apart so this file does not name it
    named = [f for f in tracked if (REPO / f).is_file() and outside in (REPO / f).read_text(errors="replace")]
    assert named == []


def test_the_api_guide_shows_the_examples_as_they_are() -> None:
    shown = dict(_EXAMPLE.findall((DOCS / "api.md").read_text()))
    assert set(shown) == {
        "examples/grpcurl.sh",
        "examples/python_client.py",
        "examples/node/client.js",
        "examples/a2a_client.py",
        "examples/watch_room.py",
    }
    for name, text in shown.items():
        assert text == (DOCS / name).read_text(), f"docs/api.md shows an old copy of docs/{name}"


def test_the_client_guides_show_their_examples_as_they_are() -> None:
    """Their examples run in tests/clients (from a fresh venv, and from the packed npm package)."""
    expected = {
        "clients-python.md": {
            "examples/python_sdk/quickstart.py",
            "examples/python_sdk/follow.py",
            "examples/python_sdk/follow_rooms.py",
        },
        "clients-typescript.md": {
            "examples/typescript_sdk/quickstart.mjs",
            "examples/typescript_sdk/follow.mjs",
            "examples/typescript_sdk/follow_rooms.mjs",
        },
    }
    for page, names in expected.items():
        shown = dict(_EXAMPLE.findall((DOCS / page).read_text()))
        assert set(shown) == names, page
        for name, text in shown.items():
            assert text == (DOCS / name).read_text(), f"docs/{page} shows an old copy of docs/{name}"


def _tool(name: str, how: str) -> str:
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        pytest.fail(f"{name} is not installed, so the API guide's example cannot run: {how}")
    return found


def _without_grpcurl(path: str) -> str:
    """``path`` less every folder that holds a grpcurl, this interpreter's (the venv's bin) too."""
    venv_bin = Path(sys.executable).parent
    return os.pathsep.join(
        d for d in path.split(os.pathsep) if d and Path(d) != venv_bin and not (Path(d) / "grpcurl").exists()
    )


async def test_the_api_examples_run_against_a_real_gateway(database_url: str) -> None:
    # The grpcurl example runs as the guide says, with no .venv/bin on PATH: it finds the checkout's.
    if not (REPO / ".venv" / "bin" / "grpcurl").exists():
        pytest.fail("no .venv/bin/grpcurl in this checkout: `make test` makes .venv with the dev extra, which ships it")
    node = _tool("node", "install Node.js 18 or newer")
    if not (NODE_EXAMPLES / "node_modules" / "@grpc" / "grpc-js").exists():
        pytest.fail("the Node example's packages are missing: run `npm ci` in docs/examples/node (make test does)")
    pool = await create_pool(database_url, min_size=1, max_size=2)
    try:
        async with (
            running_room(database_url) as room_addr,
            running_gateway(
                database_url, room_addr, "127.0.0.1:9", QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false"
            ) as gateway_addr,
        ):
            async with service_channel(room_addr, "admin") as channel:
                room = room_pb2_grpc.RoomServiceStub(channel)
                company = (await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name="Acme"))).company
            _, key = await create_api_key(pool, company.company_id, "docs")
            async with authed_gateway(gateway_addr, key) as gw:
                a2a_room = (await gw.CreateRoom(gateway_pb2.CreateRoomRequest(name="a2a"), timeout=10)).room
                helper = (
                    await gw.RegisterAgent(
                        gateway_pb2.RegisterAgentRequest(
                            name="helper", provider=common_pb2.PROVIDER_ANTHROPIC, model="m", provider_key="sk-docs"
                        ),
                        timeout=10,
                    )
                ).agent
            env = {
                **os.environ,
                "PATH": _without_grpcurl(os.environ.get("PATH", "")),
                "PYTHONPATH": str(REPO),
                "QUAYUTEC_GATEWAY_ADDR": gateway_addr,
                "QUAYUTEC_API_KEY": key,
                "QUAYUTEC_A2A_TENANT": tenant_of(a2a_room.room_id, helper.agent_id),
            }
            env.pop("GRPCURL", None)
            runs = {
                "grpcurl": ["sh", "docs/examples/grpcurl.sh"],
                "python": [sys.executable, str(DOCS / "examples" / "python_client.py")],
                "node": [node, str(NODE_EXAMPLES / "client.js")],
                "a2a": [sys.executable, str(DOCS / "examples" / "a2a_client.py")],
                "watch": [sys.executable, str(DOCS / "examples" / "watch_room.py")],
            }
            out = {}
            for name, argv in runs.items():
                done = await _run(argv, env)
                assert done.returncode == 0, f"{name}: {done.stdout}\n{done.stderr}"
                out[name] = done.stdout
    finally:
        await pool.close()

    assert f'"company_id": "{company.company_id}"' in out["grpcurl"]
    posted = re.findall(r"posted (\S+) seq (\d+)", out["grpcurl"])
    assert len(posted) == 2 and posted[0] == posted[1], out["grpcurl"]  # the retry posted nothing new
    assert out["grpcurl"].count('"body": "hello"') == 1
    expected = {
        "python": ("True", "['hello', 'second']"),
        "node": ("true", '["hello","second"]'),
    }
    for name, (same, bodies) in expected.items():
        lines = out[name].splitlines()
        assert lines[0] == f"company {company.company_id} Acme", out[name]
        assert lines[1].startswith("room ")
        assert lines[2].endswith(f"the retry returned the same message: {same}")
        assert lines[3] == f"messages, one page each: {bodies}"
        assert lines[4] == "unknown room: NOT_FOUND"
    watched = out["watch"].splitlines()
    assert watched[0].startswith("room ") and watched[1:] == [
        "watched: ['one']",
        "resumed: ['two', 'three']",
        "unknown room: NOT_FOUND",
    ], out["watch"]
    assert out["a2a"].splitlines() == [
        "agent helper of Acme",
        "task TASK_STATE_SUBMITTED; the retry returned it: True",
        "canceled: TASK_STATE_CANCELED",
        "unknown task: TaskNotFoundError",
    ], out["a2a"]


async def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    import asyncio

    return await asyncio.to_thread(subprocess.run, argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_the_readme_links_every_docs_page_in_one_paragraph() -> None:
    """One documentation paragraph, not two copies, and it names every page of docs/."""
    paragraphs = (REPO / "README.md").read_text().split("\n\n")
    linking = [p for p in paragraphs if len({t for t in _LINK.findall(p) if t.startswith("docs/")}) >= 3]
    assert len(linking) == 1, linking
    linked = set(_LINK.findall(linking[0]))
    pages = {f"docs/{p.name}" for p in DOCS.glob("*.md") if p.name != "README.md"} | {"docs/README.md"}
    assert pages <= linked, sorted(pages - linked)


def test_the_docs_say_what_the_browser_test_does_without_chromium() -> None:
    """The console's browser test fails without chromium (a promise is never skipped); the docs say so."""
    # The test files and the helpers they share (tests/console/browser.py launches chromium).
    tests = [t.read_text() for t in sorted((REPO / "tests" / "console").glob("*.py"))]
    assert any("pytest.fail(" in t and "chromium" in t for t in tests)
    assert not any(skip in t for t in tests for skip in ("pytest.skip", "skipif", "importorskip"))
    for doc in (REPO / "README.md", DOCS / "console.md"):
        said = " ".join(p for p in doc.read_text().split("\n\n") if "chromium" in p)
        assert re.search(r"\bfails?\b", said) and "skipped" not in said, doc
