"""What the console's browser tests share: the console served by uvicorn in the test's event loop,
Debian's Chromium driven by Playwright (never a downloaded browser), a whole stack of real services
behind it, sign-in, page weights, and screenshots kept small.

Screenshots go to the test's temporary folder, or, with QUAYUTEC_CONSOLE_SCREENSHOTS=DIR, to DIR
(``QUAYUTEC_CONSOLE_SCREENSHOTS=docs/images pytest tests/console/test_pages.py`` refreshes the ones
docs/console.md shows).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import uvicorn
from PIL import Image
from playwright.async_api import Browser, Page, ViewportSize, async_playwright, expect

from quayutec.v1 import common_pb2
from services.console.app import create_app
from services.console.config import ConsoleConfig
from services.runtime.standin import StandinProvider
from tests.gateway.helpers import GatewayStub
from tests.harness.claims import running_claims
from tests.harness.gateway import CompanyKey, authed_gateway, make_company, running_gateway
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOLD = common_pb2.ACTION_RIGHT_HOLD
FAST = {"QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.02", "QUAYUTEC_GATEWAY_POST_RATE": "0"}
WAIT_MS = 30_000
SESSION_SECRET = "test-secret-" + "x" * 40
PHONE = ViewportSize(width=390, height=844)
DESKTOP = ViewportSize(width=1280, height=800)
# The tallest part of a page a screenshot keeps (a long list is cut, to keep the file small).
SHOT_MAX_HEIGHT = 1300
SHOT_COLOURS = 48
SHOTS_ENV = "QUAYUTEC_CONSOLE_SCREENSHOTS"
SIZE_JS = "document.documentElement && [document.documentElement.clientWidth, document.documentElement.scrollHeight]"
# The page's own HTML as loaded, and the stylesheets and scripts it names.
WEIGHT_JS = """() => [
  performance.getEntriesByType('navigation')[0].decodedBodySize,
  [...document.querySelectorAll('link[rel=stylesheet]')].map(l => l.href),
  [...document.querySelectorAll('script[src]')].map(s => s.src),
]"""


def _chromium() -> str:
    """The browser tests fail (never skip) without Debian's chromium, saying what to install."""
    if CHROMIUM is None:
        pytest.fail("chromium is not on PATH: install Debian's chromium (`apt-get install chromium`; .ci/run does)")
    return CHROMIUM


def console_config(gateway_addr: str, **env: str) -> ConsoleConfig:
    config = ConsoleConfig.from_env(
        {
            "QUAYUTEC_GATEWAY_ADDR": gateway_addr,
            "QUAYUTEC_CONSOLE_SESSION_SECRET": SESSION_SECRET,
            # The test serves plain http on loopback; a Secure cookie would not be sent back.
            "QUAYUTEC_CONSOLE_SECURE_COOKIE": "false",
            **env,
        }
    )
    return replace(config, listen="127.0.0.1:0")


@asynccontextmanager
async def running_console(gateway_addr: str, **env: str) -> AsyncIterator[str]:
    """Yields the base URL of the console served by uvicorn in this event loop (``env``: console settings)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(console_config(gateway_addr, **env)), log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(30):
            while not server.started:  # noqa: ASYNC110 - uvicorn offers no event to wait on
                await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=_chromium(), headless=True)
        try:
            yield browser
        finally:
            await browser.close()


async def sign_in(page: Page, base: str, key: str) -> None:
    await page.goto(f"{base}/signin")
    await page.get_by_label("Your company's API key").fill(key)
    await page.get_by_role("button", name="Sign in").click()
    await expect(page).to_have_url(f"{base}/rooms")


async def page_weight(page: Page) -> dict[str, int]:
    """The bytes of the page: its HTML as loaded, and its stylesheets and scripts as served (a cached one
    counts too); the live stream aside."""
    html, styles, scripts = await page.evaluate(WEIGHT_JS)
    sizes = {"html": int(html), "css": 0, "js": 0}
    for kind, urls in (("css", styles), ("js", scripts)):
        for url in urls:
            sizes[kind] += len(await (await page.request.get(url)).body())
    return sizes


class Shots:
    """Screenshots of pages, as small palette PNGs (SHOT_COLOURS colours, at most SHOT_MAX_HEIGHT tall)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.taken: list[Path] = []

    @classmethod
    def for_test(cls, tmp_path: Path) -> Shots:
        chosen = os.environ.get(SHOTS_ENV)
        return cls(Path(chosen) if chosen else tmp_path / "screenshots")

    async def take(self, page: Page, name: str) -> Path:
        path = self.folder / f"{name}.png"
        # A page that reloads itself (a run's page, when its run changes) is shot once it has loaded again.
        await page.wait_for_load_state()
        size = await page.wait_for_function(SIZE_JS, timeout=WAIT_MS)
        width, height = await size.json_value()
        clip = {"x": 0, "y": 0, "width": width, "height": min(height, SHOT_MAX_HEIGHT)}
        await page.screenshot(path=str(path), full_page=True, clip=clip)  # type: ignore[arg-type]
        with Image.open(path) as shot:
            small = shot.convert("RGB").quantize(colors=SHOT_COLOURS, method=Image.Quantize.MEDIANCUT)
        small.save(path, optimize=True)
        self.taken.append(path)
        return path

    async def both(self, page: Page, name: str) -> None:
        """The page at a desktop's size and a phone's (390 px), then back at the size it had."""
        was = page.viewport_size
        for size, suffix in ((DESKTOP, ""), (PHONE, "-phone")):
            await page.set_viewport_size(size)
            await self.take(page, f"{name}{suffix}")
        if was is not None:
            await page.set_viewport_size(was)


@dataclass
class Stack:
    """A whole stack behind one console: Room, Claims, Runtime (stand-in model), Gateway, and companies."""

    base: str
    room_addr: str
    gateway_addr: str
    standin: StandinProvider
    browser: Browser
    companies: dict[str, CompanyKey] = field(default_factory=dict)
    gateways: dict[str, GatewayStub] = field(default_factory=dict)


@asynccontextmanager
async def console_stack(database_url: str, *names: str, **console_env: str) -> AsyncIterator[Stack]:
    """The stack, a company of each name (with a Gateway stub signed in as it), the console and Chromium."""
    async with running_room(database_url) as room_addr, running_claims(database_url) as claims_addr:
        companies = {name: await make_company(database_url, room_addr, name) for name in names}
        with StandinProvider() as standin:
            async with (
                running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as runtime_addr,
                running_gateway(database_url, room_addr, runtime_addr, **FAST) as gateway_addr,
                running_console(gateway_addr, **console_env) as base,
                chromium() as browser,
            ):
                async with AsyncExitStack() as stubs:
                    gateways = {
                        name: await stubs.enter_async_context(authed_gateway(gateway_addr, c.secret))
                        for name, c in companies.items()
                    }
                    yield Stack(base, room_addr, gateway_addr, standin, browser, companies, gateways)


class _TraceViewer(BaseHTTPRequestHandler):
    """A stand-in for Jaeger's UI: /trace/<id> answers a page naming the trace."""

    def do_GET(self) -> None:
        if not self.path.startswith("/trace/"):
            self.send_error(404)
            return
        body = f"<!doctype html><title>trace</title><h1>Jaeger stand-in: trace {self.path[7:]}</h1>".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


@contextmanager
def trace_viewer() -> Iterator[str]:
    """The base URL of a Jaeger stand-in on 127.0.0.1."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TraceViewer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
