"""The `quayutec` command: the demo end to end, and the key admin commands, as a user runs them."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pty
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from quayutec.telemetry import SpanCapture
from quayutec.v1 import common_pb2, room_pb2, room_pb2_grpc
from services.client import format_run
from services.gateway.auth import KEY_PREFIX
from services.runtime.standin import StandinProvider
from tests.harness.channels import mtls_env, service_channel
from tests.harness.room import running_room

REPO = Path(__file__).resolve().parent.parent


async def quayutec(*args: str, env: dict[str, str], limit: float = 120.0) -> subprocess.CompletedProcess[str]:
    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "services.cli", *args],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **env},
            capture_output=True,
            text=True,
            timeout=limit,
        )

    return await asyncio.to_thread(run)


def client_env(database_url: str, room_addr: str, gateway_addr: str) -> dict[str, str]:
    """The environment of the client and admin commands against these servers."""
    return {
        "DATABASE_URL": database_url,
        "QUAYUTEC_ROOM_ADDR": room_addr,
        "QUAYUTEC_GATEWAY_ADDR": gateway_addr,
        **mtls_env("admin"),
    }


@asynccontextmanager
async def room_and_gateway(database_url: str) -> AsyncIterator[dict[str, str]]:
    """A Room and a Gateway that delivers no wakes; yields the client commands' environment for them."""
    from tests.harness.gateway import running_gateway

    async with (
        running_room(database_url) as room_addr,
        running_gateway(
            database_url, room_addr, "127.0.0.1:9", QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false"
        ) as gateway_addr,
    ):
        yield client_env(database_url, room_addr, gateway_addr)


@asynccontextmanager
async def four_services(database_url: str) -> AsyncIterator[tuple[dict[str, str], StandinProvider]]:
    """The four services (the stand-in model provider answering) delivering wakes at once; yields
    the client commands' environment for them and the stand-in."""
    from tests.harness.claims import running_claims
    from tests.harness.gateway import running_gateway
    from tests.harness.runtime import running_runtime

    with StandinProvider() as standin:
        async with (
            running_claims(database_url) as claims_addr,
            running_room(database_url) as room_addr,
            running_runtime(claims_addr, room_addr, standin_url=standin.base_url) as runtime_addr,
            running_gateway(
                database_url, room_addr, runtime_addr, QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS="0.05"
            ) as gateway_addr,
        ):
            yield client_env(database_url, room_addr, gateway_addr), standin


def succeeding(env: dict[str, str]) -> Callable[..., Awaitable[str]]:
    """``ok(*args, **extra_env)``: runs the command with ``env`` (plus ``extra_env``); it must succeed."""

    async def ok(*args: str, **extra: str) -> str:
        done = await quayutec(*args, env={**env, **extra})
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done.stdout

    return ok


async def test_the_demo_runs_to_the_end(empty_database_url: str, tmp_path: Path) -> None:
    """With no Jaeger answering (tests/test_local_jaeger.py runs it with one): untraced, and it says so."""
    from services.stack import free_port

    nobody = f"127.0.0.1:{free_port()}"
    done = await quayutec(
        "demo",
        "--then-stop",
        env={"DATABASE_URL": empty_database_url, "QUAYUTEC_DATA_DIR": str(tmp_path), "JAEGER_HEALTH_ADDR": nobody},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "stopping the stack (--then-stop) ..." in out
    assert f"not traced: no Jaeger answers at {nobody} (`make jaeger` starts one" in out
    assert "  trace (not traced)\n" in out and "Jaeger's query API" not in out
    # Each of the five redeliveries went through the Gateway and was answered "already claimed".
    for n in range(1, 6):
        assert re.search(rf"redelivery {n}: delivery attempt \d+, Runtime answered ALREADY_CLAIMED", out), out
    assert "the killed run stays running at its last step; nothing posted, not redone" in out
    assert "task 'Write launch copy': done" in out and "TASK_STATUS" not in out
    assert "memory Acme can read: ['Launch is on Friday']" in out
    assert "planner replies: 3 for 4 wakes" in out
    # A held action, decided by a person; the run continued once and wrote it.
    assert re.search(r"action #0 remember .*Venue: the harbour hall.* waits for Acme", out), out
    assert "approved by ana (as stated by Acme's service" in out
    memory = next(line for line in out.splitlines() if "memory Acme can read now:" in line)
    assert "'Launch is on Friday'" in memory and "'Venue: the harbour hall'" in memory
    assert re.search(r"#\d+ planner \(Acme\): Noting the venue", out), out
    # People read names: no company, room, agent, wake or message id is printed (run ids head their records).
    assert "room friday-launch: Acme's agent planner and Bolt's agent writer" in out
    assert "  agent planner  room friday-launch  woken by a message" in out
    ids = set(re.findall(r"(?<!qyk_)[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", out))  # keys aside
    run_ids = set(re.findall(r"^run (\S+)  status=", out, re.M))
    assert ids == run_ids, [line for line in out.splitlines() if any(i in line for i in ids - run_ids)]
    assert "sk-ant-demo" not in out and "sk-openai-demo" not in out
    # The console's address and the demo's keys, for a person to look.
    assert re.search(r"console  http://127\.0\.0\.1:\d+", out), out
    assert re.search(r"Acme: qyk_", out), out


async def test_keys_are_made_listed_and_revoked(database_url: str) -> None:
    env = {"DATABASE_URL": database_url}
    async with running_room(database_url) as room_addr, service_channel(room_addr, "admin") as channel:
        room = room_pb2_grpc.RoomServiceStub(channel)
        company = (await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name="Acme"))).company
    made = await quayutec("keys", "create", "--company", company.company_id, "--label", "ci", env=env)
    assert made.returncode == 0, made.stderr
    key_line, secret = made.stdout.splitlines()[:2]
    key_id = key_line.removeprefix("key ")
    assert secret.startswith(KEY_PREFIX) and key_id in secret
    listed = await quayutec("keys", "list", "--company", company.company_id, env=env)
    assert key_id in listed.stdout and secret not in listed.stdout
    assert listed.stdout.splitlines()[0].split() == ["KEY_ID", "LABEL", "CREATED_AT", "REVOKED_AT"]
    [row] = json.loads((await quayutec("keys", "list", "--company", company.company_id, "--json", env=env)).stdout)
    assert row["key_id"] == key_id and row["label"] == "ci" and row["revoked_at"] is None  # --json: null when absent
    # The company by its name, regardless of case, as well as by its id.
    assert (await quayutec("keys", "list", "--company", "acme", env=env)).stdout == listed.stdout
    by_name = await quayutec("keys", "create", "--company", "Acme", "--label", "by name", env=env)
    assert by_name.returncode == 0 and by_name.stdout.startswith("key "), by_name.stderr
    revoked = await quayutec("keys", "revoke", key_id, env=env)
    assert revoked.returncode == 0 and "revoked" in revoked.stdout
    unknown = await quayutec("keys", "revoke", "00000000-0000-0000-0000-000000000000", env=env)
    assert unknown.returncode == 1 and "no key" in unknown.stderr


