"""`quayutec demo`: two companies' agents work in one room; Runtime is killed mid-run and the wake
is redelivered, and the ledger shows it was not acted on twice. The console serves the same stack:
the demo prints its address and both companies' API keys, and then stays up, so a person can look,
until Ctrl-C (or Enter, in a terminal); `quayutec demo --then-stop`, or CI=true in the environment,
stops it as soon as the demo is done.

Everything runs on this machine: an embedded PostgreSQL, the four services as processes and the
stand-in model provider (no real provider key is needed or used), on ports of its own. The demo owns
its data folder while it runs (quayutec.datadir): the default one when it is free, else, when a stack
such as `quayutec up` uses it, a temporary folder removed at the end, so the two never meet.

With `make jaeger` running (its health check answers at JAEGER_HEALTH_ADDR), the demo traces its
services to that Jaeger through the standard OTEL_* variables, links the console's run pages to it,
and shows where Jaeger's query API holds its first run's trace.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from quayutec.config import RUNTIME, DatabaseConfig
from quayutec.datadir import DataDirLock, DataDirTaken, holder, own
from quayutec.db import create_pool
from quayutec.jaeger import UI_URL_ENV, LocalJaeger
from quayutec.ledger import run_id_for
from quayutec.tls import ADMIN, GATEWAY
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, room_pb2_grpc
from services.client import STATUS_NAMES, TASK_STATUS_NAMES, GatewayClient, format_run
from services.gateway.auth import create_api_key
from services.runtime.standin import ScriptedReply, StandinProvider
from services.stack import LocalStack

ENDED = (common_pb2.RUN_STATUS_SUCCEEDED, common_pb2.RUN_STATUS_FAILED, common_pb2.RUN_STATUS_TIMED_OUT)
_TASK_LINE = re.compile(r"- task ([0-9a-f-]{36}): ")


def say(text: str) -> None:
    print(text, flush=True)


def _prompt(body: Mapping[str, Any]) -> str:
    parts = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        parts.append(content if isinstance(content, str) else str(content))
    return "\n".join(parts)


def planner_script(writer_id: str) -> Callable[[Mapping[str, Any]], ScriptedReply]:
    def respond(body: Mapping[str, Any]) -> ScriptedReply:
        prompt = _prompt(body)
        if "venue" in prompt:
            return ScriptedReply(
                "Noting the venue for everyone in the room.",
                ({"name": "remember", "arguments": {"text": "Venue: the harbour hall", "private": False}},),
            )
        if "pick up" in prompt:
            seen = "I see Bolt's copy in the room" if "Copy:" in prompt else "no copy yet"
            return ScriptedReply(f"Picking up where the last run stopped: {seen}; the launch stays on Friday.")
        return ScriptedReply(
            "Plan: launch on Friday. Asking Bolt's writer for two lines of copy.",
            (
                {"name": "remember", "arguments": {"text": "Launch is on Friday", "private": False}},
                {
                    "name": "create_task",
                    "arguments": {"to_agent_id": writer_id, "title": "Write launch copy", "body": "Two lines."},
                },
            ),
        )

    return respond


def writer_script(body: Mapping[str, Any]) -> ScriptedReply:
    match = _TASK_LINE.search(_prompt(body))
    if match is None:
        return ScriptedReply("Nothing assigned to me.")
    return ScriptedReply(
        "Copy: 'Rooms where agents keep their word.' Task done.",
        (
            {"name": "close_task", "arguments": {"task_id": match.group(1), "status": "done", "note": "copy posted"}},
            {"name": "remember", "arguments": {"text": "Bolt's day rate is confidential", "private": True}},
        ),
    )


async def wait_for(check: Callable[[], Awaitable[Any]], what: str, limit: float = 30.0) -> Any:
    deadline = time.monotonic() + limit
    while True:
        try:
            found = await check()
            if found:
                return found
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {what} after {limit:g} s")
        await asyncio.sleep(0.1)


async def ended_run(client: GatewayClient, run_id: str) -> common_pb2.Run:
    async def check() -> common_pb2.Run | None:
        run = (await client.GetRun(gateway_pb2.GetRunRequest(run_id=run_id))).run
        return run if run.status in ENDED else None

    result: common_pb2.Run = await wait_for(check, f"run {run_id}")
    return result


REDELIVERIES = 5
_DELIVERED_LINE = re.compile(r"wake (\S+) delivered \(attempt (\d+)\): StartRun answered (\w+)")


def delivery_answers(stack: LocalStack, wake_id: str) -> list[str]:
    """What Runtime answered each time the Gateway delivered ``wake_id``, from the Gateway's log."""
    log = stack.log_dir / "gateway.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return [
        f"delivery attempt {m.group(2)}, Runtime answered {m.group(3)}"
        for m in _DELIVERED_LINE.finditer(text)
        if m.group(1) == wake_id
    ]


