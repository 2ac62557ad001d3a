"""Certificates of the services: the development PKI made once (also by processes starting together),
production files, loopback by default, a plaintext port for health only, reflection v1."""

from __future__ import annotations

import multiprocessing
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from quayutec.config import CLAIMS, GATEWAY, ROOM, RUNTIME, ConfigError, ServerConfig, service_addr
from quayutec.tls import IDENTITIES, MtlsConfig, certificate_identity, ensure_dev_pki, load_identity
from services.stack import REPO, free_port, wait_serving
from tests.harness.channels import service_channel
from tests.harness.gateway import running_gateway
from tests.harness.room import running_room


def _make_pki(folder: str) -> None:
    ensure_dev_pki(Path(folder))


def test_processes_starting_together_make_one_ca_and_private_keys(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_make_pki, args=(str(pki),)) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    ca = x509.load_pem_x509_certificate((pki / "ca" / "ca.crt").read_bytes())
    for name in IDENTITIES:
        cert = x509.load_pem_x509_certificate((pki / name / "tls.crt").read_bytes())
        cert.verify_directly_issued_by(ca)
        assert certificate_identity(cert) == name
        assert (pki / name / "ca.crt").read_bytes() == (pki / "ca" / "ca.crt").read_bytes()
    assert not list(pki.rglob("*.tmp")) and not list(pki.rglob(".*.tmp"))
    before = (pki / "room" / "tls.crt").read_bytes()
    ensure_dev_pki(pki)
    assert (pki / "room" / "tls.crt").read_bytes() == before, "an existing PKI is reused, not remade"