async def test_admin_with_another_ca_is_refused_and_told_what_to_fix(database_url: str, tmp_path: Path) -> None:
    """`company create` from a data folder whose development CA the Room does not trust."""
    async with running_room(database_url) as room_addr:
        done = await quayutec(
            "company", "create", "Acme", env={"QUAYUTEC_ROOM_ADDR": room_addr, "QUAYUTEC_DATA_DIR": str(tmp_path)}
        )
    assert done.returncode == 2
    assert "mutual TLS" in done.stderr and "QUAYUTEC_DATA_DIR" in done.stderr
    assert (tmp_path / "pki" / "admin" / "tls.key").exists()


async def test_pki_init_makes_the_dev_pki_and_shows_its_folders(tmp_path: Path) -> None:
    done = await quayutec("pki", "init", env={"QUAYUTEC_DATA_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert f"{tmp_path / 'pki' / 'ca'}/  ca.crt ca.key" in done.stdout
    assert f"{tmp_path / 'pki' / 'room'}/  ca.crt tls.crt tls.key" in done.stdout
    assert (tmp_path / "pki" / "ca" / "ca.key").exists() and (tmp_path / "pki" / "room" / "tls.key").exists()


async def test_a_gateway_that_is_down_is_said_in_words() -> None:
    down = await quayutec(
        "room", "list", env={"QUAYUTEC_API_KEY": f"{KEY_PREFIX}x_y", "QUAYUTEC_GATEWAY_ADDR": "127.0.0.1:9"}
    )
    assert down.returncode == 2 and "Traceback" not in down.stderr
    assert "the Gateway at 127.0.0.1:9 cannot be reached" in down.stderr, down.stderr


async def test_client_commands_need_an_api_key(tmp_path: Path) -> None:
    done = await quayutec("runs", env={"QUAYUTEC_API_KEY": "", "QUAYUTEC_GATEWAY_ADDR": "127.0.0.1:9"})
    assert done.returncode != 0
    assert "QUAYUTEC_API_KEY" in done.stderr


async def test_a_user_runs_the_product_from_the_command_line(database_url: str) -> None:
    """The README's command-line flow against real services: company, key, room, agent, a message,
    then the agent's run in the ledger."""
    async with four_services(database_url) as (env, _):
        ok = succeeding(env)

        company_id = (await ok("company", "create", "Acme")).split()[1]
        secret = (await ok("keys", "create", "--company", company_id)).splitlines()[1]
        env["QUAYUTEC_API_KEY"] = secret
        room_id = (await ok("room", "create", "launch")).split()[1]
        agent_line = await ok(
            "agent", "register", "--name", "planner", "--provider", "anthropic", "--model", "claude-cli",
            QUAYUTEC_PROVIDER_KEY="sk-ant-cli-secret",
        )  # fmt: skip
        agent_id = agent_line.split()[1]
        missing_key = await quayutec(
            "agent", "register", "--name", "x", "--provider", "openai", "--model", "m", env=env
        )  # fmt: skip
        assert missing_key.returncode != 0 and "QUAYUTEC_PROVIDER_KEY" in missing_key.stderr
        posted = await ok("post", "--room", room_id, "--person", "ana", "--mention", agent_id, "plan it")
        assert re.fullmatch(r"message \S+ #1; woke 1 agent: wakes [0-9a-f-]{36}\n", posted), posted
        for _ in range(300):  # bounded: the Gateway delivers, the Runtime runs
            runs = await ok("runs", "--agent", agent_id, "--json")
            if '"status": "succeeded"' in runs:
                break
            await asyncio.sleep(0.1)
        listed = json.loads(runs)
        assert [r["status"] for r in listed] == ["succeeded"]
        run_id = listed[0]["run_id"]
        # --json carries data only: an absent trace is null, the room and agent by id beside their names.
        assert listed[0]["trace"] is None and listed[0]["room_id"] == room_id and listed[0]["room"] == "launch"
        assert listed[0]["agent_id"] == agent_id and listed[0]["started"].startswith("20")
        table = await ok("runs", "--agent", agent_id)
        header, row = table.splitlines()
        assert header.split() == ["RUN_ID", "AGENT", "ROOM", "STARTED", "STATUS", "LAST_STEP", "TRACE"]
        assert row.startswith(run_id) and "(not traced)" in row and " planner " in row and " launch " in row
        assert listed[0]["started"] in row
        assert (await ok("runs", "--agent", "Planner")) == table  # by name too
        nobody = await quayutec("runs", "--agent", "nobody", env=env)
        assert nobody.returncode == 1 and "no agent named 'nobody'; its agents: planner" in nobody.stderr
        record = await ok("run", run_id)
        assert "model request 1: 200 ok" in record and "posted: a reply" in record
        assert "  agent planner  room launch  woken by a message  " in record, record
        assert agent_id not in record and room_id not in record
        [room_row] = (await ok("room", "list")).splitlines()[1:]
        assert room_row.split()[:3] == [room_id, "launch", "Acme"], room_row  # CREATED_BY by name
        [as_json] = json.loads(await ok("room", "list", "--json"))
        assert as_json["created_by"] == "Acme" and as_json["created_by_company_id"] == company_id
        messages = await ok("messages", "--room", room_id)
        assert "ana (Acme, as stated)" in messages and 'Noted, you asked "plan it"' in messages
        assert "planner (Acme's agent)" in messages
        assert (await ok("messages", "--room", "Launch")) == messages  # a room by its name
        unknown_room = await quayutec("messages", "--room", "nowhere", env=env)
        assert unknown_room.returncode == 1 and "no room named 'nowhere'; its rooms: launch" in unknown_room.stderr
        assert "sk-ant-cli-secret" not in record + messages + runs
        rights = await ok("rights", "set", "--create-task", "hold")
        assert "create_task=hold" in rights
        assert (await ok("approvals")) == "(no held actions)\n"
        assert json.loads(await ok("approvals", "--json")) == []


async def test_a_run_shows_its_trace_and_its_jaeger_page(
    database_url: str, captured: tuple[InMemorySpanExporter, SpanCapture]
) -> None:
    """`quayutec run` against real services with telemetry on (``captured``): the ledger's trace id,
    which is the trace of the run's own spans, and its Jaeger page when QUAYUTEC_CONSOLE_JAEGER_URL is
    set; --json carries the same as data; a setting that is no http(s) URL is refused before any call."""
    exporter, _ = captured
    jaeger = "https://jaeger.ops.example/ui"  # only written into links, never dialled
    async with four_services(database_url) as (env, _):
        ok = succeeding(env)
        company_id = (await ok("company", "create", "Acme")).split()[1]
        env["QUAYUTEC_API_KEY"] = (await ok("keys", "create", "--company", company_id)).splitlines()[1]
        room_id = (await ok("room", "create", "launch")).split()[1]
        agent_id = (
            await ok(
                "agent", "register", "--name", "planner", "--provider", "anthropic", "--model", "claude-traced",
                QUAYUTEC_PROVIDER_KEY="sk-ant-cli-secret",
            )
        ).split()[1]  # fmt: skip
        await ok("post", "--room", room_id, "--person", "ana", "--mention", agent_id, "plan it")
        for _ in range(300):  # bounded: the Gateway delivers, the Runtime runs
            listed = json.loads(await ok("runs", "--agent", agent_id, "--json"))
            if listed and listed[0]["status"] == "succeeded":
                break
            await asyncio.sleep(0.1)
        assert [r["status"] for r in listed] == ["succeeded"]
        run_id = listed[0]["run_id"]
        record = json.loads(await ok("run", run_id, "--json", QUAYUTEC_CONSOLE_JAEGER_URL=jaeger + "/"))
        trace_id = record["trace_id"]
        assert len(trace_id) == 32 and record["run_id"] == run_id
        # The ledger's trace id is the trace of the run's own span, as exported.
        run_spans: list[Any] = []
        for _ in range(100):  # bounded: the spans are exported after the run ends
            run_spans = [
                s
                for s in exporter.get_finished_spans()
                if s.name == "run" and (s.attributes or {}).get("quayutec.run_id") == run_id
            ]
            if run_spans:
                break
            await asyncio.sleep(0.1)
        assert [format(s.context.trace_id, "032x") for s in run_spans] == [trace_id]
        assert record["traces"] == [{"trace_id": trace_id, "link": f"{jaeger}/trace/{trace_id}"}]

        shown = await ok("run", run_id, QUAYUTEC_CONSOLE_JAEGER_URL=jaeger)
        assert f"  trace {trace_id}  {jaeger}/trace/{trace_id}\n" in shown, shown
        # Without the setting: the id alone, and null for the link.
        plain = await ok("run", run_id)
        assert f"  trace {trace_id}\n" in plain and "/trace/" not in plain
        bare = json.loads(await ok("run", run_id, "--json"))
        assert bare["traces"] == [{"trace_id": trace_id, "link": None}]

        for wrong in ("jaeger.ops.example:16686", "file:///etc/passwd", "http://"):
            refused = await quayutec(
                "run",
                run_id,
                env={**env, "QUAYUTEC_CONSOLE_JAEGER_URL": wrong, "QUAYUTEC_GATEWAY_ADDR": "127.0.0.1:9"},
            )
            assert refused.returncode == 1 and refused.stdout == "", (refused.stdout, refused.stderr)
            assert "error: QUAYUTEC_CONSOLE_JAEGER_URL must be the Jaeger UI's http(s) address" in refused.stderr
            assert repr(wrong) in refused.stderr


def test_a_continued_run_shows_each_of_its_traces() -> None:
    first, continued = "a" * 32, "b" * 32
    run = common_pb2.Run(run_id="r", trace_id=first, trace_ids=[first, continued])
    lines = format_run(run, "http://127.0.0.1:16686").splitlines()
    assert lines[2:4] == [
        f"  trace {first}  http://127.0.0.1:16686/trace/{first}",
        f"  trace of continuation 1 {continued}  http://127.0.0.1:16686/trace/{continued}",
    ]
    assert format_run(common_pb2.Run()).splitlines()[2] == "  trace (not traced)"


@dataclass(frozen=True)
class CompaniesCli:
    """The `quayutec` command against a real Room and Gateway (wakes not delivered): as the admin,
    or as a company by its API key."""

    env: dict[str, str]

    async def run(self, key: str, *args: str) -> subprocess.CompletedProcess[str]:
        return await quayutec(*args, env={**self.env, "QUAYUTEC_API_KEY": key})

    async def ok(self, key: str, *args: str) -> str:
        done = await self.run(key, *args)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done.stdout

    async def company(self, name: str) -> tuple[str, str]:
        """A company made as the admin, and an API key of it."""
        company_id = (await self.ok("", "company", "create", name)).split()[1]
        return company_id, (await self.ok("", "keys", "create", "--company", company_id)).splitlines()[1]


@asynccontextmanager
async def companies_cli(database_url: str, **env: str) -> AsyncIterator[CompaniesCli]:
    async with room_and_gateway(database_url) as base:
        yield CompaniesCli({**base, **env})


async def test_rights_set_changes_only_what_it_names_and_show_says_where_each_comes_from(database_url: str) -> None:
    """Issue 21, #5: `rights set --remember hold`, then `rights set --create-task hold`, leaves both held."""
    async with room_and_gateway(database_url) as env:
        ok = succeeding(env)

        company_id = (await ok("company", "create", "Acme")).split()[1]
        env["QUAYUTEC_API_KEY"] = (await ok("keys", "create", "--company", company_id)).splitlines()[1]
        agent_id = (
            await ok(
                "agent", "register", "--name", "planner", "--provider", "anthropic", "--model", "m",
                QUAYUTEC_PROVIDER_KEY="sk-ant-cli",
            )
        ).split()[1]  # fmt: skip
        await ok("rights", "set", "--remember", "hold")
        await ok("rights", "set", "--create-task", "hold")
        assert (await ok("rights", "show")).splitlines() == [
            "remember=hold (set here)",
            "create_task=hold (set here)",
            "update_task=auto (built-in default)",
            "close_task=auto (built-in default)",
            "cross_company_task=auto (built-in default)",
        ]
        await ok("rights", "set", "--agent", agent_id, "--close-task", "deny", "--remember", "auto")
        await ok("rights", "set", "--agent", agent_id, "--remember", "inherit")
        assert (await ok("rights", "show", "--agent", agent_id)).splitlines() == [
            "remember=hold (inherited from the company default)",
            "create_task=hold (inherited from the company default)",
            "update_task=auto (built-in default)",
            "close_task=deny (set here)",
            "cross_company_task=auto (built-in default)",
        ]
        nothing = await quayutec("rights", "set", env=env)
        assert nothing.returncode != 0 and "name at least one right" in nothing.stderr


async def test_invitations_leave_and_remove_from_the_command_line(database_url: str) -> None:
    """Membership by consent as two companies run it: invite, list, accept or decline, leave, remove."""
    async with companies_cli(database_url) as cli:
        run, ok, company = cli.run, cli.ok, cli.company

        (acme_id, acme), (globex_id, globex) = await company("Acme"), await company("Globex")
        room_id = (await ok(acme, "room", "create", "launch")).split()[1]
        invited = await ok(acme, "room", "invite", room_id, globex_id)
        assert "becomes a member when it accepts" in invited
        invitation_id = invited.split()[1].rstrip(":")
        listed = await ok(globex, "invitations")
        assert invitation_id in listed and " launch " in listed and f"Acme ({acme_id})" in listed
        assert (await ok(acme, "invitations")) == "(no pending invitations)\n"
        [as_json] = json.loads(await ok(globex, "invitations", "--json"))
        assert as_json["invitation_id"] == invitation_id and as_json["room"] == "launch"
        # Not a member before it accepts.
        outside = await run(globex, "messages", "--room", room_id)
        assert outside.returncode == 2 and "NOT_FOUND" in outside.stderr
        assert "is a member of room" in await ok(globex, "invitation", "accept", invitation_id)
        await ok(globex, "post", "--room", room_id, "--person", "bo", "hello from Globex")
        assert "hello from Globex" in await ok(acme, "messages", "--room", room_id)
        assert invitation_id in await ok(globex, "invitations", "--status", "accepted")

        # Only the creator removes; a removed company sees nothing at once.
        refused = await run(globex, "room", "remove-member", room_id, acme_id)
        assert refused.returncode == 2 and "PERMISSION_DENIED" in refused.stderr
        assert "removed" in await ok(acme, "room", "remove-member", room_id, globex_id)
        gone = await run(globex, "messages", "--room", room_id)
        assert gone.returncode == 2 and "NOT_FOUND" in gone.stderr

        # Invited again: declined this time, then invited and accepted, then it leaves.
        second = (await ok(acme, "room", "invite", room_id, globex_id)).split()[1].rstrip(":")
        assert "declined" in await ok(globex, "invitation", "decline", second)
        assert second in await ok(globex, "invitations", "--status", "declined")
        # The creator lists the room's pending invitations and withdraws one; it cannot be accepted then.
        withdrawn = (await ok(acme, "room", "invite", room_id, globex_id)).split()[1].rstrip(":")
        assert withdrawn in await ok(acme, "invitations", "--room", room_id)
        assert "withdrawn" in await ok(acme, "invitation", "withdraw", withdrawn)
        assert withdrawn in await ok(acme, "invitations", "--room", room_id, "--status", "withdrawn")
        late = await run(globex, "invitation", "accept", withdrawn)
        assert late.returncode == 2 and "FAILED_PRECONDITION" in late.stderr
        third = (await ok(acme, "room", "invite", room_id, globex_id)).split()[1].rstrip(":")
        await ok(globex, "invitation", "accept", third)
        assert "left room" in await ok(globex, "room", "leave", room_id)
        creator = await run(acme, "room", "leave", room_id)
        assert creator.returncode == 2 and "FAILED_PRECONDITION" in creator.stderr and "creator" in creator.stderr
        left = await run(globex, "messages", "--room", room_id)
        assert left.returncode == 2 and "NOT_FOUND" in left.stderr


async def test_admin_commands_refuse_a_company_that_does_not_exist(database_url: str) -> None:
    env = {"DATABASE_URL": database_url}
    unknown = "00000000-0000-0000-0000-000000000000"
    made = await quayutec("keys", "create", "--company", unknown, env=env)
    assert made.returncode == 1 and f"no company {unknown}" in made.stderr and made.stdout == ""
    listed = await quayutec("keys", "list", "--company", unknown, env=env)
    assert listed.returncode == 1 and f"no company {unknown}" in listed.stderr
    unnamed = await quayutec("keys", "create", "--company", "acme", env=env)
    assert unnamed.returncode == 1 and "no company named 'acme' in this database" in unnamed.stderr


async def test_admin_commands_do_not_start_a_database_in_a_wrong_folder(tmp_path: Path) -> None:
    env = {"DATABASE_URL": "", "QUAYUTEC_DATA_DIR": str(tmp_path / "wrong")}
    made = await quayutec("keys", "create", "--company", "00000000-0000-0000-0000-000000000000", env=env)
    assert made.returncode == 1 and "no PostgreSQL is running in" in made.stderr
    assert not (tmp_path / "wrong" / "pgdata").exists()


def _all_parsers(p: argparse.ArgumentParser, path: str = "quayutec") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, p)]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _all_parsers(child, f"{path} {name}")
    return found


