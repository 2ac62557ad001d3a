"""The `quayutec` command: the demo end to end, and the key admin commands, as a user runs them."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc

from quayutec.v1 import room_pb2, room_pb2_grpc
from services.gateway.auth import KEY_PREFIX
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
    async with running_room(database_url) as room_addr, grpc.aio.insecure_channel(room_addr) as channel:
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


async def test_client_commands_need_an_api_key(tmp_path: Path) -> None:
    done = await quayutec("runs", env={"QUAYUTEC_API_KEY": "", "QUAYUTEC_GATEWAY_ADDR": "127.0.0.1:9"})
    assert done.returncode != 0
    assert "QUAYUTEC_API_KEY" in done.stderr
