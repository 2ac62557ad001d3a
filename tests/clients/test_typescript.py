"""The TypeScript client (clients/typescript): its own tests (`npm test`) against the real stack, and
its `npm pack` installed into an empty folder, where the TypeScript client guide's examples
(docs/clients-typescript.md) run against the real stack."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.clients.conftest import check_guide_examples
from tests.harness.sdk_stack import SdkStack, controlled_stack

REPO = Path(__file__).resolve().parent.parent.parent
PACKAGE = REPO / "clients" / "typescript"
EXAMPLES = REPO / "docs" / "examples" / "typescript_sdk"


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: the TypeScript client needs Node.js 20 or newer with npm")
    if not (PACKAGE / "node_modules" / ".installed").exists():
        pytest.fail("the TypeScript client's packages are missing: run `make test` (npm ci in clients/typescript)")
    return found


async def _run(argv: list[str], cwd: Path, env: dict[str, str], limit: float = 600) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), limit)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{text[-6000:]}"
    return text


@pytest.mark.timeout(900)
async def test_the_typescript_client_passes_its_tests_against_the_real_stack(database_url: str) -> None:
    npm = _tool("npm")
    async with controlled_stack(database_url) as (_, control):
        out = await _run([npm, "test"], PACKAGE, {**os.environ, "QUAYUTEC_SDK_STACK": control})
    passed = re.search(r"^# pass (\d+)$", out, re.M)
    assert passed and int(passed.group(1)) >= 20 and re.search(r"^# fail 0$", out, re.M), out[-3000:]


@pytest.mark.timeout(600)
async def test_the_packed_package_installs_into_an_empty_folder_and_the_guides_examples_run(
    stack: SdkStack, tmp_path: Path
) -> None:
    npm, node = _tool("npm"), _tool("node")
    env = {**os.environ}
    await _run([npm, "pack", "--silent", "--pack-destination", str(tmp_path)], PACKAGE, env)
    (tarball,) = await asyncio.to_thread(lambda: list(tmp_path.glob("quayutec-client-*.tgz")))
    app = tmp_path / "app"
    app.mkdir()
    # Offline: the packages come from npm's cache, which `npm ci` of the client filled.
    await _run([npm, "install", "--offline", "--no-audit", "--no-fund", str(tarball)], app, env)
    for example in EXAMPLES.glob("*.mjs"):
        shutil.copy(example, app / example.name)

    async def run(name: str, more: dict[str, str]) -> list[str]:
        return (await _run([node, name], app, {**env, **more}, 120)).splitlines()

    await check_guide_examples(stack, run, "quickstart.mjs", "follow.mjs", "follow_rooms.mjs", app)
