"""Issue 49: two servers cannot share one port. gRPC servers bind with SO_REUSEPORT unless told not to,
so a second server on a port in use would start without a word and the kernel would split the
connections between the two. Every server of ours binds alone and refuses a port in use at start,
naming the port and the setting; a stack started on ports of its own still never races for them."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

from quayutec.config import CLAIMS
from quayutec.server import PORT_IN_USE_EXIT, PortInUse
from services.gateway.server import create_server
from services.stack import REPO, LocalStack, port_is_free
from tests.harness.channels import mtls_env
from tests.harness.gateway import gateway_config, running_gateway_ports
from tests.harness.room import running_room


@asynccontextmanager
async def stranger() -> AsyncIterator[int]:
    """Another program's gRPC server on a port of its own, bound as gRPC binds by default (SO_REUSEPORT)."""
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(0)


def test_a_default_grpc_server_would_share_the_port_and_ours_do_not() -> None:
    """The hazard itself, so this file's tests mean something: without our option, a second gRPC
    server binds a port in use and says nothing."""

    async def both() -> tuple[int, int]:
        async with stranger() as port:
            second = grpc.aio.server()
            try:
                shared = second.add_insecure_port(f"127.0.0.1:{port}")
            finally:
                await second.stop(0)
            ours = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
            try:
                refused = ours.add_insecure_port(f"127.0.0.1:{port}")
            except RuntimeError:
                refused = 0
            finally:
                await ours.stop(0)
            return shared, refused

    shared, refused = asyncio.run(both())
    assert shared != 0 and refused == 0


@pytest.mark.parametrize(
    "setting", ["QUAYUTEC_GATEWAY_LISTEN", "QUAYUTEC_GATEWAY_CONSOLE_LISTEN", "QUAYUTEC_GATEWAY_HEALTH_LISTEN"]
)
async def test_a_gateway_on_a_port_in_use_is_refused_naming_it(database_url: str, setting: str) -> None:
    """The Gateway's public port (the A2A door is on it too), its console port and its plaintext health
    port: each refused when taken, by one of ours (a running Gateway) or by a stranger."""
    async with (
        running_room(database_url) as room_addr,
        running_gateway_ports(database_url, room_addr, "127.0.0.1:9") as (
            public,
            console,
        ),
    ):
        taken = {"QUAYUTEC_GATEWAY_LISTEN": public, "QUAYUTEC_GATEWAY_CONSOLE_LISTEN": console}
        async with stranger() as other:
            address = taken.get(setting, f"127.0.0.1:{other}")
            env = {"QUAYUTEC_GATEWAY_CONSOLE_LISTEN": "127.0.0.1:0", setting: address}
            second = await create_server(gateway_config(database_url, room_addr, "127.0.0.1:9", **env))
            try:
                with pytest.raises(PortInUse) as refused:
                    await second.start()
            finally:
                await second.stop()
    said = str(refused.value)
    assert f"cannot listen on {address}" in said and f"({setting})" in said and "in use" in said, said


def test_a_service_on_a_port_in_use_stops_at_start_and_says_which(database_url: str) -> None:
    """`python -m services.claims` told to listen on a port a stranger's gRPC server holds: it exits
    PORT_IN_USE_EXIT at once with the port and the setting, and the stranger keeps its port."""

    async def run() -> tuple[subprocess.CompletedProcess[str], int]:
        async with stranger() as port:
            done = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "services.claims"],
                cwd=REPO,
                env={
                    **os.environ,
                    "PYTHONPATH": str(REPO),
                    "DATABASE_URL": database_url,
                    "QUAYUTEC_CLAIMS_LISTEN": f"127.0.0.1:{port}",
                    **mtls_env("claims"),
                },
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert not port_is_free(port)
            return done, port

    done, port = asyncio.run(run())
    assert done.returncode == PORT_IN_USE_EXIT, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert f"cannot listen on 127.0.0.1:{port} (QUAYUTEC_CLAIMS_LISTEN)" in said and "Traceback" not in said, said


def test_the_console_on_a_port_in_use_stops_at_start_and_says_which(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "services.console"],
            cwd=REPO,
            env={
                **os.environ,
                "PYTHONPATH": str(REPO),
                "QUAYUTEC_DATA_DIR": str(tmp_path),
                "QUAYUTEC_CONSOLE_LISTEN": f"127.0.0.1:{port}",
                "QUAYUTEC_GATEWAY_ADDR": "127.0.0.1:9",
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        taken.close()
    assert done.returncode == PORT_IN_USE_EXIT, done.stdout + done.stderr
    assert f"cannot listen on 127.0.0.1:{port} (QUAYUTEC_CONSOLE_LISTEN)" in done.stdout, done.stdout + done.stderr


async def test_a_stack_whose_port_was_taken_before_its_service_bound_it_starts_it_on_another(
    database_url: str, tmp_path: Path
) -> None:
    """The one race a stack's holds leave: the moment between letting a port go and the service binding
    it. Here a stranger takes Claims' port in that moment (its hold let go by hand): Claims says so and
    exits, and the stack starts it again on a port it holds, while the stranger keeps its own."""
    stack = LocalStack.with_ports(ephemeral=True, data_dir=tmp_path / "d")
    stack.database_url = database_url
    first = stack.ports[CLAIMS.name]
    stack.reserved.pop(first).close()
    try:
        async with stranger_on(first):
            await stack.start_services([CLAIMS.name])
            assert stack.ports[CLAIMS.name] != first
            assert "cannot listen on" in (stack.log_dir / "claims.log").read_text()
            assert not port_is_free(first)  # still the stranger's
    finally:
        stack.stop_all()


@asynccontextmanager
async def stranger_on(port: int) -> AsyncIterator[None]:
    server = grpc.aio.server()
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    try:
        yield
    finally:
        await server.stop(0)