async def redeliver(stack: LocalStack, wake_id: str, n: int) -> str:
    """Make the delivered wake due again in the Room's outbox, as a settlement lost on the way would
    leave it, and wait for the running Gateway to deliver it once more; returns Runtime's answer."""
    before = len(delivery_answers(stack, wake_id))
    pool = await create_pool(stack.database_url, min_size=1, max_size=1)
    try:
        await pool.execute(
            "UPDATE wake_outbox SET delivered_at = NULL, due_at = now(), lease_owner = NULL, "
            "lease_expires_at = NULL WHERE wake_id = $1",
            uuid.UUID(wake_id),
        )

        async def delivered_again() -> str | None:
            answers = delivery_answers(stack, wake_id)
            done = await pool.fetchval("SELECT delivered_at FROM wake_outbox WHERE wake_id = $1", uuid.UUID(wake_id))
            return answers[before] if done is not None and len(answers) > before else None

        answer: str = await wait_for(delivered_again, f"redelivery {n} of wake {wake_id}")
    finally:
        await pool.close()
    return answer


async def free_names(pool: Any, wanted: tuple[str, ...]) -> tuple[str, ...]:
    """``wanted`` as they are when no company has any of them (regardless of case), else each with the
    first number " 2", " 3", ... that none has: an earlier demo on the same database keeps its own."""
    taken = {n.casefold() for n in await pool.fetchval("SELECT coalesce(array_agg(name), '{}') FROM companies")}
    for n in range(1, 1000):  # bounded
        names = tuple(w if n == 1 else f"{w} {n}" for w in wanted)
        if not {x.casefold() for x in names} & taken:
            return names
    raise RuntimeError("every demo company name up to 999 is taken in this database")


# The services' names in traces (quayutec.telemetry: quayutec-<service> unless OTEL_SERVICE_NAME says otherwise).
TRACED_SERVICES = frozenset({"quayutec-gateway", "quayutec-room", "quayutec-claims", "quayutec-runtime"})
JAEGER_WAIT_SECONDS = 20.0


