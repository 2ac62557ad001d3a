"""Signing in to the console through the company's OpenID provider, in Chromium: a real provider
(npm's oidc-provider, tests/oidc) on loopback, the whole stack behind the console.

A person signs in with their work email, posts, approves a held action and signs out; the record
and the console say the name was verified by the provider. Each refusal (wrong state, a replayed
code, an email outside the company's domains, wrong issuer, bad signature, expired ID token) is a
page in words. Screenshots go to the test's folder, or to QUAYUTEC_CONSOLE_SCREENSHOTS.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest
from playwright.async_api import Browser, Page, expect

from quayutec.v1 import common_pb2, gateway_pb2
from services.runtime.standin import StandinProvider
from tests.console.browser import FAST, HOLD, WAIT_MS, Shots, chromium, running_console
from tests.gateway.helpers import GatewayStub, create_room, register_agent
from tests.harness.claims import running_claims
from tests.harness.gateway import authed_gateway, make_company, running_gateway
from tests.harness.oidc import RunningProvider, running_provider
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime

LOOPBACK = {"QUAYUTEC_RUNTIME_EGRESS_ALLOW": "127.0.0.0/8"}
ANA = "ana@acme.test"


@pytest.fixture
def generous_expect() -> Iterator[None]:
    expect.set_options(timeout=WAIT_MS)
    try:
        yield
    finally:
        expect.set_options(timeout=None)


@dataclass
class Stack:
    base: str
    acme: GatewayStub
    acme_key: str
    standin: StandinProvider
    browser: Browser


@asynccontextmanager
async def stack(database_url: str) -> AsyncIterator[Stack]:
    async with running_room(database_url) as room_addr, running_claims(database_url) as claims_addr:
        acme = await make_company(database_url, room_addr, "Acme")
        with StandinProvider() as standin:
            async with (
                running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as runtime_addr,
                running_gateway(database_url, room_addr, runtime_addr, **FAST, **LOOPBACK) as gateway_addr,
                authed_gateway(gateway_addr, acme.secret) as acme_gw,
                running_console(gateway_addr) as base,
                chromium() as browser,
            ):
                yield Stack(base, acme_gw, acme.secret, standin, browser)


async def use_provider(s: Stack, provider: RunningProvider, *domains: str) -> None:
    await s.acme.SetSignInProvider(
        gateway_pb2.SetSignInProviderRequest(
            issuer=provider.issuer,
            client_id=provider.client_id,
            client_secret=provider.client_secret,
            email_domains=list(domains),
        ),
        timeout=20,
    )


async def start(page: Page, base: str, who: str, provider: RunningProvider) -> None:
    """From the console's sign-in page to the provider's."""
    await page.goto(f"{base}/signin")
    await page.get_by_label("Your company or work email").fill(who)
    await page.get_by_role("button", name="Continue").click()
    await page.wait_for_url(f"{provider.issuer}/**")


async def at_provider(page: Page, login: str) -> None:
    """The provider's own pages: its login (any password), then its consent."""
    await page.locator("input[name=login]").fill(login)
    await page.locator("input[name=password]").fill("any password")
    await page.get_by_role("button", name="Sign-in").click()
    await page.get_by_role("button", name="Continue").click()


async def test_a_person_signs_in_posts_approves_and_signs_out(
    database_url: str, tmp_path: Path, generous_expect: None
) -> None:
    shots = Shots.for_test(tmp_path)
    async with stack(database_url) as s:
        room = await create_room(s.acme, "Friday launch")
        planner = await register_agent(s.acme, "planner")
        await s.acme.SetAgentRights(
            gateway_pb2.SetAgentRightsRequest(agent_id=planner.agent_id, remember=HOLD, create_task=HOLD), timeout=10
        )
        async with running_provider([f"{s.base}/signin/callback"], names={ANA: "Ana Lima"}) as provider:
            await use_provider(s, provider, "acme.test")
            page = await (await s.browser.new_context()).new_page()
            await page.goto(f"{s.base}/signin")
            await shots.both(page, "console-signin-provider")
            await start(page, s.base, ANA, provider)
            await at_provider(page, ANA)
            await expect(page).to_have_url(f"{s.base}/rooms")
            await expect(page.locator("#me-person")).to_have_text("Ana Lima")

            # The run history, open in another tab, follows the run without a reload.
            history = await page.context.new_page()
            await history.goto(f"{s.base}/runs")
            await expect(history.locator("#live-state")).to_have_text("Live")
            await history.evaluate("window.notReloaded = true")
            await page.goto(f"{s.base}/rooms/{room.room_id}")
            await expect(page.locator("#m-as")).to_contain_text("Posting as Ana Lima, verified by 127.0.0.1")
            s.standin.enqueue_reply(
                "Plan noted.",
                [
                    {"name": "remember", "arguments": {"text": "launch on Friday", "private": False}},
                    {
                        "name": "create_task",
                        "arguments": {"to_agent_id": planner.agent_id, "title": "Copy", "body": "Two"},
                    },
                ],
                model=planner.model,
            )
            await page.get_by_label("Message", exact=True).fill("@planner plan Friday")
            await page.locator("#post").get_by_label("planner").check()
            await page.get_by_role("button", name="Post").click()
            mine = page.locator("#messages li", has_text="plan Friday")
            await expect(mine).to_contain_text("Ana Lima")
            await expect(mine).to_contain_text("verified by 127.0.0.1")
            await expect(page.locator("#messages")).to_contain_text("Plan noted", timeout=WAIT_MS)

            await expect(history.locator("#run-table")).to_contain_text("parked")
            assert await history.evaluate("window.notReloaded") is True
            await page.goto(f"{s.base}/approvals")
            held = page.locator("ol.held > li")
            await expect(held.nth(0)).to_contain_text("as Ana Lima, verified by")
            await held.nth(0).get_by_role("button", name="Approve").click()
            await expect(page.locator("p.notice")).to_contain_text("Approved action #0")
            first = page.locator("ol.held > li").nth(0)
            await expect(first).to_contain_text("approved by Ana Lima")
            await expect(first).to_contain_text("verified by 127.0.0.1")
            await shots.both(page, "console-decision-verified")
            await page.locator("ol.held > li").nth(1).get_by_role("button", name="Deny").click()
            await expect(page.locator("p.notice")).to_contain_text("The run continues")
            runs = await s.acme.ListRuns(gateway_pb2.ListRunsRequest(agent_id=planner.agent_id), timeout=10)
            await expect(history.locator("#run-table")).to_contain_text("succeeded")  # live, again
            await page.goto(f"{s.base}/runs/{runs.runs[0].run_id}")
            await expect(page.locator("main")).to_contain_text("approved by Ana Lima, verified by 127.0.0.1")
            await expect(page.locator("#reply-text")).to_have_text("Plan noted.")  # the reply's words

            # The record, read from the API with the company key: the verified person, and by whom.
            listed = await s.acme.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)
            post = next(m for m in listed.messages if "plan Friday" in m.body)
            assert (post.author.person, post.author.verified_by) == ("Ana Lima", provider.issuer)
            done = await s.acme.ListApprovals(
                gateway_pb2.ListApprovalsRequest(status=common_pb2.WAITPOINT_STATUS_COMPLETED), timeout=10
            )
            decided = [(h.decided_by, h.decided_by_verified_by) for w in done.waitpoints for h in w.held]
            assert decided == [("Ana Lima", provider.issuer)] * 2

            await page.get_by_role("button", name="Sign out").click()
            await expect(page).to_have_url(f"{s.base}/signin")
            await page.goto(f"{s.base}/rooms")
            await expect(page).to_have_url(f"{s.base}/signin")