def test_every_command_and_option_has_help() -> None:
    from services.cli import parser

    missing = []
    for path, p in _all_parsers(parser()):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{path} {c.dest}" for c in action._choices_actions if not c.help]
            elif not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []


async def test_each_service_prints_help_and_does_not_start() -> None:
    for name in ("gateway", "room", "claims", "runtime"):
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", f"services.{name}", "--help"],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: python -m services.{name}"), done.stdout
        assert f"QUAYUTEC_{name.upper()}_LISTEN" in done.stdout and "listening" not in done.stderr


async def test_agents_rooms_and_companies_are_listed_and_agents_mentioned_by_name(database_url: str) -> None:
    """`company list` (admin), `room list` and `agent list [--room]` as a company, and `post --mention`
    taking an agent's name in the room as well as its id; an unknown or ambiguous name posts nothing
    and lists the choices."""
    import asyncpg

    async with companies_cli(database_url, QUAYUTEC_PROVIDER_KEY="sk-cli-secret") as cli:
        run, ok, company = cli.run, cli.ok, cli.company

        assert "no companies yet" in await ok("", "company", "list")
        (acme_id, acme), (globex_id, globex) = await company("Acme"), await company("Globex")
        listed = json.loads(await ok("", "company", "list", "--json"))
        assert [(c["company_id"], c["name"]) for c in listed] == [(acme_id, "Acme"), (globex_id, "Globex")]
        assert (await ok("", "company", "list")).splitlines()[0].split() == ["COMPANY_ID", "NAME", "CREATED_AT"]

        assert "no rooms" in await ok(acme, "room", "list")
        room_id = (await ok(acme, "room", "create", "launch")).split()[1]
        invitation_id = (await ok(acme, "room", "invite", room_id, globex_id)).split()[1].rstrip(":")
        await ok(globex, "invitation", "accept", invitation_id)
        [room] = json.loads(await ok(globex, "room", "list", "--json"))
        # The creator by name, as another member sees it; its id beside it in --json.
        assert (room["room_id"], room["name"], room["created_by"]) == (room_id, "launch", "Acme")
        assert room["created_by_company_id"] == acme_id
        assert (await ok(globex, "room", "list")).splitlines()[1].split()[:3] == [room_id, "launch", "Acme"]

        async def register(key: str, name: str) -> str:
            made = await ok(key, "agent", "register", "--name", name, "--provider", "openai", "--model", "m")
            return made.split()[1]

        planner, acme_writer, globex_writer = (
            await register(acme, "planner"),
            await register(acme, "writer"),
            await register(globex, "writer"),
        )
        own = json.loads(await ok(acme, "agent", "list", "--json"))
        assert [(a["agent_id"], a["name"], a["model"]) for a in own] == [
            (planner, "planner", "m"),
            (acme_writer, "writer", "m"),
        ]
        in_room = json.loads(await ok(globex, "agent", "list", "--room", room_id, "--json"))
        assert [(a["agent_id"], a["company"], a["company_id"], a["model"]) for a in in_room] == [
            (planner, "Acme", acme_id, ""),
            (acme_writer, "Acme", acme_id, ""),
            (globex_writer, "Globex (yours)", globex_id, "m"),
        ]

        pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
        try:

            async def woken(posted: str) -> list[str]:
                wake_ids = re.findall(r"[0-9a-f]{8}-[0-9a-f-]{27}", posted.partition("wakes ")[2])
                rows = await pool.fetch(
                    "SELECT agent_id FROM wake_outbox WHERE wake_id = ANY($1::uuid[]) ORDER BY agent_id", wake_ids
                )
                return sorted(str(r["agent_id"]) for r in rows)

            async def messages() -> int:
                return int(await pool.fetchval("SELECT count(*) FROM messages WHERE room_id = $1", uuid.UUID(room_id)))

            by_name = await ok(globex, "post", "--room", room_id, "--person", "gus", "--mention", "Planner", "hi")
            assert await woken(by_name) == [planner]
            mixed = await ok(
                acme, "post", "--room", room_id, "--person", "ana",
                "--mention", globex_writer, "--mention", "planner", "go",
            )  # fmt: skip
            assert await woken(mixed) == sorted([globex_writer, planner])
            before = await messages()
            ambiguous = await run(acme, "post", "--room", room_id, "--person", "ana", "--mention", "writer", "x")
            assert ambiguous.returncode == 1 and "Traceback" not in ambiguous.stderr
            assert "2 agents in room" in ambiguous.stderr and "mention one by its id" in ambiguous.stderr
            assert acme_writer in ambiguous.stderr and globex_writer in ambiguous.stderr
            unknown = await run(acme, "post", "--room", room_id, "--person", "ana", "--mention", "nobody", "x")
            assert unknown.returncode == 1 and "no agent named 'nobody'" in unknown.stderr
            assert all(a in unknown.stderr for a in (planner, acme_writer, globex_writer)), unknown.stderr
            assert await messages() == before  # neither posted anything
        finally:
            await pool.close()


