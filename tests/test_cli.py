"""The `quayutec` command: the demo end to end, and the key admin commands, as a user runs them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from quayutec.v1 import room_pb2, room_pb2_grpc
from services.gateway.auth import KEY_PREFIX
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


async def test_the_demo_runs_to_the_end(empty_database_url: str, tmp_path: Path) -> None:
    done = await quayutec("demo", env={"DATABASE_URL": empty_database_url, "QUAYUTEC_DATA_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "answers: ['START_RUN_RESULT_ALREADY_CLAIMED']" in out
    assert "the killed run stays running at its last step; nothing posted, not redone" in out
    assert "task 'Write launch copy': TASK_STATUS_DONE" in out
    assert "memory Acme can read: ['Launch is on Friday']" in out
    assert "planner replies: 2 for 3 wakes" in out
    assert "sk-ant-demo" not in out and "sk-openai-demo" not in out


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
    assert (tmp_path / "pki" / "admin.key").exists()


async def test_client_commands_need_an_api_key(tmp_path: Path) -> None:
    done = await quayutec("runs", env={"QUAYUTEC_API_KEY": "", "QUAYUTEC_GATEWAY_ADDR": "127.0.0.1:9"})
    assert done.returncode != 0
    assert "QUAYUTEC_API_KEY" in done.stderr


async def test_a_user_runs_the_product_from_the_command_line(database_url: str) -> None:
    """The README's command-line flow against real services: company, key, room, agent, a message,
    then the agent's run in the ledger."""
    from services.runtime.standin import StandinProvider
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
            env = {
                "DATABASE_URL": database_url,
                "QUAYUTEC_ROOM_ADDR": room_addr,
                "QUAYUTEC_GATEWAY_ADDR": gateway_addr,
                **mtls_env("admin"),
            }

            async def ok(*args: str, **extra: str) -> str:
                done = await quayutec(*args, env={**env, **extra})
                assert done.returncode == 0, (args, done.stdout, done.stderr)
                return done.stdout

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
            assert "wakes ['" in posted
            for _ in range(300):  # bounded: the Gateway delivers, the Runtime runs
                runs = await ok("runs", "--agent", agent_id)
                if "status=succeeded" in runs:
                    break
                await asyncio.sleep(0.1)
            assert "status=succeeded" in runs
            run_id = runs.split()[1]
            record = await ok("run", run_id)
            assert "model request 1: 200 ok" in record and "posted: " in record
            messages = await ok("messages", "--room", room_id)
            assert "ana (" in messages and "standin reply to:" in messages
            assert "sk-ant-cli-secret" not in record + messages + runs
            rights = await ok("rights", "set", "--create-task", "hold")
            assert "create_task=hold" in rights
            assert (await ok("approvals")) == ""


async def test_invitations_leave_and_remove_from_the_command_line(database_url: str) -> None:
    """Membership by consent as two companies run it: invite, list, accept or decline, leave, remove."""
    from tests.harness.gateway import running_gateway

    async with (
        running_room(database_url) as room_addr,
        running_gateway(
            database_url, room_addr, "127.0.0.1:9", QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false"
        ) as gateway_addr,
    ):
        env = {
            "DATABASE_URL": database_url,
            "QUAYUTEC_ROOM_ADDR": room_addr,
            "QUAYUTEC_GATEWAY_ADDR": gateway_addr,
            **mtls_env("admin"),
        }

        async def run(key: str, *args: str) -> subprocess.CompletedProcess[str]:
            return await quayutec(*args, env={**env, "QUAYUTEC_API_KEY": key})

        async def ok(key: str, *args: str) -> str:
            done = await run(key, *args)
            assert done.returncode == 0, (args, done.stdout, done.stderr)
            return done.stdout

        async def company(name: str) -> tuple[str, str]:
            company_id = (await ok("", "company", "create", name)).split()[1]
            return company_id, (await ok("", "keys", "create", "--company", company_id)).splitlines()[1]

        (acme_id, acme), (globex_id, globex) = await company("Acme"), await company("Globex")
        room_id = (await ok(acme, "room", "create", "launch")).split()[1]
        invited = await ok(acme, "room", "invite", room_id, globex_id)
        assert "becomes a member when it accepts" in invited
        invitation_id = invited.split()[1].rstrip(":")
        listed = await ok(globex, "invitations")
        assert invitation_id in listed and "'launch'" in listed and "from Acme" in listed
        assert (await ok(acme, "invitations")) == ""
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
        third = (await ok(acme, "room", "invite", room_id, globex_id)).split()[1].rstrip(":")
        await ok(globex, "invitation", "accept", third)
        assert "left room" in await ok(globex, "room", "leave", room_id)
        creator = await run(acme, "room", "leave", room_id)
        assert creator.returncode == 2 and "FAILED_PRECONDITION" in creator.stderr and "creator" in creator.stderr
        left = await run(globex, "messages", "--room", room_id)
        assert left.returncode == 2 and "NOT_FOUND" in left.stderr