def test_the_ca_key_is_apart_from_every_service_key(tmp_path: Path) -> None:
    """The CA's key alone in pki/ca/ (0700, key 0600); each identity's folder (0700) holds the CA's
    certificate, its own certificate and its own key (0600), and nothing else."""
    pki = tmp_path / "pki"
    ensure_dev_pki(pki)
    assert sorted(p.name for p in (pki / "ca").iterdir()) == ["ca.crt", "ca.key"]
    assert stat.S_IMODE((pki / "ca").stat().st_mode) == 0o700
    assert stat.S_IMODE((pki / "ca" / "ca.key").stat().st_mode) == 0o600
    for name in IDENTITIES:
        folder = pki / name
        assert sorted(p.name for p in folder.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE((folder / "tls.key").stat().st_mode) == 0o600
        assert MtlsConfig.dev(pki).identity_files(name) == (folder / "ca.crt", folder / "tls.crt", folder / "tls.key")
    keys = sorted(str(p.relative_to(pki)) for p in pki.rglob("*.key"))
    assert keys == sorted(["ca/ca.key", *(f"{name}/tls.key" for name in IDENTITIES)])
    assert [p.name for p in pki.iterdir() if p.is_file()] == [".lock"]


def test_a_service_never_makes_the_dev_pki(tmp_path: Path) -> None:
    """Making it needs the CA's key: a service that finds no PKI stops and says how to make one;
    the admin identity (the admin tooling) makes it."""
    config = MtlsConfig.from_env({"QUAYUTEC_DATA_DIR": str(tmp_path)})
    for name in ("gateway", "room", "claims", "runtime"):
        with pytest.raises(ConfigError, match="quayutec pki init"):
            load_identity(name, config)
    assert not (tmp_path / "pki" / "ca").exists()
    assert load_identity("admin", config).name == "admin"
    assert (tmp_path / "pki" / "ca" / "ca.key").exists()
    assert load_identity("claims", config).key_pem == (tmp_path / "pki" / "claims" / "tls.key").read_bytes()


def _claims_from_data_folder(database_url: str, data_dir: Path, port: int) -> subprocess.Popen[bytes]:
    """``python -m services.claims`` with nothing but its data folder for certificates."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.claims"],
        cwd=REPO,
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("QUAYUTEC_MTLS_")},
            "PYTHONPATH": str(REPO),
            "DATABASE_URL": database_url,
            "QUAYUTEC_DATA_DIR": str(data_dir),
            "QUAYUTEC_CLAIMS_LISTEN": f"127.0.0.1:{port}",
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def test_a_service_serves_from_its_folder_without_the_ca(database_url: str, tmp_path: Path) -> None:
    """A real Claims process started from the development PKI of its data folder, with the CA's folder
    taken away (as the admin keeps it): it serves mutual TLS from its own folder and never remakes
    or reads a CA."""
    pki = tmp_path / "pki"
    ensure_dev_pki(pki)
    (pki / "ca").rename(tmp_path / "ca-kept-by-the-admin")
    port = free_port()
    proc = _claims_from_data_folder(database_url, tmp_path, port)
    try:
        # The admin identity from its files: nothing on this side remakes the PKI either.
        ca, cert, key = MtlsConfig.dev(pki).identity_files("admin")
        admin = MtlsConfig(pki_dir=pki, ca_path=ca, cert_path=cert, key_path=key)
        await wait_serving(f"127.0.0.1:{port}", CLAIMS.grpc_service, internal="claims", mtls=admin, proc=proc)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not (pki / "ca").exists()
    assert sorted(p.name for p in pki.iterdir() if p.is_dir()) == sorted(IDENTITIES)


def test_the_dev_pki_lives_in_the_data_folder(tmp_path: Path) -> None:
    config = MtlsConfig.from_env({"QUAYUTEC_DATA_DIR": str(tmp_path)})
    assert config.pki_dir == tmp_path / "pki" and not config.from_files
    ensure_dev_pki(config.pki_dir)
    assert load_identity("claims", config).name == "claims"
    assert (tmp_path / "pki" / "claims" / "tls.key").exists()


def test_production_files_must_be_complete_and_name_this_service(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="QUAYUTEC_MTLS_KEY"):
        MtlsConfig.from_env({"QUAYUTEC_MTLS_CA": "ca.pem", "QUAYUTEC_MTLS_CERT": "cert.pem"})
    pki = tmp_path / "pki"
    ensure_dev_pki(pki)
    files = MtlsConfig.from_env(
        {
            "QUAYUTEC_MTLS_CA": str(pki / "room" / "ca.crt"),
            "QUAYUTEC_MTLS_CERT": str(pki / "room" / "tls.crt"),
            "QUAYUTEC_MTLS_KEY": str(pki / "room" / "tls.key"),
        }
    )
    assert load_identity("room", files).cert_pem == (pki / "room" / "tls.crt").read_bytes()
    with pytest.raises(ConfigError, match="spiffe://quayutec/claims"):
        load_identity("claims", files)
    missing = MtlsConfig.from_env(
        {
            "QUAYUTEC_MTLS_CA": str(tmp_path / "nope.crt"),
            "QUAYUTEC_MTLS_CERT": str(pki / "room" / "tls.crt"),
            "QUAYUTEC_MTLS_KEY": str(pki / "room" / "tls.key"),
        }
    )
    with pytest.raises(ConfigError, match="cannot read QUAYUTEC_MTLS_CA"):
        load_identity("room", missing)


def test_internal_services_listen_on_loopback_unless_told() -> None:
    for spec in (ROOM, CLAIMS, RUNTIME):
        assert ServerConfig.from_env(spec, {}).listen == f"127.0.0.1:{spec.port}"
        assert service_addr(spec, {}) == f"127.0.0.1:{spec.port}"
        exposed = ServerConfig.from_env(spec, {spec.listen_env: f"[::]:{spec.port}"})
        assert exposed.listen == f"[::]:{spec.port}"
    assert ServerConfig.from_env(GATEWAY, {}).listen == "[::]:50051"
    assert ServerConfig.from_env(ROOM, {}).health_listen is None
    assert ServerConfig.from_env(ROOM, {"QUAYUTEC_ROOM_HEALTH_LISTEN": "127.0.0.1:8081"}).health_listen == (
        "127.0.0.1:8081"
    )


async def test_the_health_port_answers_health_in_plaintext_and_nothing_else(database_url: str) -> None:
    from services.stack import free_port

    health_addr = f"127.0.0.1:{free_port()}"
    async with (
        running_room(database_url, QUAYUTEC_ROOM_HEALTH_LISTEN=health_addr),
        grpc.aio.insecure_channel(health_addr) as channel,
    ):
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service=ROOM.grpc_service), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        credentials = channel.unary_unary(
            "/quayutec.v1.RoomService/GetAgentCredentials",
            request_serializer=lambda _: b"",
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await credentials(b"", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def _reflect(channel: grpc.aio.Channel, service: str, request: reflection_pb2.ServerReflectionRequest) -> object:
    call = channel.stream_stream(
        f"/{service}/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    stream = call(iter([request]), timeout=10)
    async for response in stream:
        return response
    raise AssertionError("no reflection answer")


@pytest.mark.parametrize("service", ["grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"])
async def test_reflection_v1_and_v1alpha_describe_a_method(database_url: str, service: str) -> None:
    from google.protobuf import descriptor_pb2

    async with (
        running_room(database_url) as room_addr,
        running_gateway(database_url, room_addr, "127.0.0.1:9", QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false") as addr,
        grpc.aio.insecure_channel(addr) as channel,
    ):
        listed = await _reflect(channel, service, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in listed.list_services_response.service}  # type: ignore[attr-defined]
        assert {"quayutec.v1.GatewayService", "grpc.reflection.v1.ServerReflection"} <= names
        found = await _reflect(
            channel,
            service,
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="quayutec.v1.GatewayService.PostMessage"),
        )
        files = [
            descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in found.file_descriptor_response.file_descriptor_proto  # type: ignore[attr-defined]
        ]
        methods = {m.name for f in files for s in f.service if s.name == "GatewayService" for m in s.method}
        assert "PostMessage" in methods
    # An internal service answers reflection to any identity it trusts.
    async with running_room(database_url) as room_addr, service_channel(room_addr, "admin") as channel:
        listed = await _reflect(channel, service, reflection_pb2.ServerReflectionRequest(list_services=""))
        assert "quayutec.v1.RoomService" in {s.name for s in listed.list_services_response.service}  # type: ignore[attr-defined]


def test_a_dev_pki_without_its_ca_key_is_remade_whole(tmp_path: Path) -> None:
    """Leaves signed by a CA whose key is gone cannot stay beside a new CA."""
    pki = tmp_path / "pki"
    ensure_dev_pki(pki)
    (pki / "ca" / "ca.key").unlink()
    ensure_dev_pki(pki)
    ca = x509.load_pem_x509_certificate((pki / "ca" / "ca.crt").read_bytes())
    for name in IDENTITIES:
        x509.load_pem_x509_certificate((pki / name / "tls.crt").read_bytes()).verify_directly_issued_by(ca)
        assert (pki / name / "ca.crt").read_bytes() == (pki / "ca" / "ca.crt").read_bytes()


def test_a_pki_of_the_old_flat_layout_is_replaced(tmp_path: Path) -> None:
    """The first layout kept the CA's key beside the services' keys: the admin tooling removes it."""
    pki = tmp_path / "pki"
    pki.mkdir()
    flat = ["ca.key", "ca.crt", *(f"{n}.{ext}" for n in IDENTITIES for ext in ("crt", "key"))]
    for name in flat:
        (pki / name).write_text("old\n")
    ensure_dev_pki(pki)
    assert not [name for name in flat if (pki / name).exists()]
    assert load_identity("room", MtlsConfig.dev(pki)).name == "room"