def test_output_to_a_closed_pipe_ends_quietly() -> None:
    """`quayutec config | head`: the reader is gone before the command finishes writing. No
    BrokenPipeError traceback, from a handler or from the flush at exit."""
    for args in (["config"], ["config", "--json"], ["config", "--service", "room"]):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader has gone: every write fails with EPIPE
        try:
            done = subprocess.run(
                [sys.executable, "-m", "services.cli", *args],
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
            )
        finally:
            os.close(write_end)
        assert done.stderr == "", (args, done.stderr)
        assert done.returncode == 141, args  # as a shell reports a command ended by SIGPIPE


async def test_ctrl_c_at_the_demos_prompt_stops_everything_at_once(empty_database_url: str, tmp_path: Path) -> None:
    """In a terminal the demo waits for Enter with the stack up; Ctrl-C there stops the services and
    exits without waiting for Enter."""
    import psutil

    main, terminal = pty.openpty()
    demo = subprocess.Popen(  # noqa: ASYNC220 - started once; its output is read in a thread
        [sys.executable, "-m", "services.cli", "demo"],
        cwd=REPO,
        env={
            # Not CI=true (.ci/run sets it): with it the demo stops at once instead of waiting.
            **{name: value for name, value in os.environ.items() if name != "CI"},
            "PYTHONPATH": str(REPO),
            "DATABASE_URL": empty_database_url,
            "QUAYUTEC_DATA_DIR": str(tmp_path),
        },
        stdin=terminal,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    os.close(terminal)
    assert demo.stdout is not None
    try:
        lines: list[str] = []
        prompt = await asyncio.to_thread(_read_until, demo.stdout, lines, "press Enter or Ctrl-C to stop it")
        assert prompt, "".join(lines[-40:])
        services = [c for c in psutil.Process(demo.pid).children() if "services." in " ".join(c.cmdline())]
        assert len(services) == 5  # the four services and the console
        demo.send_signal(signal.SIGINT)
        rest = await asyncio.to_thread(demo.communicate, timeout=60)  # a failsafe bound, not a timing
        assert demo.returncode == 0, rest[0]
        assert "stopping ..." in rest[0] and "demo finished" in rest[0]
        _, alive = psutil.wait_procs(services, timeout=30)
        assert alive == []
    finally:
        os.close(main)
        if demo.poll() is None:
            demo.kill()
            demo.wait()


async def test_the_demo_leaves_the_stack_up_without_a_terminal(empty_database_url: str, tmp_path: Path) -> None:
    """Issue 49: with no terminal and no CI=true, the demo ends with its stack still up, says how to
    open the console and how to stop, and the console answers; SIGTERM then stops everything."""
    import httpx
    import psutil

    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "DATABASE_URL": empty_database_url,
        "QUAYUTEC_DATA_DIR": str(tmp_path),
    }
    env.pop("CI", None)
    demo = subprocess.Popen(  # noqa: ASYNC220 - started once; its output is read in a thread
        [sys.executable, "-m", "services.cli", "demo"],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert demo.stdout is not None
    try:
        lines: list[str] = []
        assert await asyncio.to_thread(_read_until, demo.stdout, lines, "stops it"), "".join(lines[-40:])
        said = "".join(lines)
        [url] = re.findall(r"the stack stays up: open the console at (\S+) and sign in with a key above;", said)
        assert f"Ctrl-C (or `kill {demo.pid}`) stops it" in said
        async with httpx.AsyncClient() as http:
            page = await http.get(url, timeout=30)
        assert page.status_code < 500, page.text[:500]
        services = [c for c in psutil.Process(demo.pid).children() if "services." in " ".join(c.cmdline())]
        assert len(services) == 5 and demo.poll() is None  # still up after the demo's last line
        demo.send_signal(signal.SIGTERM)
        rest = await asyncio.to_thread(demo.communicate, timeout=60)  # a failsafe bound, not a timing
        assert demo.returncode == 0, rest[0]
        assert "stopping ..." in rest[0] and "demo finished" in rest[0]
        _, alive = psutil.wait_procs(services, timeout=30)
        assert alive == []
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def _read_until(stream: Any, lines: list[str], marker: str) -> bool:
    for line in stream:
        lines.append(line)
        if marker in line:
            return True
    return False


def test_a_refused_action_reads_with_its_rule() -> None:
    """`quayutec run <id>` shows a refused action's outcome, the rule's words and the rule's id."""
    from quayutec.v1 import common_pb2
    from services.client import format_run

    run = common_pb2.Run(run_id="r", status=common_pb2.RUN_STATUS_SUCCEEDED, step=common_pb2.RUN_STEP_ENDED)
    run.actions.add(
        index=0,
        kind=common_pb2.ACTION_KIND_CLOSE_TASK,
        outcome=common_pb2.ACTION_OUTCOME_REFUSED,
        rule="task-sender-or-assignee",
        detail="only the company that sent task t or the company of its assignee may update or close it",
    )
    assert (
        "  action #0 close_task: refused (only the company that sent task t or the company of its assignee may "
        "update or close it) [rule task-sender-or-assignee]"
    ) in format_run(run).splitlines()


async def _watch_lines(env: dict[str, str], key: str, *args: str, until: str) -> list[str]:
    """`quayutec watch ...` run as the company of ``key`` until a line holding ``until`` is printed."""
    watch = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "watch", *args,
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env, "QUAYUTEC_API_KEY": key},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert watch.stdout is not None
    lines: list[str] = []
    try:
        while not any(until in line for line in lines):
            line = (await asyncio.wait_for(watch.stdout.readline(), 60)).decode()
            assert line, (lines, (await watch.stderr.read()).decode() if watch.stderr else "")
            lines.append(line.rstrip("\n"))
    finally:
        watch.terminate()
        await watch.wait()
    return lines


