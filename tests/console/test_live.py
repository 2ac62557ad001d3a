"""Live pages in a real browser (Debian's Chromium via Playwright, as test_console.py): a page that lists,
then follows, misses nothing that lands between its render and its subscription, and says "Live" only
once the subscription is confirmed.

The window is forced, not hoped for: the page's event-stream request is held by the browser's router
while a run parks with a held action, and only then let through.
"""

from __future__ import annotations

import asyncio

from playwright.async_api import Route, expect

from quayutec.v1 import common_pb2, gateway_pb2
from services.runtime.standin import StandinProvider
from tests.console.browser import FAST, HOLD, WAIT_MS, chromium, running_console, sign_in
from tests.gateway.helpers import GatewayStub, create_room, eventually, register_agent
from tests.harness.claims import running_claims
from tests.harness.gateway import authed_gateway, make_company, running_gateway
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime

# Records every text the page's live-state line takes, from the first script on.
RECORD_STATES = """
window.liveStates = [];
new MutationObserver(() => {
  const state = document.getElementById("live-state");
  if (state) window.liveStates.push(state.textContent);
}).observe(document, { subtree: true, childList: true, characterData: true });
"""


async def pending(gw: GatewayStub) -> int:
    got = await gw.ListApprovals(
        gateway_pb2.ListApprovalsRequest(status=common_pb2.WAITPOINT_STATUS_PENDING), timeout=10
    )
    return len(got.waitpoints)


async def test_the_approvals_page_sees_a_run_parked_between_render_and_subscribe(database_url: str) -> None:
    async with running_room(database_url) as room_addr, running_claims(database_url) as claims_addr:
        acme = await make_company(database_url, room_addr, "Acme")
        with StandinProvider() as standin:
            async with (
                running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as runtime_addr,
                running_gateway(database_url, room_addr, runtime_addr, **FAST) as gateway_addr,
                authed_gateway(gateway_addr, acme.secret) as gw,
                running_console(gateway_addr) as base,
                chromium() as browser,
            ):
                room = await create_room(gw, "launch")
                planner = await register_agent(gw, "planner")
                await gw.SetAgentRights(
                    gateway_pb2.SetAgentRightsRequest(agent_id=planner.agent_id, remember=HOLD), timeout=10
                )
                standin.enqueue_reply(
                    "Noted.",
                    [{"name": "remember", "arguments": {"text": "parked in the window", "private": False}}],
                    model=planner.model,
                )
                page = await (await browser.new_context()).new_page()
                await sign_in(page, base, acme.secret)
                held: list[str] = []

                async def park_then_subscribe(route: Route) -> None:
                    """Between the page's render and its subscription: a run parks with a held action."""
                    if not held:
                        held.append(route.request.url)
                        await gw.PostMessage(
                            gateway_pb2.PostMessageRequest(
                                room_id=room.room_id, person="Ana", body="plan", mention_agent_ids=[planner.agent_id]
                            ),
                            timeout=10,
                        )
                        await eventually(lambda: _parked(gw))
                    await route.continue_()

                await page.route("**/approvals/events*", park_then_subscribe)
                answer = await page.goto(f"{base}/approvals")
                assert answer is not None and "Nothing is waiting" in await answer.text()  # rendered before
                await expect(page.locator("#approvals")).to_contain_text("parked in the window", timeout=WAIT_MS)
                await expect(page.locator("#live-state")).to_have_text("Live", timeout=WAIT_MS)
                assert held and "after=" in held[0]
                await page.context.close()


async def _parked(gw: GatewayStub) -> bool:
    return await pending(gw) == 1


async def test_live_shows_only_once_the_subscription_is_confirmed(database_url: str) -> None:
    async with running_room(database_url) as room_addr:
        acme = await make_company(database_url, room_addr, "Acme")
        async with (
            running_gateway(
                database_url, room_addr, "127.0.0.1:9", QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false"
            ) as gateway_addr,
            authed_gateway(gateway_addr, acme.secret) as gw,
            running_console(gateway_addr) as base,
            chromium() as browser,
        ):
            room = await create_room(gw, "launch")
            context = await browser.new_context()
            await context.add_init_script(RECORD_STATES)
            page = await context.new_page()
            await sign_in(page, base, acme.secret)
            # A stream that opens but never confirms (no "live" event), then drops.
            opened = asyncio.Event()

            async def unconfirmed(route: Route) -> None:
                opened.set()
                await route.fulfill(
                    status=200,
                    headers={"content-type": "text/event-stream", "cache-control": "no-store"},
                    body="retry: 600000\n\nevent: beat\ndata: {}\n\n",
                )

            await page.route("**/events*", unconfirmed)
            await page.goto(f"{base}/rooms/{room.room_id}")
            await asyncio.wait_for(opened.wait(), WAIT_MS / 1000)
            await expect(page.locator("#live-state")).to_have_text("Reconnecting…", timeout=WAIT_MS)
            states = await page.evaluate("window.liveStates")
            assert "Live" not in states, states
            # The real stream says "live" once the Gateway's first heartbeat arrives.
            await page.unroute("**/events*")
            await page.reload()
            await expect(page.locator("#live-state")).to_have_text("Live", timeout=WAIT_MS)
            await context.close()