async def test_each_refusal_is_a_page_in_words(database_url: str, generous_expect: None) -> None:
    async with stack(database_url) as s:
        callback = f"{s.base}/signin/callback"
        async with running_provider([callback], unverified=["una@acme.test"]) as provider:
            await use_provider(s, provider, "acme.test")
            context = await s.browser.new_context()
            page = await context.new_page()

            # The API-key sign-in is off once the company has a provider, and the page says so.
            await page.goto(f"{s.base}/signin")
            await page.get_by_label("Your company's API key").fill(s.acme_key)
            await page.get_by_role("button", name="Sign in").click()
            await expect(page.get_by_role("alert")).to_contain_text("API-key sign-in is off")

            # A callback that did not start here, and one whose state is not the sign-in's.
            await page.goto(f"{callback}?code=abc&state=xyz")
            await expect(page.get_by_role("alert")).to_contain_text("did not start in this browser")
            await start(page, s.base, ANA, provider)
            await page.goto(f"{callback}?code=abc&state=not-the-one")
            await expect(page.get_by_role("alert")).to_contain_text("its state does not match")

            # An email outside Acme's domains (found by the company's name, vouched for by the provider).
            await start(page, s.base, "Acme", provider)
            await at_provider(page, "eve@elsewhere.test")
            await expect(page.get_by_role("alert")).to_contain_text("eve@elsewhere.test is not an email of Acme")
            # An email of Acme's domain that the provider says is not verified (a browser of its own: the
            # provider remembers eve in this one).
            unverified = await (await s.browser.new_context()).new_page()
            await start(unverified, s.base, "Acme", provider)
            await at_provider(unverified, "una@acme.test")
            await expect(unverified.get_by_role("alert")).to_contain_text("your email address is not verified")

            # A code used once already, sent back with a later sign-in's own state.
            fresh = await (await s.browser.new_context()).new_page()
            back: list[str] = []
            fresh.on("request", lambda r: back.append(r.url) if r.url.startswith(f"{callback}?") else None)
            await start(fresh, s.base, ANA, provider)
            await at_provider(fresh, ANA)
            await expect(fresh).to_have_url(f"{s.base}/rooms")
            used_code = parse_qs(urlsplit(back[-1]).query)["code"][0]
            replayer = await (await s.browser.new_context()).new_page()
            asked: list[str] = []
            replayer.on("request", lambda r: asked.append(r.url) if "state=" in r.url else None)
            await start(replayer, s.base, ANA, provider)
            state = parse_qs(urlsplit(asked[-1]).query)["state"][0]  # the authorization request's
            await replayer.goto(f"{callback}?{urlencode({'code': used_code, 'state': state})}")
            await expect(replayer.get_by_role("alert")).to_contain_text("already used")

        # Providers at fault: each refused after the code is redeemed, before any key is made.
        for mode, says in (
            ("wrong_issuer", "/elsewhere', not by your company's provider"),
            ("bad_signature", "signature does not match your provider's published keys"),
            ("expired_id_token", "the ID token has expired"),
        ):
            async with running_provider([callback], mode=mode) as faulty:
                await use_provider(s, faulty, "acme.test")
                page = await (await s.browser.new_context()).new_page()
                await start(page, s.base, ANA, faulty)
                await at_provider(page, ANA)
                await expect(page.get_by_role("alert")).to_contain_text(says)
                assert urlsplit(page.url).path == "/signin/callback"
