"""The stack the client SDKs are tested against: a real Room, Claims, Runtime and model stand-in in
this process, and a real Gateway as a child process on a fixed loopback port, so a test can kill it
with SIGKILL and start it again on the same port. The Gateway reaches the Room through a proxy that
can hold the Room's replies back, to kill the Gateway after the Room has acted on a call but before
its caller heard the answer.

Run as ``python -m tests.harness.sdk_stack`` it serves the same stack to another process (the
TypeScript SDK's tests) over a small HTTP control API on loopback, and prints its address.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from quayutec.db import create_pool
from quayutec.telemetry import configure_for_tests
from services.runtime.standin import StandinProvider
from services.stack import free_port, wait_serving
from tests.harness.channels import mtls_env
from tests.harness.claims import running_claims
from tests.harness.gateway import CompanyKey, make_company, running_gateway, self_signed_tls
from tests.harness.proxy import HoldingProxy
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime

REPO = Path(__file__).resolve().parent.parent.parent
GATEWAY_SERVICE = "quayutec.v1.GatewayService"
# The Gateway of the SDK tests: wakes delivered at once, no posting rate limit, heartbeats every
# second, and a small per-stream buffer so a watcher that stops reading is cut soon.
GATEWAY_ENV = {
    "QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.05",
    "QUAYUTEC_GATEWAY_POST_RATE": "0",
    "QUAYUTEC_GATEWAY_WATCH_HEARTBEAT_SECONDS": "1",
    "QUAYUTEC_GATEWAY_WATCH_BUFFER_EVENTS": "4",
    "QUAYUTEC_GATEWAY_GRACE_SECONDS": "0",
    "QUAYUTEC_GATEWAY_RECONNECT_BACKOFF_MAX_MS": "300",
}


# A Gateway whose stream limits are met at once: one open stream per company, one failed
# authentication (then one every 100 s).
STRICT_GATEWAY_ENV = {
    "QUAYUTEC_GATEWAY_MAX_STREAMS_PER_COMPANY": "1",
    "QUAYUTEC_GATEWAY_AUTH_FAILURE_BURST": "1",
    "QUAYUTEC_GATEWAY_AUTH_FAILURE_RATE": "0.01",
}


class GatewayProcess:
    """``python -m services.gateway`` on one port, started again on the same port after a kill."""

    def __init__(self, database_url: str, room_addr: str, runtime_addr: str, env: dict[str, str]) -> None:
        self.addr = f"127.0.0.1:{free_port()}"
        self.kills = 0
        self._env = {
            **os.environ,
            **GATEWAY_ENV,
            **env,
            "DATABASE_URL": database_url,
            "QUAYUTEC_GATEWAY_LISTEN": self.addr,
            "QUAYUTEC_ROOM_ADDR": room_addr,
            "QUAYUTEC_RUNTIME_ADDR": runtime_addr,
            **mtls_env("gateway"),
            "PYTHONPATH": str(REPO),
        }
        self._log = Path(tempfile.mkstemp(prefix="qy-sdk-gateway-", suffix=".log")[1])
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        with self._log.open("ab") as log:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.gateway", cwd=REPO, env=self._env, stdout=log, stderr=log
            )
        try:
            await wait_serving(self.addr, GATEWAY_SERVICE, limit=60, what="the SDK tests' Gateway")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; its log:\n{self.log_tail()}") from None

    async def kill(self) -> None:
        """SIGKILL: no drain, no goodbye to open calls and streams."""
        if self._proc is not None and self._proc.returncode is None:
            self._proc.send_signal(signal.SIGKILL)
            await self._proc.wait()
            self.kills += 1
        self._proc = None

    async def restart(self) -> None:
        await self.kill()
        await self.start()

    async def stop(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._proc.wait(), 15)
            except TimeoutError:
                await self.kill()
        self._proc = None
        self._log.unlink(missing_ok=True)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class SdkStack:
    database_url: str
    room_addr: str
    runtime_addr: str
    proxy: HoldingProxy
    gateway: GatewayProcess
    pool: asyncpg.Pool
    # A proxy in front of the Gateway, made on demand (the control API's /gateway-proxy).
    gateway_proxy: HoldingProxy | None = None
    _background: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def gateway_addr(self) -> str:
        return self.gateway.addr

    async def new_company(self, name: str | None = None) -> CompanyKey:
        return await make_company(self.database_url, self.room_addr, name or f"co-{uuid.uuid4().hex[:8]}")

    async def messages_in(self, room_id: str) -> list[str]:
        """The bodies of a room's messages, read from the Room's database."""
        rows = await self.pool.fetch("SELECT body FROM messages WHERE room_id = $1 ORDER BY seq", uuid.UUID(room_id))
        return [r["body"] for r in rows]

    async def kill_gateway_once_posted(self, room_id: str, body: str) -> None:
        """Hold the Room's replies; once a message with ``body`` is stored in the room (the Room acted
        and answered, the answer held), SIGKILL the Gateway, then start it again on the same port."""
        self.proxy.hold()
        try:
            async with asyncio.timeout(60):
                while body not in await self.messages_in(room_id):  # noqa: ASYNC110 - the Room writes it
                    await asyncio.sleep(0.02)
            await self.gateway.kill()
        finally:
            self.proxy.release()
        await self.gateway.start()

    def in_background(self, work: Awaitable[None]) -> asyncio.Task[None]:
        async def run() -> None:
            await work

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def expire_events(self, room_id: str, through_cursor: int) -> None:
        """Age a room's events up to ``through_cursor`` past the retention and wait until the Room's
        cleanup has removed them (a watch after an older cursor then answers OUT_OF_RANGE)."""
        room = uuid.UUID(room_id)
        await self.pool.execute(
            "UPDATE room_events SET created_at = now() - interval '2 hours' WHERE room_id = $1 AND seq <= $2",
            room,
            through_cursor,
        )
        async with asyncio.timeout(60):
            while await self.pool.fetchval(  # noqa: ASYNC110 - the cleanup runs in the Room server
                "SELECT count(*) FROM room_events WHERE room_id = $1 AND seq <= $2", room, through_cursor
            ):
                await asyncio.sleep(0.1)

    @asynccontextmanager
    async def extra_gateway(self, **env: str) -> AsyncIterator[str]:
        """Another Gateway (in this process) on the same Room, with its own settings."""
        async with running_gateway(
            self.database_url, self.room_addr, self.runtime_addr, **{**GATEWAY_ENV, **env}
        ) as addr:
            yield addr


@asynccontextmanager
async def running_sdk_stack(database_url: str, **gateway_env: str) -> AsyncIterator[SdkStack]:
    async with AsyncExitStack() as stack:
        standin = stack.enter_context(StandinProvider())
        # Room events are kept an hour and cleaned every second, so a test can age some out (OUT_OF_RANGE).
        room_addr = await stack.enter_async_context(
            running_room(database_url, QUAYUTEC_ROOM_EVENT_RETENTION_HOURS="1", QUAYUTEC_ROOM_EVENT_CLEANUP_SECONDS="1")
        )
        claims_addr = await stack.enter_async_context(running_claims(database_url))
        runtime_addr = await stack.enter_async_context(
            running_runtime(claims_addr, room_addr, standin_url=standin.base_url)
        )
        proxy = HoldingProxy(room_addr)
        await proxy.start()
        stack.push_async_callback(proxy.stop)
        pool = await create_pool(database_url, min_size=1, max_size=2)
        stack.push_async_callback(pool.close)
        gateway = GatewayProcess(database_url, proxy.addr, runtime_addr, gateway_env)
        stack.push_async_callback(gateway.stop)
        await gateway.start()
        sdk_stack = SdkStack(database_url, room_addr, runtime_addr, proxy, gateway, pool)
        try:
            yield sdk_stack
        finally:
            for task in list(sdk_stack._background):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            if sdk_stack.gateway_proxy is not None:
                await sdk_stack.gateway_proxy.stop()


# The control API for another process's tests: POST <path> with a JSON body, answered with JSON.
Handler = Callable[[SdkStack, dict[str, Any]], Awaitable[dict[str, Any]]]


async def _company(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    company = await stack.new_company(body.get("name"))
    return {"company_id": company.company_id, "name": company.name, "api_key": company.secret}


async def _restart(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    await stack.gateway.restart()
    return {"kills": stack.gateway.kills}


async def _kill_once_posted(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    stack.in_background(stack.kill_gateway_once_posted(body["room_id"], body["body"]))
    return {}


async def _background_done(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    """Wait for what /gateway/kill-once-posted started (the Gateway is up again after it)."""
    await asyncio.gather(*stack._background)
    return {"kills": stack.gateway.kills}


async def _messages(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    return {"bodies": await stack.messages_in(body["room_id"])}


async def _expire(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    await stack.expire_events(body["room_id"], int(body["through_cursor"]))
    return {}


async def _gateway_state(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    return {"addr": stack.gateway_addr, "kills": stack.gateway.kills}


async def _kill(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    await stack.gateway.kill()
    return {"kills": stack.gateway.kills}


async def _start(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    await stack.gateway.start()
    return {}


async def _hold(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    stack.proxy.hold()
    return {}


async def _release(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    stack.proxy.release()
    return {}


async def _gateway_proxy(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    """A proxy in front of the Gateway (made once), whose replies can be held and connections dropped."""
    if stack.gateway_proxy is None:
        stack.gateway_proxy = HoldingProxy(stack.gateway_addr)
        await stack.gateway_proxy.start()
    return {"addr": stack.gateway_proxy.addr}


async def _gateway_proxy_hold(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    assert stack.gateway_proxy is not None, "POST /gateway-proxy first"
    stack.gateway_proxy.hold()
    return {}


async def _gateway_proxy_drop(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    """Drop every connection through the Gateway's proxy (what it held is lost), then let replies flow."""
    assert stack.gateway_proxy is not None, "POST /gateway-proxy first"
    await stack.gateway_proxy.drop_connections()
    stack.gateway_proxy.release()
    return {}