async def test_watch_names_things_and_rooms_and_companies_are_given_by_name(database_url: str) -> None:
    """Issue 35: `watch` prints rooms, companies and agents by name (ids with --json); `room invite`,
    `leave`, `remove-member` and `invitations --room` take names; their answers and errors name things."""
    async with companies_cli(database_url, QUAYUTEC_PROVIDER_KEY="sk-cli-secret") as cli:
        run, ok, company = cli.run, cli.ok, cli.company

        (acme_id, acme), (globex_id, globex) = await company("Acme"), await company("Globex")
        room_id = (await ok(acme, "room", "create", "launch")).split()[1]
        stranger = await run(acme, "room", "invite", "launch", "Globex")  # shares nothing with Acme yet
        assert stranger.returncode == 1 and "no company named 'Globex' is known to your company" in stranger.stderr
        invited = await ok(acme, "room", "invite", "Launch", globex_id)
        assert "Globex is invited to room 'launch'" in invited and globex_id not in invited
        assert "is a member of room 'launch'" in await ok(globex, "invitation", "accept", invited.split()[1][:-1])
        await ok(acme, "room", "create", "ops")
        by_name = await ok(acme, "room", "invite", "ops", "globex")  # known now: a member of launch
        assert "Globex is invited to room 'ops'" in by_name
        assert by_name.split()[1][:-1] in await ok(acme, "invitations", "--room", "ops")
        planner = await ok(acme, "agent", "register", "--name", "planner", "--provider", "openai", "--model", "m")
        planner_id = planner.split()[1]
        await ok(globex, "post", "--room", "launch", "--person", "gus", "--mention", "planner", "hello")
        unknown = await run(globex, "post", "--room", "launch", "--person", "gus", "--mention", "nobody", "x")
        assert "no agent named 'nobody' in room 'launch'" in unknown.stderr and "Acme's agent" in unknown.stderr
        assert room_id not in unknown.stderr and acme_id not in unknown.stderr

        watched = await _watch_lines(cli.env, globex, "--room", "launch", "--after", "0", until="hello")
        text = "\n".join(watched)
        assert any(line.endswith("member_joined Globex") for line in watched), text
        assert any(line.endswith("message_posted #1 gus (Globex): hello") for line in watched), text
        assert not any(i in text for i in (acme_id, globex_id, room_id, planner_id)), text
        as_json = await _watch_lines(cli.env, globex, "--room", room_id, "--after", "0", "--json", until="hello")
        [message] = [json.loads(line)["message"] for line in as_json if '"message"' in line]
        assert message["author"]["company_id"] == globex_id and message["body"] == "hello"
        assert json.loads(as_json[0])["room_id"] == room_id

        # Every room of the company, each line under its room's name. It starts from now: post until seen.
        async def post_until_seen() -> None:
            for _ in range(30):  # bounded
                await ok(acme, "post", "--room", "launch", "--person", "ana", "again")
                await asyncio.sleep(1)

        posting = asyncio.create_task(post_until_seen())
        try:
            every = await _watch_lines(cli.env, acme, "--all", until="again")
        finally:
            posting.cancel()
        assert re.fullmatch(r"launch: \[\d+\] message_posted #\d+ ana \(Acme\): again", every[-1]), every

        missing = await run(acme, "room", "remove-member", "launch", "Initech")
        assert missing.returncode == 1 and "no company named 'Initech' is a member of that room" in missing.stderr
        removed = await ok(acme, "room", "remove-member", "launch", "GLOBEX")
        assert removed == "Globex removed from room 'launch'\n"
        ops_invitation = await ok(globex, "invitations", "--json")
        [pending] = json.loads(ops_invitation)
        await ok(globex, "invitation", "accept", pending["invitation_id"])
        assert "your company left room 'ops'" in await ok(globex, "room", "leave", "ops")


