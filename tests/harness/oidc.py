"""A real OpenID provider for tests: npm's ``oidc-provider`` run by tests/oidc/provider.mjs on loopback.

async with running_provider(redirect_uris=[...], mode="bad_signature") as provider:
    provider.issuer  # http://127.0.0.1:PORT

Its packages come from tests/oidc/package-lock.json (`make pytest` runs `npm ci` there).
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin

import httpx
import pytest

FOLDER = Path(__file__).resolve().parent.parent / "oidc"
CLIENT_ID = "quayutec-console"
CLIENT_SECRET = "console-secret-" + "y" * 24
START_SECONDS = 30.0


@dataclass(frozen=True)
class RunningProvider:
    issuer: str
    client_id: str
    client_secret: str


@asynccontextmanager
async def running_provider(
    redirect_uris: list[str],
    *,
    mode: str = "",
    names: dict[str, str] | None = None,
    unverified: list[str] | None = None,
) -> AsyncIterator[RunningProvider]:
    """Starts the provider (failing, never skipping, when node or its packages are missing) and stops it."""
    node = shutil.which("node")
    if node is None or not (FOLDER / "node_modules" / "oidc-provider").is_dir():
        pytest.fail("the test OpenID provider needs node and `npm ci` in tests/oidc (`make pytest` does both)")
    options = {
        "client_id": CLIENT_ID,
        "client_secret": CLIENT_SECRET,
        "redirect_uris": redirect_uris,
        "names": names or {},
        "mode": mode,
        "unverified": unverified or [],
    }
    process = await asyncio.create_subprocess_exec(
        node,
        str(FOLDER / "provider.mjs"),
        json.dumps(options),
        cwd=FOLDER,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(START_SECONDS):
            line = await process.stdout.readline()
        if not line:
            pytest.fail(f"the test OpenID provider ended at start (exit {await process.wait()})")
        started = json.loads(line)
        yield RunningProvider(issuer=started["issuer"], client_id=CLIENT_ID, client_secret=CLIENT_SECRET)
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()


_ACTION = re.compile(r'<form[^>]*action="([^"]+)"')
_PROMPT = re.compile(r'name="prompt" value="(\w+)"')
MAX_STEPS = 12


async def authorize(url: str, redirect_uri: str, login: str) -> str:
    """Go through the provider's sign-in pages as a person would (the library's development login:
    any password; then consent) and answer the URL it sends the browser back to (not followed)."""
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=10.0) as http:
        response = await http.get(url)
        for _ in range(MAX_STEPS):
            if response.is_redirect:
                location = urljoin(str(response.url), response.headers["location"])
                if location.startswith(redirect_uri):
                    return location
                response = await http.get(location)
                continue
            action, prompt = _ACTION.search(response.text), _PROMPT.search(response.text)
            if response.status_code != 200 or action is None or prompt is None:
                raise AssertionError(f"the provider answered {response.status_code}: {response.text[:500]}")
            form = {"prompt": prompt.group(1)}
            if prompt.group(1) == "login":
                form |= {"login": login, "password": "any"}
            response = await http.post(urljoin(str(response.url), html.unescape(action.group(1))), data=form)
    raise AssertionError(f"the provider did not send the browser back within {MAX_STEPS} steps")