def own_endpoint(env: Mapping[str, str]) -> bool:
    return any(
        env.get(name, "").strip() for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def local_jaeger(env: Mapping[str, str]) -> LocalJaeger | None:
    """The Jaeger `make jaeger` runs, when its health check answers and the environment names no
    OTLP endpoint of its own (one named is the operator's choice, kept as it is)."""
    if own_endpoint(env):
        return None
    jaeger = LocalJaeger.from_env(env)
    return jaeger if jaeger.healthy() else None


def tracing_env(jaeger: LocalJaeger, env: Mapping[str, str]) -> dict[str, str]:
    """What the demo's services (and its console) are given to trace to ``jaeger``: the standard
    OTLP variables, no metrics (Jaeger takes none) unless chosen, spans sent every half second
    unless chosen (so a run's trace is whole in Jaeger before the demo kills Runtime), and the
    console's run pages linked to Jaeger unless another address is set."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_endpoint,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": env.get("OTEL_METRICS_EXPORTER", "").strip() or "none",
        "OTEL_BSP_SCHEDULE_DELAY": env.get("OTEL_BSP_SCHEDULE_DELAY", "").strip() or "500",
        UI_URL_ENV: env.get(UI_URL_ENV, "").strip() or jaeger.ui_url,
    }


async def show_trace(jaeger: LocalJaeger, run: common_pb2.Run) -> None:
    """Say where to read ``run``'s trace in Jaeger, and wait (bounded) until Jaeger holds it whole."""
    if not run.trace_id:
        say("   this run recorded no trace id: its services did not trace")
        return
    say(f"   its trace {run.trace_id}, in Jaeger's query API: {jaeger.api_trace_url(run.trace_id)}")
    deadline = time.monotonic() + JAEGER_WAIT_SECONDS
    services: set[str] = set()
    while time.monotonic() < deadline:
        services = await asyncio.to_thread(jaeger.services_of, run.trace_id)
        if TRACED_SERVICES <= services:
            break
        await asyncio.sleep(0.5)
    if TRACED_SERVICES <= services:
        say(f"   Jaeger holds it, with spans of {', '.join(sorted(services))}")
    else:
        say(f"   Jaeger does not hold it whole yet (services so far: {sorted(services) or 'none'}); read it later")


async def demo(stack: LocalStack, standin: StandinProvider, jaeger: LocalJaeger | None = None) -> None:
    tag = uuid.uuid4().hex[:6]  # the stand-in's answers are per model: this run's models are its own
    async with (
        stack.channel("room", ADMIN) as room_channel,
        stack.channel("gateway", GATEWAY) as gw_channel,
    ):
        room = room_pb2_grpc.RoomServiceStub(room_channel)
        say("\n== 1. Two companies, each with an API key (admin commands)")
        pool = await create_pool(stack.database_url, min_size=1, max_size=2)
        try:
            acme_name, bolt_name = await free_names(pool, ("Acme", "Bolt"))
            if (acme_name, bolt_name) != ("Acme", "Bolt"):
                say(f"   (this database has an Acme or a Bolt of an earlier run: these are {acme_name}, {bolt_name})")
            acme = (await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name=acme_name))).company
            bolt = (await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name=bolt_name))).company
            _, key_a = await create_api_key(pool, acme.company_id, "demo")
            _, key_b = await create_api_key(pool, bolt.company_id, "demo")
        finally:
            await pool.close()
        a, b = GatewayClient(gw_channel, key_a), GatewayClient(gw_channel, key_b)
        say(f"   {acme.name} and {bolt.name}, each with a key of its own")
        if stack.console_listen:
            say(f"   watch it in the console, {stack.console_url}, signed in with either demo key:")
            say(f"     {acme.name}: {key_a}\n     {bolt.name}: {key_b}")

        say("\n== 2. Acme opens a room and invites Bolt, Bolt accepts; each registers an always-on agent")
        r = (await a.CreateRoom(gateway_pb2.CreateRoomRequest(name="friday-launch"))).room
        invited = await a.InviteCompany(gateway_pb2.InviteCompanyRequest(room_id=r.room_id, company_id=bolt.company_id))
        pending = (await b.ListInvitations(gateway_pb2.ListInvitationsRequest())).invitations
        say(f"   Bolt's pending invitations: {[(i.room_name, i.invited_by_company_name) for i in pending]}")
        await b.AcceptInvitation(gateway_pb2.AcceptInvitationRequest(invitation_id=invited.invitation.invitation_id))
        planner = (
            await a.RegisterAgent(
                gateway_pb2.RegisterAgentRequest(
                    name="planner",
                    provider=common_pb2.PROVIDER_ANTHROPIC,
                    model=f"demo-planner-{tag}",
                    provider_key="sk-ant-demo-not-a-real-key",
                    system_prompt="You plan launches with other companies.",
                )
            )
        ).agent
        writer = (
            await b.RegisterAgent(
                gateway_pb2.RegisterAgentRequest(
                    name="writer",
                    provider=common_pb2.PROVIDER_OPENAI,
                    model=f"demo-writer-{tag}",
                    provider_key="sk-openai-demo-not-a-real-key",
                    system_prompt="You write launch copy.",
                )
            )
        ).agent
        standin.set_responder(planner.model, planner_script(writer.agent_id))
        standin.set_responder(writer.model, writer_script)
        say(f"   room {r.name}: {acme.name}'s agent planner and {bolt.name}'s agent writer")
        names = {planner.agent_id: "planner", writer.agent_id: "writer"}

        def shown(run: common_pb2.Run) -> str:
            return format_run(run, agent=names.get(run.agent_id, ""), room=r.name)

        say("\n== 3. Ana (Acme) asks the planner; it tasks Bolt's writer, who answers")
        posted = await a.PostMessage(
            gateway_pb2.PostMessageRequest(
                room_id=r.room_id,
                person="ana",
                body="@planner plan Friday's launch with Bolt",
                mention_agent_ids=[planner.agent_id],
            )
        )
        first_wake = posted.wake_ids[0]
        run1 = await ended_run(a, run_id_for(planner.agent_id, first_wake))
        say(shown(run1))
        if jaeger is not None:
            await show_trace(jaeger, run1)

        async def writer_done() -> common_pb2.Run | None:
            runs = (await b.ListRuns(gateway_pb2.ListRunsRequest(agent_id=writer.agent_id))).runs
            return next((x for x in runs if x.status in ENDED), None)

        run2: common_pb2.Run = await wait_for(writer_done, "the writer's run")
        say(shown(run2))
        tasks = (await a.ListTasks(gateway_pb2.ListTasksRequest(room_id=r.room_id))).tasks
        for t in tasks:
            say(f"   task '{t.title}': {TASK_STATUS_NAMES[t.status]}")
        seen_a = [m.text for m in (await a.ListMemory(gateway_pb2.ListMemoryRequest(room_id=r.room_id))).lines]
        seen_b = [m.text for m in (await b.ListMemory(gateway_pb2.ListMemoryRequest(room_id=r.room_id))).lines]
        say(f"   memory Acme can read: {seen_a}\n   memory Bolt can read: {seen_b}")

        say("\n== 4. Runtime is killed (SIGKILL) in the middle of a run")
        standin.enqueue_reply("this answer never arrives", model=planner.model, delay_seconds=60.0)
        before = len(standin.requests(planner.model))
        posted = await a.PostMessage(
            gateway_pb2.PostMessageRequest(
                room_id=r.room_id, person="ana", body="@planner status?", mention_agent_ids=[planner.agent_id]
            )
        )
        crash_wake = posted.wake_ids[0]

        async def model_called() -> bool:
            return len(standin.requests(planner.model)) > before

        await wait_for(model_called, "the planner's model call")
        stack.kill("runtime")
        say("   runtime killed while the model was answering")
        stack.start("runtime")
        await stack.wait_serving(RUNTIME)
        say("   runtime restarted; the Gateway delivers the same wake again, 5 times, as a lost settlement would:")
        for n in range(1, REDELIVERIES + 1):
            answer = await redeliver(stack, crash_wake, n)
            say(f"   redelivery {n}: {answer}")
        dead = (await a.GetRun(gateway_pb2.GetRunRequest(run_id=run_id_for(planner.agent_id, crash_wake)))).run
        say(shown(dead))
        say(f"   -> the killed run stays {STATUS_NAMES[dead.status]} at its last step; nothing posted, not redone")
        say("      (the Gateway's housekeeping ends it as abandoned once it has been still for 10 minutes)")

        say("\n== 5. The next message starts a fresh run that reads the room as it stands")
        posted = await a.PostMessage(
            gateway_pb2.PostMessageRequest(
                room_id=r.room_id,
                person="ana",
                body="@planner pick up where you left off",
                mention_agent_ids=[planner.agent_id],
            )
        )
        run3 = await ended_run(a, run_id_for(planner.agent_id, posted.wake_ids[0]))
        say(shown(run3))
        say("\n== 6. Acme holds its planner's memory writes for a person's decision; Ana approves one")
        hold = gateway_pb2.SetAgentRightsRequest(agent_id=planner.agent_id, remember=common_pb2.ACTION_RIGHT_HOLD)
        hold.update_mask.paths.append("remember")
        await a.SetAgentRights(hold)
        posted = await a.PostMessage(
            gateway_pb2.PostMessageRequest(
                room_id=r.room_id, person="ana", body="@planner note the venue", mention_agent_ids=[planner.agent_id]
            )
        )

        async def held() -> common_pb2.Waitpoint | None:
            waiting = (await a.ListApprovals(gateway_pb2.ListApprovalsRequest())).waitpoints
            return waiting[0] if waiting else None

        waitpoint: common_pb2.Waitpoint = await wait_for(held, "the planner's held action")
        for h in waitpoint.held:
            action = common_pb2.ActionKind.Name(h.kind).removeprefix("ACTION_KIND_").lower()
            say(f"   the planner's run is parked: action #{h.index} {action} {h.arguments_json} waits for Acme")
        decided = await a.DecideApproval(
            gateway_pb2.DecideApprovalRequest(token=waitpoint.token, index=0, person="ana", approve=True)
        )
        who = decided.waitpoint.held[0]
        say(f"   approved by {who.decided_by} (as stated by Acme's service; in the console, a person signed in")
        say("   through Acme's own provider is recorded as verified by it); the run continues once:")
        run4 = await ended_run(a, run_id_for(planner.agent_id, posted.wake_ids[0]))
        say(shown(run4))
        seen_a = [m.text for m in (await a.ListMemory(gateway_pb2.ListMemoryRequest(room_id=r.room_id))).lines]
        say(f"   memory Acme can read now: {seen_a}")

        messages = (await a.ListMessages(gateway_pb2.ListMessagesRequest(room_id=r.room_id, page_size=100))).messages
        companies = {acme.company_id: acme.name, bolt.company_id: bolt.name}
        agents = {planner.agent_id: "planner", writer.agent_id: "writer"}
        say(f"\n== The room {r.name}")
        for m in messages:
            company = companies.get(m.author.company_id, m.author.company_id)
            who_wrote = m.author.person if m.author.person else f"{agents.get(m.author.agent_id, m.author.agent_id)}"
            say(f"   #{m.seq} {who_wrote} ({company}): {m.body}")
        planner_replies = [m for m in messages if m.author.agent_id == planner.agent_id]
        say(f"\n   planner replies: {len(planner_replies)} for 4 wakes, one of which died mid-run (never twice)")


