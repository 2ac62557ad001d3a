"""The console's pages in Debian's Chromium (Playwright), against real services: names everywhere with the
ids a click away, waking another company's agent by name, a failed post keeping its text, held actions
readable at 390 px, a run's timeline on a time axis with a working trace link, the run history filtered
and paged, the agents, rights, keys and invitations pages, every empty state, a 404 in words and the
favicon. Each page is shot at a desktop's size and a phone's (tests/console/browser.py says where) and
weighed (HTML, CSS and JS bytes, printed)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
from playwright.async_api import BrowserContext, Page, expect

from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc
from tests.console.browser import (
    DESKTOP,
    HOLD,
    PHONE,
    WAIT_MS,
    Shots,
    Stack,
    console_stack,
    page_weight,
    sign_in,
    trace_viewer,
)
from tests.gateway.helpers import create_room, expect_error, register_agent
from tests.harness.channels import service_channel
from tests.harness.gateway import authed_gateway, join_room

# The most a page may weigh (HTML, CSS and JS), whatever it lists.
PAGE_WEIGHT_LIMIT = 64_000
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
LONG_WORD = "https://docs.example.test/" + "launch-plan-" * 30 + "final"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIPBOARD = ["clipboard-read", "clipboard-write"]


async def weigh(page: Page, name: str, weights: dict[str, dict[str, int]]) -> None:
    sizes = await page_weight(page)
    weights[name] = sizes
    assert 0 < sum(sizes.values()) < PAGE_WEIGHT_LIMIT, (name, sizes)


def print_weights(weights: dict[str, dict[str, int]]) -> None:
    print("page weights (bytes): page, html, css, js, total")
    for name, s in weights.items():
        print(f"  {name:<14} {s['html']:>6} {s['css']:>6} {s['js']:>6} {sum(s.values()):>6}")


async def copied(page: Page, button: str) -> str:
    """Clicks the id button matched by ``button`` and answers what the clipboard then holds."""
    await page.locator(button).first.click()
    text: str = await page.evaluate("navigator.clipboard.readText()")
    return text


async def no_sideways_scroll(page: Page, selector: str) -> int:
    """Every box ``selector`` matches fits its width (no clipped content, no sideways scroll), and so
    does the page; how many boxes were measured."""
    widths = await page.locator(selector).evaluate_all("boxes => boxes.map(b => [b.scrollWidth, b.clientWidth])")
    assert widths and all(scroll <= client for scroll, client in widths), widths
    page_widths = await page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert page_widths[0] <= page_widths[1], page_widths
    return len(widths)


async def record_history(stack: Stack, agent: common_pb2.Agent, room_id: str) -> list[common_pb2.Run]:
    """55 past runs of ``agent`` in ``room_id``, a minute apart from T0: succeeded, failed (rate limited,
    three requests) and timed out in turn; the 7th carries a trace id."""
    made = []
    async with service_channel(stack.room_addr, "runtime") as channel:
        room = room_pb2_grpc.RoomServiceStub(channel)
        for i in range(55):
            status = (common_pb2.RUN_STATUS_SUCCEEDED, common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STATUS_TIMED_OUT)[
                i % 3
            ]
            run = common_pb2.Run(
                run_id=str(uuid.uuid4()),
                agent_id=agent.agent_id,
                company_id=agent.company_id,
                room_id=room_id,
                wake_id=str(uuid.uuid4()),
                wake_kind=common_pb2.WAKE_KIND_MESSAGE,
                status=status,
                step=common_pb2.RUN_STEP_ENDED,
                active_ms=1500 + i,
                trace_id=TRACE_ID if i == 7 else "",
            )
            start = T0 + timedelta(minutes=i)
            run.started_at.FromDatetime(start)
            run.ended_at.FromDatetime(start + timedelta(seconds=12))
            if status == common_pb2.RUN_STATUS_FAILED:
                run.error = "model call failed: rate_limited after 3 requests: 429"
                for n in (1, 2, 3):
                    attempt = run.model_attempts.add(
                        number=n,
                        status_code=429,
                        error_class="rate_limited",
                        duration_ms=300,
                        wait_seconds=2 if n < 3 else 0,
                    )
                    attempt.started_at.FromDatetime(start + timedelta(seconds=0.5 + 2.3 * (n - 1)))
            elif status == common_pb2.RUN_STATUS_TIMED_OUT:
                run.error = "stopped after 120 s of active time"
            else:
                run.posted_message_id = str(uuid.uuid4())
            await room.RecordRun(room_pb2.RoomServiceRecordRunRequest(run=run), timeout=10)
            made.append(run)
    return made


async def test_names_a_failed_post_held_actions_at_390_px_and_the_timeline(database_url: str, tmp_path: Path) -> None:
    shots = Shots.for_test(tmp_path)
    weights: dict[str, dict[str, int]] = {}
    async with console_stack(database_url, "Acme", "Globex", "Initech") as stack:
        acme_gw, globex_gw, initech_gw = (stack.gateways[n] for n in ("Acme", "Globex", "Initech"))
        launch = await create_room(acme_gw, "Friday launch")
        planner = await register_agent(acme_gw, "planner")
        writer = await register_agent(globex_gw, "writer")
        scout = await register_agent(initech_gw, "scout")
        await join_room(acme_gw, globex_gw, launch.room_id)
        await join_room(acme_gw, initech_gw, launch.room_id)
        await acme_gw.SetAgentRights(
            gateway_pb2.SetAgentRightsRequest(agent_id=planner.agent_id, remember=HOLD, create_task=HOLD), timeout=10
        )
        acme_ctx = await stack.browser.new_context(viewport=DESKTOP, permissions=CLIPBOARD)
        globex_ctx = await stack.browser.new_context(viewport=DESKTOP, permissions=CLIPBOARD)
        a, g = await acme_ctx.new_page(), await globex_ctx.new_page()
        await a.goto(f"{stack.base}/signin")
        await shots.both(a, "console-signin")
        await sign_in(a, stack.base, stack.companies["Acme"].secret)
        await sign_in(g, stack.base, stack.companies["Globex"].secret)

        # The room's empty sections each say so.
        await a.goto(f"{stack.base}/rooms/{launch.room_id}")
        await expect(a.locator("#live-state")).to_have_text("Live", timeout=WAIT_MS)
        for section, words in (
            ("messages", "No messages yet"),
            ("tasks", "No open tasks"),
            ("memory", "Nothing remembered yet"),
            ("files", "No files yet"),
            ("runs", "No runs of your agents in this room yet"),
        ):
            await expect(a.locator(f"#{section} + .empty")).to_be_visible()
            await expect(a.locator(f"#{section} + .empty")).to_contain_text(words)
        # Every member company and its agents by name; Acme's own first.
        await expect(a.locator("p.sub")).to_contain_text("Acme, Globex, Initech")
        picker = a.locator("#post fieldset")
        await expect(picker.locator("p.company")).to_have_text(["Acme", "Globex", "Initech"])
        await expect(picker.locator("label.check")).to_have_text(["planner Acme", "writer Globex", "scout Initech"])

        # A person of Globex posts: Acme's open page shows them by name and company, the id a click away.
        await g.goto(f"{stack.base}/rooms/{launch.room_id}")
        await g.get_by_label("Your name").first.fill("Gus")
        await g.get_by_label("Message", exact=True).fill("Hello from Globex")
        await g.get_by_role("button", name="Post").click()
        gus = a.locator("#messages li", has_text="Hello from Globex")
        await expect(gus.locator(".who")).to_have_text("Gus Globex as stated by Globex's service id", timeout=WAIT_MS)
        assert (
            await copied(a, "#messages li:has-text('Hello from Globex') button.copy")
            == stack.companies["Globex"].company_id
        )
        await expect(a.locator("#messages + .empty")).to_be_hidden()

        # Acme wakes Globex's writer by choosing it by name; the writer's reply is by name too.
        stack.standin.enqueue_reply("Draft: Friday, 9 am.", model=writer.model)
        await a.get_by_label("Your name").first.fill("Ana")
        await a.get_by_label("Message", exact=True).fill("writer, draft the copy")
        await picker.get_by_label("writer").check()
        await a.get_by_role("button", name="Post").click()
        reply = a.locator("#messages li", has_text="Draft: Friday")
        await expect(reply.locator(".who")).to_have_text("writer Globex id", timeout=WAIT_MS)
        assert await copied(a, "#messages li:has-text('Draft: Friday') button.copy") == writer.agent_id
        # Its "run" link shows what Acme may see: that a run of Globex's writer answered.
        await reply.get_by_role("link", name="run").click()
        await expect(a.locator("#other-run")).to_contain_text("A run of writer Globex id answered with this message")
        await expect(a.locator("#other-run")).to_contain_text("belongs to Globex")
        await shots.both(a, "console-message")
        await weigh(a, "message", weights)
        # Globex's own people open the run itself from the same link.
        writers_run = (await globex_gw.ListRuns(gateway_pb2.ListRunsRequest(), timeout=10)).runs[0].run_id
        await g.locator("#messages li", has_text="Draft: Friday").get_by_role("link", name="run").click()
        await expect(g).to_have_url(f"{stack.base}/runs/{writers_run}")

        # A failed post keeps what was typed: Initech leaves between the choice and the post.
        await a.goto(f"{stack.base}/rooms/{launch.room_id}")
        await a.get_by_label("Message", exact=True).fill("scout, check the venue\nand the parking")
        await picker.get_by_label("scout").check()
        await initech_gw.LeaveRoom(gateway_pb2.LeaveRoomRequest(room_id=launch.room_id), timeout=10)
        await a.get_by_role("button", name="Post").click()
        await expect(a.get_by_role("alert")).to_contain_text("not found in this room")
        await expect(a.get_by_label("Message", exact=True)).to_have_value("scout, check the venue\nand the parking")
        await expect(a.get_by_label("Your name").first).to_have_value("Ana")
        await expect(picker.locator("label.check")).to_have_text(["planner Acme", "writer Globex"])
        assert scout.agent_id not in await a.content()

        # Held actions at a phone's width: each argument readable, wrapped, never clipped; JSON on demand.
        stack.standin.enqueue_reply(
            "Plan noted; asking Globex for copy.",
            [
                {"name": "remember", "arguments": {"text": f"launch notes at {LONG_WORD}", "private": False}},
                {
                    "name": "create_task",
                    "arguments": {"to_agent_id": writer.agent_id, "title": "Copy", "body": "Two lines"},
                },
            ],
            model=planner.model,
        )
        await a.get_by_label("Message", exact=True).fill("planner, plan Friday")
        await picker.get_by_label("planner").check()
        await a.get_by_role("button", name="Post").click()
        await expect(a.locator("#messages")).to_contain_text("Plan noted", timeout=WAIT_MS)
        await shots.both(a, "console-room")
        await weigh(a, "room", weights)
        await a.set_viewport_size(PHONE)
        await a.goto(f"{stack.base}/approvals")
        held = a.locator("ol.held > li")
        await expect(held).to_have_count(2, timeout=WAIT_MS)
        first_args = held.nth(0).locator("dl.args")
        await expect(first_args.locator("dt")).to_have_text(["private", "text"])
        await expect(first_args.locator("dd").nth(1)).to_have_text(f"launch notes at {LONG_WORD}")
        # The task's assignee by name, not by id.
        await expect(held.nth(1).locator("dl.args")).to_contain_text("writer Globex")
        await expect(held.nth(0).locator("details.json pre")).to_be_hidden()
        await held.nth(0).locator("details.json summary").click()
        await expect(held.nth(0).locator("details.json pre")).to_contain_text('"private": false')
        assert await no_sideways_scroll(a, "dl.args dd, details[open] pre, ol.held > li") >= 5
        await shots.take(a, "console-approvals-phone")
        await weigh(a, "approvals", weights)
        await a.set_viewport_size(DESKTOP)
        await shots.take(a, "console-approvals")
        await a.set_viewport_size(PHONE)
        await held.nth(0).get_by_role("button", name="Approve").click()
        await expect(a.locator("p.notice")).to_contain_text("Approved action #0")
        await a.locator("ol.held > li").nth(1).get_by_role("button", name="Deny").click()
        await expect(a.locator("p.notice")).to_contain_text("The run continues")
        await expect(a.locator("#approvals .empty")).to_be_visible()

        # The run's page: its steps on a time axis, what it posted and wrote and what it did not.
        run_id = (
            (await acme_gw.ListRuns(gateway_pb2.ListRunsRequest(agent_id=planner.agent_id), timeout=10)).runs[0].run_id
        )
        await a.set_viewport_size(DESKTOP)
        await a.goto(f"{stack.base}/runs/{run_id}")
        await expect(a.locator("#run-status")).to_have_text("succeeded", timeout=WAIT_MS)
        bars = a.locator("#timeline li.bar")
        await expect(bars.locator(".what strong")).to_have_text(
            [
                "claim and room read",
                "model request 1",
                "reply and writes",
                "parked",
                "held: #0 remember",
                "held: #1 create_task",
                "continued",
            ],
            timeout=WAIT_MS,
        )
        await expect(bars.nth(4).locator(".what small")).to_have_text("approved by Ana")
        await expect(bars.nth(5).locator(".what small")).to_have_text("denied by Ana")
        ticks = await a.locator("#timeline .ticks span, #timeline .ticks b").all_inner_texts()
        assert ticks[0] == "0" and ticks[-1].endswith(" s") and len(ticks) == 5, ticks
        spans = await bars.locator("rect").evaluate_all(
            "rects => rects.map(r => [Number(r.getAttribute('x')), Number(r.getAttribute('width'))])"
        )
        assert all(0 <= x and 2 <= w and x + w <= 1000 for x, w in spans), spans
        # The held actions wait from the park: they start where "parked" starts, after the model.
        assert spans[3][0] == spans[4][0] == spans[5][0] >= spans[1][0]
        await expect(a.locator("dl.facts")).to_contain_text("planner Acme")
        await expect(a.locator("dl.facts")).to_contain_text("Friday launch")
        await expect(a.locator("#effects li")).to_have_count(3)
        await expect(a.locator("#effects li").nth(0)).to_contain_text("reply — posted")
        await expect(a.locator("#effects li").nth(1)).to_contain_text("#0 remember — done")
        await expect(a.locator("#effects li").nth(2)).to_contain_text("#1 create_task — denied")
        await expect(a.locator("#effects li").nth(2)).to_contain_text("writer Globex")
        await shots.both(a, "console-run")
        await weigh(a, "run", weights)
        await acme_ctx.close()
        await globex_ctx.close()
    print_weights(weights)
    print(f"console screenshots in {shots.folder}")


async def test_history_company_pages_empty_states_and_dead_ends(database_url: str, tmp_path: Path) -> None:
    shots = Shots.for_test(tmp_path)
    weights: dict[str, dict[str, int]] = {}
    with trace_viewer() as jaeger:
        async with console_stack(
            database_url, "Acme", "Globex", "Initech", QUAYUTEC_CONSOLE_JAEGER_URL=jaeger
        ) as stack:
            acme_gw, globex_gw = stack.gateways["Acme"], stack.gateways["Globex"]
            acme_ctx = await stack.browser.new_context(viewport=DESKTOP, permissions=CLIPBOARD)
            a = await acme_ctx.new_page()
            await sign_in(a, stack.base, stack.companies["Acme"].secret)
            await empty_states(a, stack)

            launch = await create_room(acme_gw, "Friday launch")
            ops = await create_room(acme_gw, "Ops")
            planner = await register_agent(acme_gw, "planner")
            await register_agent(acme_gw, "helper")
            await join_room(acme_gw, globex_gw, launch.room_id)
            history = await record_history(stack, planner, ops.room_id)
            await run_history(a, stack, history, ops.room_id, jaeger, shots, weights)
            await company_pages(a, stack, planner, shots, weights)
            await invitations(a, stack, launch.room_id, shots, weights)
            await dead_ends(a, stack, shots)
            await acme_ctx.close()
    print_weights(weights)


async def empty_states(a: Page, stack: Stack) -> None:
    """A company with nothing yet: every section says so in a sentence."""
    base = stack.base
    for path, selector, words in (
        ("/rooms", "#room-list + .empty", "Your company is in no room yet"),
        ("/rooms", "main section:first-of-type .empty", "No invitations waiting"),
        ("/runs", "main .empty", "Your agents have no runs yet"),
        ("/agents", "#agents + .empty", "Your company has no agents yet"),
        ("/approvals", "#approvals .empty", "Nothing is waiting for your company's decision"),
        ("/invitations", "#received + .empty", "No invitations are waiting"),
        ("/invitations", "#answered + .empty", "has answered no invitation yet"),
        ("/invitations", "#sent + .empty", "has invited no one yet"),
        ("/rights", "main .empty", "no agents yet"),
    ):
        await a.goto(f"{base}{path}")
        await expect(a.locator(selector)).to_be_visible()
        await expect(a.locator(selector)).to_contain_text(words)


async def run_history(
    a: Page,
    stack: Stack,
    history: list[common_pb2.Run],
    ops_id: str,
    jaeger: str,
    shots: Shots,
    weights: dict[str, dict[str, int]],
) -> None:
    base = stack.base
    rows = a.locator("#run-table tbody tr")
    # Newest first, 50 a page, then the rest behind "Older runs".
    await a.goto(f"{base}/runs")
    await expect(rows).to_have_count(50)
    await expect(rows.nth(0)).to_have_id(f"r-{history[-1].run_id}")
    await expect(rows.nth(0).locator("td[data-label=Agent]")).to_have_text("planner")
    await expect(rows.nth(0).locator("td[data-label=Room]")).to_have_text("Ops")
    failed = a.locator(f"#r-{history[52].run_id}")  # i % 3 == 1: failed
    await expect(failed.locator("td[data-label=Status]")).to_have_text("failed")
    await expect(failed.locator("td[data-label=Error]")).to_have_text("rate_limited")
    await expect(failed.locator("td[data-label=Active]")).to_have_text("1.6 s")
    await expect(failed.locator("td[data-label='Posted and written']")).to_have_text("nothing posted")
    await shots.both(a, "console-runs")
    await weigh(a, "runs", weights)
    await a.get_by_role("link", name="Older runs").click()
    await expect(rows).to_have_count(5)
    await expect(rows.nth(4)).to_have_id(f"r-{history[0].run_id}")
    await a.get_by_role("link", name="Newest").click()
    await expect(rows).to_have_count(50)

    # Filters: by status, by time range (UTC), by room; combined, and paged with them.
    await a.get_by_label("Status", exact=True).select_option("failed")
    await a.get_by_role("button", name="Show").click()
    expected = [r.run_id for r in reversed(history) if r.status == common_pb2.RUN_STATUS_FAILED]
    await expect(rows).to_have_count(len(expected))
    assert await rows.evaluate_all("rows => rows.map(r => r.id.slice(2))") == expected
    await a.get_by_label("From (UTC)").fill("2026-03-01T12:10")
    await a.get_by_label("To (UTC)").fill("2026-03-01T12:20")
    await a.get_by_role("button", name="Show").click()
    in_range = [
        r.run_id for r in reversed(history) if r.status == common_pb2.RUN_STATUS_FAILED and 10 <= history.index(r) < 20
    ]
    assert await rows.evaluate_all("rows => rows.map(r => r.id.slice(2))") == in_range
    await a.goto(f"{base}/runs?room={ops_id}")
    await expect(rows).to_have_count(50)
    await expect(a.get_by_label("Room", exact=True)).to_have_value(ops_id)
    await a.get_by_role("link", name="Older runs").click()
    await expect(rows).to_have_count(5)
    await a.goto(f"{base}/runs?room={uuid.uuid4()}")
    await expect(a.locator("main .empty")).to_have_text("No runs match these filters.")
    bad = await a.goto(f"{base}/runs?from=yesterday")
    assert bad is not None and bad.status == 400
    await expect(a.get_by_role("alert")).to_contain_text("From must be a date and time")

    # The room's "Runs here" has the past at once (no live event needed), and leads to the history.
    await a.goto(f"{base}/rooms/{ops_id}")
    await expect(a.locator("#runs li")).to_have_count(10)
    await expect(a.locator("#runs li").first).to_have_id(f"r-{history[-1].run_id}")
    await a.get_by_role("link", name="All your runs in this room").click()
    await expect(a).to_have_url(f"{base}/runs?room={ops_id}")

    # A failed run: its error in words, and its trace opens in Jaeger (the stand-in) from the run's page.
    traced = history[7]  # i = 7: failed, traced
    await a.goto(f"{base}/runs/{traced.run_id}")
    await expect(a.locator("#run-error")).to_have_text(
        "Failed: the model provider kept refusing it for too many requests (HTTP 429) (3 requests); "
        "nothing was posted or written."
    )
    await expect(a.locator("#timeline li.bar .what strong")).to_have_text(
        [
            "claim and room read",
            "model request 1",
            "wait before request 2",
            "model request 2",
            "wait before request 3",
            "model request 3",
            "ending",
        ]
    )
    await expect(a.locator("#effects li")).to_have_text(["reply — not posted"])
    await a.get_by_role("link", name="Open the trace in Jaeger").click()
    await expect(a.locator("h1")).to_have_text(f"Jaeger stand-in: trace {TRACE_ID}")
    assert a.url == f"{jaeger}/trace/{TRACE_ID}"
    # Without a trace id there is nothing to link, and the page says so.
    await a.goto(f"{base}/runs/{history[4].run_id}")
    await expect(a.locator("#trace-links")).to_have_text("not traced")


async def company_pages(
    a: Page, stack: Stack, planner: common_pb2.Agent, shots: Shots, weights: dict[str, dict[str, int]]
) -> None:
    base = stack.base
    acme, acme_gw = stack.companies["Acme"], stack.gateways["Acme"]
    await acme_gw.SetAgentRights(
        gateway_pb2.SetAgentRightsRequest(agent_id=planner.agent_id, remember=HOLD), timeout=10
    )
    # Agents: provider and model, the rights in effect, the last runs.
    await a.goto(f"{base}/agents")
    card = a.locator(f"#a-{planner.agent_id}")
    await expect(a.locator("#agents > li h2")).to_have_text(["planner id", "helper id"])
    await expect(card.locator("dl")).to_contain_text("Anthropic · claude-test")
    await expect(card.locator(".right").first).to_have_text("remember: hold")
    await expect(card.locator("dd").nth(2).locator("a[href^='/runs/']")).to_have_count(3)
    await shots.both(a, "console-agents")
    await weigh(a, "agents", weights)
    assert await copied(a, f"#a-{planner.agent_id} h2 button.copy") == planner.agent_id

    # Rights: the agent's own marked apart from the inherited; two people saving different rights keep both.
    await card.get_by_role("link", name="edit").click()
    await expect(a).to_have_url(f"{base}/rights?agent={planner.agent_id}")
    await expect(a.locator("#f-remember")).to_have_value("hold")
    await expect(a.locator("#right-update_task td").nth(1)).to_have_text("auto inherited from the built-in default")
    other = await a.context.new_page()
    await other.goto(a.url)
    await a.locator("#f-close_task").select_option("deny")
    await a.get_by_role("button", name="Save").click()
    await expect(a.locator("p.notice")).to_have_text("Saved close task: deny.")
    await other.locator("#f-update_task").select_option("hold")  # a page opened before that save
    await other.get_by_role("button", name="Save").click()
    await expect(other.locator("p.notice")).to_have_text("Saved update task: hold.")
    stored = (
        await acme_gw.GetAgentRights(gateway_pb2.GetAgentRightsRequest(agent_id=planner.agent_id), timeout=10)
    ).agent
    assert (stored.remember, stored.update_task, stored.close_task) == (
        HOLD,
        HOLD,
        common_pb2.ACTION_RIGHT_DENY,
    )
    await other.close()
    # The company default, and an agent inheriting it.
    await a.goto(f"{base}/rights")
    await a.locator("#f-cross_company_task").select_option("hold")
    await a.get_by_role("button", name="Save").click()
    await expect(a.locator("p.notice")).to_have_text("Saved cross company task: hold.")
    await a.goto(f"{base}/rights?agent={planner.agent_id}")
    await expect(a.locator("#f-cross_company_task")).to_have_value("")
    await expect(a.locator("#right-cross_company_task td").nth(1)).to_have_text(
        "hold inherited from the company default"
    )
    await a.get_by_role("button", name="Save").click()
    await expect(a.locator("p.notice")).to_have_text("Nothing changed.")
    await shots.both(a, "console-rights")
    await weigh(a, "rights", weights)

    # Keys: listed without secrets, one made (shown once, after confirming with a company key), one revoked.
    await a.goto(f"{base}/keys")
    mine = a.locator(f"#k-{acme.key_id}")
    await expect(mine).to_contain_text("this sign-in's key")
    await a.get_by_label("Label").fill("ci")
    await a.get_by_label("Your company's API key, to confirm").fill("qyk_not-a-key")
    await a.get_by_role("button", name="Make the key").click()
    await expect(a.get_by_role("alert")).to_contain_text("not accepted")
    await expect(a.get_by_label("Label")).to_have_value("ci")
    await a.get_by_label("Your company's API key, to confirm").fill(stack.companies["Globex"].secret)
    await a.get_by_role("button", name="Make the key").click()
    await expect(a.get_by_role("alert")).to_contain_text("That key is Globex's, not Acme's")
    await a.get_by_label("Your company's API key, to confirm").fill(acme.secret)
    async with a.expect_response(f"{base}/keys") as answered:
        await a.get_by_role("button", name="Make the key").click()
    assert (await answered.value).headers["cache-control"] == "no-store"
    secret = (await a.locator("#new-key code.secret").text_content() or "").strip()
    assert secret.startswith("qyk_")
    assert await copied(a, "#new-key button.copy") == secret
    async with authed_gateway(stack.gateway_addr, secret) as ci_gw:
        assert (await ci_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)).company.company_id == acme.company_id
        await a.goto(f"{base}/keys")
        assert secret not in await a.content()
        await shots.both(a, "console-keys")  # no secret on it
        await weigh(a, "keys", weights)
        ci = a.locator("#key-table tr", has_text="ci")
        await expect(ci).to_contain_text("live")
        a.once("dialog", lambda dialog: dialog.accept())
        await ci.get_by_role("button", name="Revoke").click()
        await expect(a.locator("p.notice")).to_contain_text("Revoked the key ci")
        await expect(a.locator("#key-table tr", has_text="ci")).to_contain_text("revoked")
        await expect_error(grpc.StatusCode.UNAUTHENTICATED, ci_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10))


async def invitations(a: Page, stack: Stack, launch_id: str, shots: Shots, weights: dict[str, dict[str, int]]) -> None:
    base = stack.base
    initech = stack.companies["Initech"]
    await a.goto(f"{base}/invitations")
    await expect(a.locator("#sent li")).to_have_count(1)
    await expect(a.locator("#sent li")).to_contain_text("Globex id into Friday launch — accepted")
    await a.get_by_label("Invite into").select_option(label="Friday launch")
    await a.get_by_label("The company's id").fill(initech.company_id)
    await a.get_by_role("button", name="Invite").click()
    await expect(a.locator("p.notice")).to_have_text("Invited Initech into Friday launch.")
    await expect(a.locator("#sent li").first).to_contain_text("Initech id into Friday launch — pending")
    # A made-up company id is refused in words, and the form keeps it.
    await a.get_by_label("Invite into").select_option(label="Friday launch")
    await a.get_by_label("The company's id").fill(str(uuid.UUID(int=7)))
    await a.get_by_role("button", name="Invite").click()
    await expect(a.get_by_role("alert")).to_contain_text("not found")
    await expect(a.get_by_label("The company's id")).to_have_value(str(uuid.UUID(int=7)))

    initech_ctx: BrowserContext = await stack.browser.new_context(viewport=DESKTOP)
    i = await initech_ctx.new_page()
    await sign_in(i, base, initech.secret)
    await i.goto(f"{base}/invitations")
    await expect(i.locator("#received li")).to_contain_text("Friday launch from Acme")
    await shots.both(i, "console-invitations")
    await weigh(i, "invitations", weights)
    await i.locator("#received li").get_by_role("button", name="Decline").click()
    await expect(i.locator("p.notice")).to_have_text("You declined the invitation to Friday launch.")
    await expect(i.locator("#received + .empty")).to_be_visible()
    await expect(i.locator("#answered li")).to_contain_text("Friday launch from Acme — declined")
    await initech_ctx.close()
    await a.reload()
    await expect(a.locator("#sent li").first).to_contain_text("Initech id into Friday launch — declined")


async def dead_ends(a: Page, stack: Stack, shots: Shots) -> None:
    """An unknown page is a 404 in words; an unknown run or message says it is not found; the favicon is served."""
    base = stack.base
    answer = await a.goto(f"{base}/no-such-page")
    assert answer is not None and answer.status == 404
    await expect(a.locator("h1")).to_have_text("Not found")
    await expect(a.get_by_role("alert")).to_have_text("There is no page at /no-such-page.")
    assert "Something went wrong" not in await a.content()
    await shots.both(a, "console-not-found")
    for path in (f"/runs/{uuid.uuid4()}", f"/rooms/{uuid.uuid4()}/messages/{uuid.uuid4()}"):
        answer = await a.goto(f"{base}{path}")
        assert answer is not None and answer.status == 404
        await expect(a.locator("h1")).to_have_text("Not found")
        await expect(a.get_by_role("alert")).to_contain_text("not visible to your company")
    icon = await a.request.get(f"{base}/favicon.ico")
    assert icon.status == 200 and icon.headers["content-type"] == "image/x-icon"
    assert (await icon.body())[:4] == b"\x00\x00\x01\x00"  # an ICO file
