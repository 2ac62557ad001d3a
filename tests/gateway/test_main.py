"""``python -m services.gateway`` serves health, then stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.stack import free_port
from tests.harness.channels import mtls_env

REPO = Path(__file__).resolve().parent.parent.parent


async def test_module_serves_until_sigterm(database_url: str) -> None:
    addr = f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "QUAYUTEC_GATEWAY_LISTEN": addr,
        "QUAYUTEC_ROOM_ADDR": "127.0.0.1:9",
        "QUAYUTEC_RUNTIME_ADDR": "127.0.0.1:9",
        "QUAYUTEC_GATEWAY_GRACE_SECONDS": "1",
        **mtls_env("gateway"),
        "PYTHONPATH": str(REPO),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.gateway", cwd=REPO, env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with grpc.aio.insecure_channel(addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            response = await health.Check(
                health_pb2.HealthCheckRequest(service="quayutec.v1.GatewayService"), timeout=30, wait_for_ready=True
            )
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, stderr.decode()
        assert "stopping quayutec.v1.GatewayService" in stderr.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
