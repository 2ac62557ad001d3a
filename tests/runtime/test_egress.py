"""The egress guard at connect time (issue 9 item 4): the Runtime resolves an owner's host itself,
checks the address it is about to dial, and dials that address, so a name that resolved to a
public address at registration and to an internal one now (DNS rebinding) is refused.

Refusals use a table resolver and a dialer that records and dials nothing; the positive cases dial
only 127.0.0.1 (the stand-in, or a local TLS server), allow-listed.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from quayutec.egress import EgressPolicy, EgressRefused, EgressTransport, address_class
from quayutec.v1 import common_pb2
from services.runtime.model import ChatMessage, ModelRequest, ModelTarget, Provider, RealClock, RetryPolicy, call_model
from services.runtime.model.client import make_http_client, make_owner_http_client
from services.runtime.standin import StandinProvider
from tests.harness.claims import running_claims
from tests.harness.egress import PUBLIC, RecordingDialer, TableResolver
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime
from tests.runtime.world import make_world, runtime_stub, start_request

HOST = "models.acme.test"
REQUEST = ModelRequest(system="s", messages=(ChatMessage("user", "hi"),), max_tokens=16)
OPENAI_OK = {"model": "m", "choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}

# What HOST resolves to at connect time, and the rule that refuses it.
REFUSED = [
    ("127.0.0.1", "https", "loopback"),
    ("::1", "https", "loopback"),
    ("::ffff:127.0.0.1", "https", "loopback"),
    ("10.0.0.5", "https", "private"),
    ("172.16.4.4", "https", "private"),
    ("fd12::1", "https", "private"),
    ("169.254.169.254", "https", "metadata"),
    ("fd00:ec2::254", "https", "metadata"),
    ("100.100.100.200", "https", "metadata"),
    ("169.254.10.10", "https", "link_local"),
    ("fe80::1", "https", "link_local"),
    ("224.0.0.251", "https", "multicast"),
    ("ff02::1", "https", "multicast"),
    ("0.0.0.0", "https", "unspecified"),
    ("::", "https", "unspecified"),
    (PUBLIC, "http", "plain_http"),
]


def guarded(policy: EgressPolicy, table: Mapping[str, Sequence[str]], **kwargs: Any) -> httpx.AsyncClient:
    transport = EgressTransport(policy, resolver=TableResolver(table), **kwargs)
    return make_http_client(5.0, transport, trust_env=False)


@pytest.mark.parametrize(("answer", "scheme", "rule"), REFUSED)
async def test_the_dialled_address_is_checked(answer: str, scheme: str, rule: str) -> None:
    """A name is refused as ``non_public`` (its class kept as the cause, for our logs only): what the
    owner sees never says what the name resolves to."""
    dialer = RecordingDialer()
    async with guarded(EgressPolicy(), {HOST: (answer,)}, dialer=dialer) as http:
        with pytest.raises(EgressRefused) as refused:
            await http.post(f"{scheme}://{HOST}/v1/chat/completions", json={})
    assert refused.value.rule == ("plain_http" if rule == "plain_http" else "non_public")
    assert refused.value.cause == rule
    assert answer not in refused.value.message
    assert dialer.dialled == []


@pytest.mark.parametrize(("answer", "scheme", "rule"), [r for r in REFUSED if r[2] != "plain_http"])
async def test_an_address_literal_is_checked_without_resolving(answer: str, scheme: str, rule: str) -> None:
    dialer = RecordingDialer()
    resolver = TableResolver({})
    host = f"[{answer}]" if ":" in answer else answer
    client = make_http_client(5.0, EgressTransport(EgressPolicy(), resolver=resolver, dialer=dialer), trust_env=False)
    async with client as http:
        with pytest.raises(EgressRefused) as refused:
            await http.post(f"{scheme}://{host}/v1/chat/completions", json={})
    assert refused.value.rule == rule
    assert dialer.dialled == [] and resolver.asked == []


async def test_an_allow_listed_address_is_dialled_by_address() -> None:
    """The check passes and the dialer is handed the checked IP, never the name (no second lookup)."""
    dialer = RecordingDialer()
    policy = EgressPolicy.parse("10.0.0.0/8")
    async with guarded(policy, {HOST: ("10.0.0.5",)}, dialer=dialer) as http:
        with pytest.raises(httpx.ConnectError):
            await http.post(f"https://{HOST}/v1/chat/completions", json={})
        with pytest.raises(httpx.ConnectError):
            await http.post(f"http://{HOST}:8000/v1/chat/completions", json={})
    assert dialer.dialled == [("10.0.0.5", 443), ("10.0.0.5", 8000)]


async def test_a_public_address_is_dialled_by_address() -> None:
    dialer = RecordingDialer()
    async with guarded(EgressPolicy(), {HOST: (PUBLIC,)}, dialer=dialer) as http:
        with pytest.raises(httpx.ConnectError):
            await http.post(f"https://{HOST}/v1/chat/completions", json={})
    assert dialer.dialled == [(PUBLIC, 443)]


async def test_a_refusal_is_one_final_attempt_in_the_outcome() -> None:
    dialer = RecordingDialer()
    async with guarded(EgressPolicy(), {HOST: ("169.254.169.254",)}, dialer=dialer) as http:
        target = ModelTarget("openai_compatible", "m", "sk-x", base_url=f"https://{HOST}", owner_supplied=True)
        outcome = await call_model(http, target, REQUEST, policy=RetryPolicy(), clock=RealClock())
    assert outcome.reply is None and outcome.error_class == "egress_refused"
    assert len(outcome.attempts) == 1 and not outcome.attempts[0].retryable
    assert "non-public" in outcome.attempts[0].detail
    assert "metadata" not in outcome.attempts[0].detail and "169.254" not in outcome.attempts[0].detail
    assert dialer.dialled == []


async def test_an_allow_listed_loopback_host_is_reached_by_name(standin: StandinProvider) -> None:
    """A real dial to the stand-in on 127.0.0.1, named through the table: the guard's own lookup."""
    port = int(standin.base_url.rsplit(":", 1)[1])
    resolver = TableResolver({"standin.test": ("127.0.0.1",)})
    transport = EgressTransport(EgressPolicy.parse("standin.test"), resolver=resolver)
    async with make_http_client(5.0, transport, trust_env=False) as http:
        target = ModelTarget(
            "openai_compatible", "m", "sk-x", base_url=f"http://standin.test:{port}", owner_supplied=True
        )
        outcome = await call_model(http, target, REQUEST, policy=RetryPolicy(), clock=RealClock())
    assert outcome.reply is not None
    assert resolver.asked == [("standin.test", port)]
    assert len(standin.requests("m")) == 1