def stops_when_done(then_stop: bool) -> str:
    """Why the demo stops as soon as it is done, or "" when it stays up for a person to look."""
    if then_stop:
        return "--then-stop"
    if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
        return "CI=true"
    return ""


async def run_demo(*, then_stop: bool = False) -> int:
    started = time.monotonic()
    jaeger = local_jaeger(os.environ)
    folder, temporary = claim_folder(DatabaseConfig.from_env().data_dir)
    try:
        with StandinProvider() as standin:
            stack = LocalStack.with_ports(
                ephemeral=True,
                extra_env={
                    "QUAYUTEC_RUNTIME_ANTHROPIC_BASE_URL": standin.base_url,
                    "QUAYUTEC_RUNTIME_OPENAI_BASE_URL": standin.base_url,
                    "QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.1",
                    **(tracing_env(jaeger, os.environ) if jaeger is not None else {}),
                },
                data_dir=folder.data_dir,
            )
            stack.folder = folder
            stack.owner_command = "quayutec demo"
            folder.record(stack.owner("quayutec demo"))
            try:
                say("starting the embedded PostgreSQL and applying migrations ...")
                await stack.prepare_database()
                say("starting gateway, room, claims and runtime ...")
                await stack.start_all()
                await stack.start_console()
                for name in stack.ports:
                    say(f"   {name:8s} {stack.addr(name)}")
                say(f"   console  {stack.console_url}")
                if jaeger is not None:
                    at = f"{jaeger.ui_url} (OTLP {jaeger.otlp_endpoint})"
                    say(f"traced to the Jaeger at {at}; the console's run pages link to it")
                elif not own_endpoint(os.environ):
                    health = LocalJaeger.from_env(os.environ).health
                    say(f"not traced: no Jaeger answers at {health} (`make jaeger` starts one to read the runs in)")
                await demo(stack, standin, jaeger)
                why = stops_when_done(then_stop)
                if why:
                    say(f"\nstopping the stack ({why}) ...")
                else:
                    enter = sys.stdin.isatty()
                    how = "press Enter or Ctrl-C to stop it" if enter else f"Ctrl-C (or `kill {os.getpid()}`) stops it"
                    await enter_or_interrupt(
                        f"\nthe stack stays up: open the console at {stack.console_url} and sign in with a key above;"
                        f"\n{how}",
                        enter=enter,
                    )
                    say("stopping ...")
            finally:
                stack.stop_all()
                # The embedded PostgreSQL of its folder goes too.
                await asyncio.to_thread(stack.stop_database)
    finally:
        folder.release()
        if temporary:
            shutil.rmtree(folder.data_dir.parent, ignore_errors=True)
    where = "a temporary folder, now removed" if temporary else stack.log_dir
    say(f"\ndemo finished in {time.monotonic() - started:.1f} s (service logs in {where})")
    return 0