async def test_names_stay_unique_and_agents_and_rooms_are_renamed_retired_and_archived(database_url: str) -> None:
    """Issue 49: the README's blocks run twice create nothing twice; rename, retire and archive by name."""
    async with companies_cli(database_url) as cli:
        run, ok, company = cli.run, cli.ok, cli.company
        (_, acme), (globex_id, globex) = await company("Acme"), await company("Globex")
        register = ("agent", "register", "--provider", "anthropic", "--model", "m")
        env = {**cli.env, "QUAYUTEC_API_KEY": acme, "QUAYUTEC_PROVIDER_KEY": "sk-ant-cli"}
        agent_id = (await quayutec(*register, "--name", "planner", env=env)).stdout.split()[1]
        room_id = (await ok(acme, "room", "create", "launch")).split()[1]

        # A second create of either name is refused, naming the first; names still resolve.
        twice = await quayutec(*register, "--name", "Planner", env=env)
        assert twice.returncode == 2 and "ALREADY_EXISTS" in twice.stderr and agent_id in twice.stderr
        again = await run(acme, "room", "create", "launch")
        assert again.returncode == 2 and "ALREADY_EXISTS" in again.stderr and room_id in again.stderr
        assert "wakes" in await ok(acme, "post", "--room", "launch", "--person", "ana", "--mention", "planner", "hi")

        # Renames, by name; the new names resolve and the old ones are free.
        assert "'liftoff'" in await ok(acme, "room", "rename", "launch", "liftoff")
        assert "'lead'" in await ok(acme, "agent", "rename", "planner", "lead")
        await ok(acme, "post", "--room", "liftoff", "--person", "ana", "--mention", "lead", "again")
        assert (await quayutec(*register, "--name", "planner", env=env)).returncode == 0
        taken = await run(acme, "agent", "rename", "lead", "PLANNER")
        assert taken.returncode == 2 and "ALREADY_EXISTS" in taken.stderr

        # Retired: a mention makes no wake.
        assert "retired" in await ok(acme, "agent", "retire", "lead")
        assert "; woke 0 agents\n" in await ok(
            acme, "post", "--room", "liftoff", "--person", "ana", "--mention", "lead", "x"
        )

        # Archived by its creator only; writes refused after, reads still work.
        await ok(acme, "room", "invite", "liftoff", globex_id)
        invitation_id = json.loads(await ok(globex, "invitations", "--json"))[0]["invitation_id"]
        await ok(globex, "invitation", "accept", invitation_id)
        not_creator = await run(globex, "room", "archive", "liftoff")
        assert not_creator.returncode == 2 and "PERMISSION_DENIED" in not_creator.stderr
        assert "archived" in await ok(acme, "room", "archive", "liftoff")
        refused = await run(acme, "post", "--room", "liftoff", "--person", "ana", "late")
        assert refused.returncode == 2 and "FAILED_PRECONDITION" in refused.stderr and "archived" in refused.stderr
        assert "again" in await ok(globex, "messages", "--room", room_id)


async def test_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    done = await quayutec("--version", env={})
    assert done.returncode == 0 and done.stdout == f"quayutec {version('quayutec-rooms')}\n", done
