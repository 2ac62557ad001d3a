"""The room console in a real browser: Debian's headless Chromium driven by Playwright, against the
console served by uvicorn over a real Gateway, Room, Claims and Runtime (stand-in model provider).

Two companies sign in. Each sees only its rooms; a message posted by one appears on the other's open
room page without a reload; an approval decided in the console continues the run once and its run
page follows the timeline to its end; the denied action shows as denied; signing out ends access.
Screenshots of each page go to ``<tmp_path>/screenshots`` (printed at the end; `pytest --basetemp DIR`
keeps them where you want).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from playwright.async_api import Browser, expect

from quayutec.telemetry import SpanCapture
from quayutec.v1 import common_pb2, gateway_pb2
from services.runtime.standin import StandinProvider
from tests.console.browser import FAST, HOLD, PHONE, WAIT_MS, Shots, chromium, page_weight, running_console, sign_in
from tests.gateway.helpers import GatewayStub, create_room, register_agent
from tests.harness.claims import running_claims
from tests.harness.gateway import authed_gateway, make_company, running_gateway
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime

PAGE_WEIGHT_LIMIT = 32_000
JAEGER = "http://127.0.0.1:16686"


@pytest.fixture
def generous_expect() -> Iterator[None]:
    """Every expect() of this module waits up to WAIT_MS, not Playwright's 5 s: six servers and a
    browser share the machine, and a wait is only a failsafe here, never what a test asserts."""
    expect.set_options(timeout=WAIT_MS)
    try:
        yield
    finally:
        expect.set_options(timeout=None)


async def test_two_companies_in_the_console(
    database_url: str, tmp_path: Path, captured: tuple[InMemorySpanExporter, SpanCapture], generous_expect: None
) -> None:
    """Telemetry is on (``captured``), so every run has a trace id and its page links to Jaeger."""
    shots = Shots(tmp_path / "screenshots")
    async with running_room(database_url) as room_addr, running_claims(database_url) as claims_addr:
        acme_key = await make_company(database_url, room_addr, "Acme")
        globex_key = await make_company(database_url, room_addr, "Globex")
        with StandinProvider() as standin:
            async with (
                running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as runtime_addr,
                running_gateway(database_url, room_addr, runtime_addr, **FAST) as gateway_addr,
                authed_gateway(gateway_addr, acme_key.secret) as acme_gw,
                authed_gateway(gateway_addr, globex_key.secret) as globex_gw,
                running_console(gateway_addr, QUAYUTEC_CONSOLE_JAEGER_URL=JAEGER) as base,
                chromium() as browser,
            ):
                await _scenario(
                    browser, base, acme_key.secret, globex_key.secret, acme_gw, globex_gw, standin, shots, captured[0]
                )
    print(f"console screenshots in {shots.folder}")


async def _scenario(
    browser: Browser,
    base: str,
    acme_key: str,
    globex_key: str,
    acme_gw: GatewayStub,
    globex_gw: GatewayStub,
    standin: StandinProvider,
    shots: Shots,
    exporter: InMemorySpanExporter,
) -> None:
    launch = await create_room(acme_gw, "Friday launch")
    private = await create_room(globex_gw, "Globex only")
    globex_id = (await globex_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)).company.company_id
    await acme_gw.InviteCompany(
        gateway_pb2.InviteCompanyRequest(room_id=launch.room_id, company_id=globex_id), timeout=10
    )
    planner = await register_agent(acme_gw, "planner")
    # Acme holds its planner's memory writes and new tasks for a person's decision.
    await acme_gw.SetAgentRights(
        gateway_pb2.SetAgentRightsRequest(agent_id=planner.agent_id, remember=HOLD, create_task=HOLD), timeout=10
    )

    acme_ctx = await browser.new_context()
    globex_ctx = await browser.new_context(viewport=PHONE)  # Globex's person is on a phone
    a = await acme_ctx.new_page()
    g = await globex_ctx.new_page()

    # A wrong key is answered in words, and nothing else opens without signing in.
    await a.goto(f"{base}/rooms")
    await expect(a).to_have_url(f"{base}/signin")
    await a.get_by_label("Your company's API key").fill("qy_not-a-key")
    await a.get_by_role("button", name="Sign in").click()
    await expect(a.get_by_role("alert")).to_contain_text("not accepted")
    await shots.take(a, "signin-refused")

    await sign_in(a, base, acme_key)
    await sign_in(g, base, globex_key)

    # Globex sees the invitation and accepts it in the console; its private room is its own.
    await expect(g.locator("main")).to_contain_text("Friday launch")
    await shots.take(g, "rooms-invitation-phone")
    await g.get_by_role("button", name="Accept").click()
    await expect(g.locator("p.notice")).to_contain_text("You joined Friday launch")
    await expect(g.locator("#room-list")).to_contain_text("Friday launch")
    await expect(g.locator("#room-list")).to_contain_text("Globex only")
    await a.reload()
    await expect(a.locator("#room-list")).to_contain_text("Friday launch")
    await expect(a.locator("#room-list")).not_to_contain_text("Globex only")
    await shots.take(a, "rooms")
    answer = await a.goto(f"{base}/rooms/{private.room_id}")
    assert answer is not None and answer.status == 404
    await expect(a.get_by_role("alert")).to_contain_text("not visible to your company")
    assert "Traceback" not in await a.content()

    # Both open the room; Globex posts and Acme's open page shows it without a reload.
    await a.goto(f"{base}/rooms/{launch.room_id}")
    await g.goto(f"{base}/rooms/{launch.room_id}")
    await expect(a.locator("#live-state")).to_have_text("Live")
    await a.evaluate("window.notReloaded = true")
    # Small pages: the room page with its stylesheet and script (bytes as sent, the live stream aside).
    weight = sum((await page_weight(a)).values())
    print(f"room page weight: {weight} bytes")
    assert 0 < weight < PAGE_WEIGHT_LIMIT
    await g.get_by_label("Your name").first.fill("Gus")
    await g.get_by_label("Message", exact=True).fill("Hello from Globex")
    await g.get_by_role("button", name="Post").click()
    await expect(a.locator("#messages")).to_contain_text("Hello from Globex", timeout=WAIT_MS)
    assert await a.evaluate("window.notReloaded") is True
    await shots.take(g, "room-phone")

    # Acme's person wakes the planner from the console; its run parks with two held actions.
    standin.enqueue_reply(
        "Plan noted; asking Globex for copy.",
        [
            {"name": "remember", "arguments": {"text": "launch on Friday", "private": False}},
            {"name": "create_task", "arguments": {"to_agent_id": planner.agent_id, "title": "Copy", "body": "Two"}},
        ],
        model=planner.model,
    )
    await a.get_by_label("Your name").first.fill("Ana")
    await a.get_by_label("Message", exact=True).fill("@planner plan Friday")
    await a.locator("#post").get_by_label("planner").check()
    await a.get_by_role("button", name="Post").click()
    # The planner's reply arrives live on both pages.
    await expect(a.locator("#messages")).to_contain_text("Plan noted", timeout=WAIT_MS)
    await expect(g.locator("#messages")).to_contain_text("Plan noted", timeout=WAIT_MS)
    await shots.take(a, "room")

    colleague = await acme_ctx.new_page()
    await colleague.goto(f"{base}/approvals")
    await expect(colleague.locator("#approvals")).to_contain_text("remember", timeout=WAIT_MS)
    await expect(colleague.locator("#live-state")).to_have_text("Live")
    await colleague.evaluate("window.notReloaded = true")
    runs = (await acme_gw.ListRuns(gateway_pb2.ListRunsRequest(agent_id=planner.agent_id), timeout=10)).runs
    assert len(runs) == 1 and runs[0].status == common_pb2.RUN_STATUS_PARKED
    run_id = runs[0].run_id
    # The run page, open while the run is parked, follows it to its end by itself.
    run_page = await acme_ctx.new_page()
    await run_page.goto(f"{base}/runs/{run_id}")
    await expect(run_page.locator("#run-status")).to_have_text("parked")
    await shots.take(run_page, "run-parked")

    # Globex sees none of Acme's approvals.
    await g.goto(f"{base}/approvals")
    await expect(g.locator("main")).to_contain_text("Nothing is waiting")

    await a.goto(f"{base}/approvals")
    await expect(a.locator("#approvals dl.args").first).to_contain_text("launch on Friday")
    await shots.take(a, "approvals")
    held = a.locator("ol.held > li")
    await held.nth(0).get_by_role("button", name="Approve").click()
    await expect(a.locator("p.notice")).to_contain_text("Approved action #0")
    await a.locator("ol.held > li").nth(1).get_by_role("button", name="Deny").click()
    await expect(a.locator("p.notice")).to_contain_text("The run continues")
    # The colleague's open list empties without a reload once the run continues.
    await expect(colleague.locator("#approvals")).to_contain_text("Nothing is waiting", timeout=WAIT_MS)
    assert await colleague.evaluate("window.notReloaded") is True

    await expect(run_page.locator("#run-status")).to_have_text("succeeded", timeout=WAIT_MS)
    timeline = run_page.locator("#steps")
    for step in ("claimed", "room read", "model request 1", "decided", "reply posted", "ended"):
        await expect(timeline).to_contain_text(step)
    await expect(timeline.locator("li", has_text="action #0 remember")).to_contain_text("done")
    await expect(timeline.locator("li", has_text="action #1 create_task")).to_contain_text("denied")
    done_trace = runs[0].trace_id
    assert len(done_trace) == 32, "the run recorded no trace id although telemetry is on"
    link = run_page.get_by_role("link", name="Open the first trace in Jaeger")  # then the continuation's
    await expect(link).to_have_attribute("href", f"{JAEGER}/trace/{done_trace}")
    await shots.take(run_page, "run")
    await run_page.set_viewport_size(PHONE)
    await shots.take(run_page, "run-phone")

    # Continued once: one reply, the approved memory once, no task (denied), one run.
    messages = (
        await acme_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=launch.room_id), timeout=10)
    ).messages
    assert [m.body for m in messages if m.author.agent_id == planner.agent_id] == [
        "Plan noted; asking Globex for copy."
    ]
    memory = (await acme_gw.ListMemory(gateway_pb2.ListMemoryRequest(room_id=launch.room_id), timeout=10)).lines
    assert [m.text for m in memory] == ["launch on Friday"]
    tasks = (await acme_gw.ListTasks(gateway_pb2.ListTasksRequest(room_id=launch.room_id), timeout=10)).tasks
    assert list(tasks) == []
    done = (await acme_gw.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), timeout=10)).run
    assert [x.outcome for x in done.actions] == [common_pb2.ACTION_OUTCOME_DONE, common_pb2.ACTION_OUTCOME_DENIED]
    assert "Ana" in done.actions[1].detail
    # The ended run's page links each of the ledger's traces, the first and the continuation's, to
    # Jaeger's page of it; and each is the trace of one of the run's own `run` spans, as exported.
    assert len(done.trace_ids) == 2 and done.trace_ids[0] == done_trace, list(done.trace_ids)
    await run_page.reload()
    links = run_page.locator("#trace-links a")
    await expect(links).to_have_count(2)
    assert [await link.get_attribute("href") for link in await links.all()] == [
        f"{JAEGER}/trace/{trace_id}" for trace_id in done.trace_ids
    ]
    await expect(run_page.get_by_role("link", name="Open the continuation's trace in Jaeger")).to_have_attribute(
        "href", f"{JAEGER}/trace/{done.trace_ids[1]}"
    )
    exporter_traces = {
        format(span.context.trace_id, "032x")
        for span in exporter.get_finished_spans()
        if span.name == "run" and (span.attributes or {}).get("quayutec.run_id") == run_id
    }
    assert exporter_traces == set(done.trace_ids)
    assert len((await acme_gw.ListRuns(gateway_pb2.ListRunsRequest(), timeout=10)).runs) == 1
    # Globex may not open Acme's run.
    answer = await g.goto(f"{base}/runs/{run_id}")
    assert answer is not None and answer.status == 404

    # A form without the session's CSRF token is refused in words.
    refused = await a.request.post(f"{base}/rooms/{launch.room_id}", form={"csrf": "forged", "body": "x"})
    assert refused.status == 403 and "expired" in await refused.text()

    # A form the Gateway or the console cannot use is answered in words on the page, never a trace.
    await a.goto(f"{base}/rooms/{launch.room_id}")
    csrf = await a.locator("input[name=csrf]").first.get_attribute("value")
    assert csrf
    empty = await a.request.post(
        f"{base}/rooms/{launch.room_id}", form={"csrf": csrf, "person": "Ana", "idem": "k1", "body": " "}
    )
    assert empty.status == 400 and "The message is required." in await empty.text()
    nobody = await a.request.post(
        f"{base}/rooms/{launch.room_id}",
        form={"csrf": csrf, "person": "Ana", "idem": "k2", "what": "task", "to_agent_id": "nobody", "title": "x"},
    )
    text = await nobody.text()
    assert nobody.status == 400 and 'role="alert"' in text and "Traceback" not in text

    # Signing out ends access: the pages send the person to sign in, the live stream is refused.
    await a.goto(f"{base}/rooms")
    await a.get_by_role("button", name="Sign out").click()
    await expect(a).to_have_url(f"{base}/signin")
    for path in ("/rooms", f"/rooms/{launch.room_id}", "/approvals", f"/runs/{run_id}"):
        await a.goto(f"{base}{path}")
        await expect(a).to_have_url(f"{base}/signin")
    events = await a.request.get(f"{base}/rooms/{launch.room_id}/events", max_redirects=0)
    assert events.status == 401
    # What is left of the cookie (the sign-in form's CSRF token) holds no key.
    for cookie in await acme_ctx.cookies():
        assert cookie["name"] == "quayutec_console" and cookie["httpOnly"] and cookie["sameSite"] == "Lax"
        kept = json.loads(base64.b64decode(cookie["value"].split(".")[0]))
        assert set(kept) == {"csrf"}
    await shots.take(a, "signed-out")
    await acme_ctx.close()
    await globex_ctx.close()
    assert os.listdir(shots.folder)