def claim_folder(data_dir: Path) -> tuple[DataDirLock, bool]:
    """The data folder the demo owns while it runs: ``data_dir`` when free, else (another stack, or
    services started on their own, use it) a temporary folder of its own; and whether it is temporary.
    So the demo never shares a database, logs or a delivery loop with a stack already running."""
    try:
        return own(data_dir, again="quayutec demo"), False
    except DataDirTaken:
        pass
    who = holder(data_dir)
    # Short (the embedded PostgreSQL's Unix socket lives in it) and reachable by PostgreSQL's own
    # user, which pgserver runs the server as when we are root.
    root = Path(tempfile.mkdtemp(prefix="qy-demo-", dir="/tmp" if Path("/tmp").is_dir() else None))
    root.chmod(0o755)
    say(f"{data_dir} is in use by {who};\nthe demo runs beside it in a temporary folder of its own, {root / 'data'}")
    return own(root / "data", again="quayutec demo"), True


async def enter_or_interrupt(prompt: str, *, enter: bool = True) -> None:
    """Say ``prompt``, then wait until Enter on standard input, Ctrl-C or SIGTERM, whichever comes
    first (with ``enter`` false, standard input is not read: Ctrl-C or SIGTERM only). The handlers are
    in place before the prompt is shown, so a Ctrl-C the moment it appears is one of them (not Python's
    KeyboardInterrupt). Nothing is left waiting on the terminal after (a thread blocked reading it
    would hold the exit until Enter)."""
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()

    def readable() -> None:
        os.read(fd, 4096)  # the line typed (a terminal hands it over at Enter), or end of input
        done.set()

    if enter:
        loop.add_reader(fd, readable)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    try:
        say(prompt)
        await done.wait()
    finally:
        if enter:
            loop.remove_reader(fd)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