async def _events(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
    from tests.gateway.test_watch import log_of

    log = await log_of(stack.room_addr, body["room_id"], body["company_id"], 0)
    return {"events": [{"cursor": e.cursor, "kind": int(e.kind)} for e in log]}


CONTROL: dict[str, Handler] = {
    "/company": _company,
    "/gateway": _gateway_state,
    "/gateway/kill": _kill,
    "/gateway/start": _start,
    "/gateway/restart": _restart,
    "/gateway/kill-once-posted": _kill_once_posted,
    "/gateway/kill-once-posted/done": _background_done,
    "/gateway-proxy": _gateway_proxy,
    "/gateway-proxy/hold": _gateway_proxy_hold,
    "/gateway-proxy/drop": _gateway_proxy_drop,
    "/room/hold-replies": _hold,
    "/room/release-replies": _release,
    "/messages": _messages,
    "/events": _events,
    "/events/expire": _expire,
}


async def serve_control(
    stack: SdkStack, extra: dict[str, Any], more: dict[str, Handler] | None = None
) -> tuple[asyncio.Server, str]:
    """A minimal HTTP/1.1 server on 127.0.0.1 answering the CONTROL paths and ``more`` (one request
    per connection); /extra answers ``extra``."""
    handlers = {**CONTROL, **(more or {})}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        status, answer = 200, {}
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            _method, path, _ = head[0].split(" ", 2)
            length = next((int(h.split(":", 1)[1]) for h in head[1:] if h.lower().startswith("content-length:")), 0)
            body = json.loads(await reader.readexactly(length) or b"{}") if length else {}
            if path == "/extra":
                answer = extra
            elif path in handlers:
                answer = await handlers[path](stack, body)
            else:
                status, answer = 404, {"error": f"no {path}; paths: {sorted(handlers)}"}
        except Exception as exc:
            status, answer = 500, {"error": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(answer).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n".encode()
            + data
        )
        with contextlib.suppress(OSError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@asynccontextmanager
async def controlled_stack(database_url: str) -> AsyncIterator[tuple[SdkStack, str]]:
    """The stack with its control API, and four more Gateways (in this process, on the same Room),
    named in the control API's /extra answer: ``other_gateway`` (stays up while the main one is
    killed; its spans are kept for /spans), ``limited_gateway`` (a posting rate of one a second, to
    meet RateLimited), ``strict_gateway`` (STRICT_GATEWAY_ENV: one open stream per company, one failed
    authentication) and ``tls_gateway`` (TLS with the self-signed ``tls_ca_pem``)."""
    exporter = InMemorySpanExporter()
    capture = configure_for_tests(exporter)
    with tempfile.TemporaryDirectory() as tls_dir:
        cert, key, pem = self_signed_tls(Path(tls_dir))
        async with (
            running_sdk_stack(database_url) as stack,
            stack.extra_gateway() as other,
            stack.extra_gateway(QUAYUTEC_GATEWAY_POST_RATE="1", QUAYUTEC_GATEWAY_POST_BURST="1") as limited,
            stack.extra_gateway(QUAYUTEC_GATEWAY_TLS_CERT=str(cert), QUAYUTEC_GATEWAY_TLS_KEY=str(key)) as tls,
            stack.extra_gateway(**STRICT_GATEWAY_ENV) as strict,
        ):
            extra = {
                "gateway": stack.gateway_addr,
                "other_gateway": other,
                "limited_gateway": limited,
                "strict_gateway": strict,
                "tls_gateway": tls,
                "tls_ca_pem": pem.decode(),
            }

            async def spans(stack: SdkStack, body: dict[str, Any]) -> dict[str, Any]:
                """The server spans of one RPC on the in-process Gateways: trace and parent span ids, and links."""
                await asyncio.to_thread(capture.force_flush)
                return {
                    "spans": [
                        {
                            "trace_id": f"{s.context.trace_id:032x}",
                            "parent_span_id": f"{s.parent.span_id:016x}" if s.parent else None,
                            "links": [
                                {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
                                for link in s.links
                            ],
                        }
                        for s in exporter.get_finished_spans()
                        if s.name == f"{GATEWAY_SERVICE}/{body['rpc']}" and s.kind == trace.SpanKind.SERVER
                    ]
                }

            server, url = await serve_control(stack, extra, {"/spans": spans})
            try:
                yield stack, url
            finally:
                server.close()
                await server.wait_closed()
                capture.close()


async def _main() -> None:
    """Serve the stack on a fresh database of the checkout's test PostgreSQL until stdin closes."""
    from quayutec.db import embedded_ctl, embedded_database_url, embedded_pgdata, embedded_pid
    from tests.conftest import (
        TEMPLATE_DB,
        _drop_template,
        _make_template,
        checkout_data_dir,
        create_test_database,
        drop_test_database,
    )

    argparse.ArgumentParser(description=__doc__).parse_args()
    admin_url = os.environ.get("DATABASE_URL", "").strip()
    started: Path | None = None
    if not admin_url:
        pgdata = embedded_pgdata(checkout_data_dir())
        started = pgdata if embedded_pid(pgdata) is None else None
        admin_url = embedded_database_url(checkout_data_dir())
    try:
        await _make_template(admin_url)
        url = await create_test_database(admin_url, template=TEMPLATE_DB)
        try:
            async with controlled_stack(url) as (_, control):
                print(json.dumps({"control": control}), flush=True)
                await asyncio.to_thread(sys.stdin.read)
        finally:
            await drop_test_database(admin_url, url)
            await _drop_template(admin_url)
    finally:
        if started is not None:  # this process started it, so it stops it
            embedded_ctl("stop", started)


if __name__ == "__main__":
    asyncio.run(_main())
