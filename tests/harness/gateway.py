"""Start a real Gateway for tests, and make companies with API keys and authed stubs.

async with running_gateway(database_url, room_addr, runtime_addr, QUAYUTEC_GATEWAY_LEASE_SECONDS="2") as addr:
    acme = await make_company(database_url, room_addr, "Acme")
    async with authed_gateway(addr, acme.secret) as gw:
        await gw.WhoAmI(gateway_pb2.WhoAmIRequest())
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from quayutec.db import create_pool
from quayutec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, room_pb2, room_pb2_grpc
from services.gateway.auth import create_api_key
from services.gateway.config import GatewayConfig
from services.gateway.server import create_server
from tests.harness.channels import TEST_MTLS, service_channel


def gateway_config(database_url: str, room_addr: str, runtime_addr: str, **env: str) -> GatewayConfig:
    """A Gateway config on 127.0.0.1:0, read through ``from_env`` so ``env`` takes QUAYUTEC_GATEWAY_* names;
    it calls Room and Runtime with the gateway certificate of the test PKI."""
    config = GatewayConfig.from_env(
        {
            "DATABASE_URL": database_url,
            "QUAYUTEC_GATEWAY_LISTEN": "127.0.0.1:0",
            "QUAYUTEC_GATEWAY_GRACE_SECONDS": "1",
            "QUAYUTEC_ROOM_ADDR": room_addr,
            "QUAYUTEC_RUNTIME_ADDR": runtime_addr,
            "QUAYUTEC_GATEWAY_RECONNECT_BACKOFF_MAX_MS": "300",
            **env,
        }
    )
    if config.server.mtls is not None and config.server.mtls.from_files:
        return config
    return replace(config, server=replace(config.server, mtls=TEST_MTLS))


@asynccontextmanager
async def running_gateway(
    database_url: str, room_addr: str, runtime_addr: str, *, pool: asyncpg.Pool | None = None, **env: str
) -> AsyncIterator[str]:
    """Yields "127.0.0.1:PORT" of a started Gateway; stops it (and its delivery loop) on exit."""
    server = await create_server(gateway_config(database_url, room_addr, runtime_addr, **env), pool=pool)
    port = await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop()


@asynccontextmanager
async def running_gateway_ports(
    database_url: str, room_addr: str, runtime_addr: str, **env: str
) -> AsyncIterator[tuple[str, str]]:
    """A started Gateway with its console port on too: yields ("127.0.0.1:PUBLIC", "127.0.0.1:CONSOLE")."""
    config = gateway_config(database_url, room_addr, runtime_addr, QUAYUTEC_GATEWAY_CONSOLE_LISTEN="127.0.0.1:0", **env)
    server = await create_server(config)
    port = await server.start()
    try:
        yield f"127.0.0.1:{port}", f"127.0.0.1:{server.second_port}"
    finally:
        await server.stop()


@dataclass(frozen=True)
class CompanyKey:
    """A company made in the Room, with a live API key of it."""

    company_id: str
    name: str
    key_id: str
    secret: str


async def make_company(database_url: str, room_addr: str, name: str | None = None) -> CompanyKey:
    """Create a company through the Room and an API key for it through services.gateway.auth (the admin flow)."""
    name = name or f"company-{uuid.uuid4().hex[:8]}"
    async with service_channel(room_addr, "admin") as channel:
        room = room_pb2_grpc.RoomServiceStub(channel)
        response = await room.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name=name), timeout=10)
    pool = await create_pool(database_url, min_size=1, max_size=1)
    try:
        key_id, secret = await create_api_key(pool, response.company.company_id, f"test key of {name}")
    finally:
        await pool.close()
    return CompanyKey(company_id=response.company.company_id, name=name, key_id=key_id, secret=secret)


class _BearerInterceptor(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Adds ``authorization: Bearer <key>`` to every call."""

    def __init__(self, secret: str) -> None:
        self._metadata = ("authorization", f"Bearer {secret}")

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()))
        metadata.add(*self._metadata)
        details = grpc.aio.ClientCallDetails(
            method=client_call_details.method,
            timeout=client_call_details.timeout,
            metadata=metadata,
            credentials=client_call_details.credentials,
            wait_for_ready=client_call_details.wait_for_ready,
        )
        return await continuation(details, request)


@asynccontextmanager
async def authed_gateway(
    addr: str, secret: str, *, credentials: grpc.ChannelCredentials | None = None, **channel_kwargs: Any
) -> AsyncIterator[gateway_pb2_grpc.GatewayServiceStub]:
    """A GatewayService stub whose calls carry ``secret`` as a bearer key (TLS when ``credentials``)."""
    interceptors = [_BearerInterceptor(secret)]
    if credentials is not None:
        channel = grpc.aio.secure_channel(addr, credentials, interceptors=interceptors, **channel_kwargs)
    else:
        channel = grpc.aio.insecure_channel(addr, interceptors=interceptors, **channel_kwargs)
    async with channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


async def join_room(
    inviter: gateway_pb2_grpc.GatewayServiceStub, invitee: gateway_pb2_grpc.GatewayServiceStub, room_id: str
) -> common_pb2.RoomMember:
    """Make ``invitee``'s company a member of the room by consent: ``inviter`` (a member) invites it, it accepts."""
    company_id = (await invitee.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)).company.company_id
    invited = await inviter.InviteCompany(
        gateway_pb2.InviteCompanyRequest(room_id=room_id, company_id=company_id), timeout=10
    )
    accepted = await invitee.AcceptInvitation(
        gateway_pb2.AcceptInvitationRequest(invitation_id=invited.invitation.invitation_id), timeout=10
    )
    member: common_pb2.RoomMember = accepted.member
    return member


async def ended_run(gw: Any, run_id: str) -> common_pb2.Run:
    """Poll the Gateway's GetRun until the run's ledger row has ended (NOT_FOUND: not recorded yet)."""
    return await run_reaching(gw, run_id, lambda run: run.step == common_pb2.RUN_STEP_ENDED, "end")


async def run_reaching(
    gw: Any, run_id: str, reached: Callable[[common_pb2.Run], bool], what: str = "reach the state awaited"
) -> common_pb2.Run:
    """Poll the Gateway's GetRun until ``reached(run)`` (NOT_FOUND: not recorded yet)."""
    for _ in range(1200):  # a bound on polling, not a timing assertion
        try:
            run: common_pb2.Run = (await gw.GetRun(gateway_pb2.GetRunRequest(run_id=run_id), timeout=10)).run
            if reached(run):
                return run
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run_id} did not {what}")


def self_signed_tls(folder: Path) -> tuple[Path, Path, bytes]:
    """A self-signed certificate for localhost and 127.0.0.1 and its key, written into ``folder``
    (for QUAYUTEC_GATEWAY_TLS_CERT / _KEY); returns both paths and the certificate's PEM to trust."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    cert_path, key_path = folder / "tls.crt", folder / "tls.key"
    cert_path.write_bytes(cert_pem)
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path, cert_pem