async def test_redirects_are_not_followed(standin: StandinProvider) -> None:
    port = int(standin.base_url.rsplit(":", 1)[1])
    standin.enqueue_fault("raw", status=307, body=None, headers={"location": "http://169.254.169.254/latest"})
    transport = EgressTransport(EgressPolicy.parse("127.0.0.1/32"), resolver=TableResolver({}))
    async with make_http_client(5.0, transport, trust_env=False) as http:
        target = ModelTarget("openai_compatible", "m", "sk-x", base_url=f"http://127.0.0.1:{port}", owner_supplied=True)
        outcome = await call_model(http, target, REQUEST, policy=RetryPolicy(), clock=RealClock())
    assert outcome.error_class == "unexpected_status" and [a.status_code for a in outcome.attempts] == [307]
    assert len(standin.requests()) == 1


@pytest.mark.parametrize(
    "body",
    [
        "<html>internal admin page: db password hunter2</html>",
        {"secret": "hunter2", "rows": [1, 2, 3]},
        {"error": "hunter2"},
        {"error": {"message": "hunter2"}},  # neither provider's shape: no type, no code
    ],
)
async def test_an_arbitrary_body_never_reaches_the_ledger(standin: StandinProvider, body: object) -> None:
    port = int(standin.base_url.rsplit(":", 1)[1])
    transport = EgressTransport(EgressPolicy.parse("127.0.0.1/32"), resolver=TableResolver({}))
    async with make_http_client(5.0, transport, trust_env=False) as http:
        providers: tuple[Provider, ...] = ("anthropic", "openai_compatible")
        for provider in providers:
            standin.enqueue_fault("raw", status=403, body=body)
            target = ModelTarget(provider, "m", "sk-x", base_url=f"http://127.0.0.1:{port}", owner_supplied=True)
            outcome = await call_model(http, target, REQUEST, policy=RetryPolicy(), clock=RealClock())
            assert outcome.error_class == "permission"
            assert outcome.attempts[0].detail == "403 permission"
            assert "hunter2" not in repr(outcome)


async def test_a_provider_shaped_error_keeps_its_class_and_message(standin: StandinProvider) -> None:
    port = int(standin.base_url.rsplit(":", 1)[1])
    shaped = {"type": "error", "error": {"type": "permission_error", "message": "region not supported"}}
    standin.enqueue_fault("raw", status=403, body=shaped)
    transport = EgressTransport(EgressPolicy.parse("127.0.0.1/32"), resolver=TableResolver({}))
    async with make_http_client(5.0, transport, trust_env=False) as http:
        target = ModelTarget("anthropic", "m", "sk-x", base_url=f"http://127.0.0.1:{port}", owner_supplied=True)
        outcome = await call_model(http, target, REQUEST, policy=RetryPolicy(), clock=RealClock())
    assert outcome.attempts[0].detail == "403 permission permission_error: region not supported"


# -- TLS: the address is dialled, the certificate is verified against the URL's host name ----------------------


def _tls_files(tmp: Path, name: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A throwaway CA and a server certificate for ``name``; (server context, client context)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (tmp / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp / "cert.pem", tmp / "key.pem")
    client = ssl.create_default_context(cadata=ca.public_bytes(serialization.Encoding.PEM).decode())
    return server, client


@pytest.fixture
async def tls_server(tmp_path: Path) -> AsyncIterator[tuple[int, ssl.SSLContext, list[str]]]:
    """An HTTPS server on 127.0.0.1 for ``tls.models.test`` answering one fixed reply; records SNI."""
    server_ctx, client_ctx = _tls_files(tmp_path, "tls.models.test")
    names: list[str] = []

    def record_sni(sock: ssl.SSLObject, name: str | None, ctx: ssl.SSLContext) -> None:
        names.append(name or "")

    server_ctx.sni_callback = record_sni
    reply = b'{"choices":[{"message":{"content":"over tls"},"finish_reason":"stop"}]}'

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            await reader.readexactly(length)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                + f"content-length: {len(reply)}\r\n\r\n".encode()
                + reply
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port, client_ctx, names
    finally:
        server.close()
        await server.wait_closed()


async def test_tls_is_verified_against_the_host_name_while_the_address_is_dialled(
    tls_server: tuple[int, ssl.SSLContext, list[str]],
) -> None:
    port, client_ctx, names = tls_server
    policy = EgressPolicy.parse("127.0.0.1/32")
    table = {"tls.models.test": ("127.0.0.1",), "other.models.test": ("127.0.0.1",)}
    async with guarded(policy, table, ssl_context=client_ctx) as http:
        ok = await http.post(f"https://tls.models.test:{port}/v1/chat/completions", json={})
        assert ok.status_code == 200 and b"over tls" in ok.content
        # Same address, another name: the certificate does not name it, so the handshake fails.
        with pytest.raises(httpx.ConnectError, match=r"CERTIFICATE_VERIFY_FAILED|hostname"):
            await http.post(f"https://other.models.test:{port}/v1/chat/completions", json={})
    assert names[:2] == ["tls.models.test", "other.models.test"]


def test_address_classes() -> None:
    assert address_class(ipaddress.ip_address(PUBLIC)) is None
    assert address_class(ipaddress.ip_address("2606:4700::1111")) is None
    assert address_class(ipaddress.ip_address("64:ff9b::a00:1")) == "private"  # NAT64 of 10.0.0.1
    assert address_class(ipaddress.ip_address("2002:7f00:1::")) == "loopback"  # 6to4 of 127.0.0.1
    assert address_class(ipaddress.ip_address("192.0.2.1")) in ("private", "reserved")
    assert address_class(ipaddress.ip_address("240.0.0.1")) in ("private", "reserved")


def test_a_malformed_allow_list_names_the_variable() -> None:
    for raw in ("10.0.0.0/33", "bad host", "a/b/c", "*.example.com"):
        with pytest.raises(ValueError, match="QUAYUTEC_RUNTIME_EGRESS_ALLOW"):
            EgressPolicy.parse(raw)
    policy = EgressPolicy.parse(" 10.0.0.0/8 , Models.Internal. ,fd00::/8,192.168.1.7")
    assert policy.allow_hosts == {"models.internal"} and len(policy.allow_networks) == 3


# -- end to end: registered while public, rebound to loopback by the time the Runtime dials -------------------


async def test_a_rebound_name_is_refused_by_the_runtime(database_url: str, standin: StandinProvider) -> None:
    at_registration = TableResolver({HOST: (PUBLIC,)})
    at_connect = TableResolver({HOST: ("127.0.0.1",)})
    dialer = RecordingDialer()
    channels: list[grpc.aio.Channel] = []
    async with (
        running_claims(database_url) as claims_addr,
        running_room(database_url, resolver=at_registration) as room_addr,
        running_runtime(claims_addr, room_addr, standin_url=standin.base_url, resolver=at_connect, dialer=dialer) as rt,
    ):
        world = await make_world(room_addr, claims_addr, channels)
        own = await world.register_own_model(f"https://{HOST}/", model="own-1")
        posted = await world.post("@own hello", [own.agent_id])
        started = await runtime_stub(rt, channels).StartRun(start_request(posted.wakes[0]))
        run = await world.wait_for_run(started.run_id)
        for channel in channels:
            await channel.close()
    assert run.status == common_pb2.RUN_STATUS_FAILED
    assert [a.error_class for a in run.model_attempts] == ["egress_refused"]
    assert "non-public" in run.model_attempts[0].detail and "egress_refused" in run.error
    assert "127.0.0.1" not in run.model_attempts[0].detail and "loopback" not in run.model_attempts[0].detail
    assert at_registration.asked == [(HOST, 443)] and at_connect.asked == [(HOST, 443)]
    assert dialer.dialled == []
    assert standin.requests() == []


async def test_the_owner_client_holds_a_connection_for_every_run_in_flight() -> None:
    """More owner-supplied requests open at once than httpx's default pool of 100: a server that
    answers only when all of them are open at the same time still answers every one."""
    in_flight = 150
    opened = 0
    all_open = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal opened
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(h.split(b":", 1)[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")),
                    0,
                )
                await reader.readexactly(length)
                opened += 1
                if opened >= in_flight:
                    all_open.set()
                await all_open.wait()
                body = json.dumps(OPENAI_OK).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        http = make_owner_http_client(
            30.0, EgressPolicy.parse("127.0.0.1/32"), max_connections=in_flight, resolver=TableResolver({})
        )
        async with http:
            target = ModelTarget(
                "openai_compatible", "m", "sk-x", base_url=f"http://127.0.0.1:{port}", owner_supplied=True
            )
            outcomes = await asyncio.gather(
                *(call_model(http, target, REQUEST, policy=RetryPolicy(), clock=RealClock()) for _ in range(in_flight))
            )
    finally:
        server.close()
    assert [o.error for o in outcomes if o.reply is None] == []
    assert opened == in_flight
