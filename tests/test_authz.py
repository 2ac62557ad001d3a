"""Least privilege between the services: every internal RPC, read from the service descriptors,
refuses a caller without a certificate and every identity the table does not name, and admits the
ones it names. Provider keys reach the Runtime's identity only."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor, message_factory

from quayutec.authz import RPC_CALLERS, AuthzInterceptor, allowed_callers
from quayutec.tls import IDENTITIES, MtlsConfig, ensure_dev_pki, load_identity
from quayutec.v1 import claims_pb2, common_pb2, room_pb2, runtime_pb2, runtime_pb2_grpc
from tests.harness.channels import pki_identity, service_channel
from tests.harness.claims import running_claims
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime

INTERNAL_FILES = (room_pb2.DESCRIPTOR, claims_pb2.DESCRIPTOR, runtime_pb2.DESCRIPTOR)
REFUSED_BY_AUTHZ = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}


@dataclass(frozen=True)
class Rpc:
    service: str  # "quayutec.v1.RoomService"
    method: descriptor.MethodDescriptor

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method.name}"

    def call(self, channel: grpc.aio.Channel) -> Any:
        """The RPC with an empty request, over ``channel``."""
        request = message_factory.GetMessageClass(self.method.input_type)
        response = message_factory.GetMessageClass(self.method.output_type)
        stub = channel.unary_unary(
            self.path, request_serializer=request.SerializeToString, response_deserializer=response.FromString
        )
        return stub(request(), timeout=10)


def internal_rpcs() -> Iterator[Rpc]:
    for file in INTERNAL_FILES:
        for service in file.services_by_name.values():
            for method in service.methods:
                yield Rpc(service.full_name, method)


def test_every_internal_rpc_has_an_entry_and_every_entry_an_rpc() -> None:
    paths = {rpc.path for rpc in internal_rpcs()}
    missing = sorted(paths - set(RPC_CALLERS))
    assert not missing, f"RPCs with no entry in quayutec.authz.RPC_CALLERS (nobody may call them): {missing}"
    assert not sorted(set(RPC_CALLERS) - paths), "entries for RPCs that do not exist"
    for path, callers in RPC_CALLERS.items():
        assert callers, f"{path}: an entry names at least one identity"
        assert callers <= set(IDENTITIES), f"{path}: unknown identities {callers - set(IDENTITIES)}"


def test_least_privilege_where_it_matters() -> None:
    room, claims, runtime = "/quayutec.v1.RoomService/", "/quayutec.v1.ClaimsService/", "/quayutec.v1.RuntimeService/"
    for method in ("GetAgentCredentials", "ReadRunContext", "RecordRun", "WriteMemory", "CreateWaitpoint"):
        assert allowed_callers(room + method) == {"runtime"}, method
    assert allowed_callers(claims + "ClaimOnce") == {"runtime"}
    assert allowed_callers(runtime + "StartRun") == {"gateway"}
    assert allowed_callers(room + "CreateCompany") == {"admin"}
    assert "gateway" not in allowed_callers(room + "CreateCompany")
    assert not any("room" in c or "claims" in c for c in RPC_CALLERS.values()), "no service calls Room or Claims"


def _message_has_field(message: descriptor.Descriptor, name: str, seen: set[str]) -> bool:
    if message.full_name in seen:
        return False
    seen.add(message.full_name)
    for f in message.fields:
        if f.name == name:
            return True
        if f.message_type is not None and _message_has_field(f.message_type, name, seen):
            return True
    return False


def test_only_runtime_may_call_an_rpc_that_answers_with_a_provider_key() -> None:
    answering = [rpc for rpc in internal_rpcs() if _message_has_field(rpc.method.output_type, "provider_key", set())]
    assert {rpc.method.name for rpc in answering} == {"GetAgentCredentials", "ReadRunContext"}
    for rpc in answering:
        assert allowed_callers(rpc.path) == {"runtime"}, rpc.path


@dataclass(frozen=True)
class Servers:
    room: str
    claims: str
    runtime: str

    def addr(self, service: str) -> str:
        return {
            "quayutec.v1.RoomService": self.room,
            "quayutec.v1.ClaimsService": self.claims,
            "quayutec.v1.RuntimeService": self.runtime,
        }[service]


@pytest.fixture
async def servers(database_url: str) -> AsyncIterator[Servers]:
    async with (
        running_claims(database_url) as claims_addr,
        running_room(database_url) as room_addr,
        running_runtime(claims_addr, room_addr, standin_url="http://127.0.0.1:9") as runtime_addr,
    ):
        yield Servers(room=room_addr, claims=claims_addr, runtime=runtime_addr)


async def _code(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def test_every_internal_rpc_admits_exactly_its_callers(servers: Servers) -> None:
    rpcs = list(internal_rpcs())
    services = {rpc.service for rpc in rpcs}
    assert services == {"quayutec.v1.RoomService", "quayutec.v1.ClaimsService", "quayutec.v1.RuntimeService"}
    wrong: list[str] = []
    for service in sorted(services):
        addr = servers.addr(service)
        channels = {identity: service_channel(addr, identity) for identity in IDENTITIES}
        try:
            for rpc in (r for r in rpcs if r.service == service):
                allowed = allowed_callers(rpc.path)
                for identity, channel in channels.items():
                    try:
                        await rpc.call(channel)
                        code, details = grpc.StatusCode.OK, ""
                    except grpc.aio.AioRpcError as exc:
                        code, details = exc.code(), exc.details() or ""
                    if identity in allowed and code in (*REFUSED_BY_AUTHZ, grpc.StatusCode.UNAVAILABLE):
                        wrong.append(f"{rpc.path} as {identity}: {code.name} {details}")
                    if identity not in allowed and (
                        code != grpc.StatusCode.PERMISSION_DENIED or identity not in details or rpc.path not in details
                    ):
                        wrong.append(f"{rpc.path} as {identity}: expected PERMISSION_DENIED, got {code.name} {details}")
        finally:
            for channel in channels.values():
                await channel.close()
    assert not wrong, "\n".join(wrong)


async def test_a_caller_without_a_certificate_is_refused_at_the_handshake(servers: Servers, tmp_path: Any) -> None:
    """No certificate, or one another CA signed: the TLS handshake fails, so no RPC runs (UNAVAILABLE)."""
    ensure_dev_pki(tmp_path / "other-pki")
    stranger = load_identity("runtime", MtlsConfig.dev(tmp_path / "other-pki"))  # the right name, the wrong CA
    ca_only = grpc.ssl_channel_credentials(root_certificates=pki_identity("runtime").ca_pem)
    for rpc in internal_rpcs():
        addr = servers.addr(rpc.service)
        for channel in (
            grpc.aio.insecure_channel(addr),
            grpc.aio.secure_channel(addr, ca_only),
            grpc.aio.secure_channel(addr, stranger.channel_credentials()),
        ):
            async with channel:
                assert await _code(rpc.call(channel)) == grpc.StatusCode.UNAVAILABLE, rpc.path


async def test_the_interceptor_answers_unauthenticated_without_a_peer_identity() -> None:
    """Behind a port that does not verify certificates the table still admits nobody."""

    class Starts(runtime_pb2_grpc.RuntimeServiceServicer):
        async def StartRun(self, request: Any, context: Any) -> runtime_pb2.StartRunResponse:
            return runtime_pb2.StartRunResponse()

        async def StartRuns(self, request: Any, context: Any) -> runtime_pb2.StartRunsResponse:
            return runtime_pb2.StartRunsResponse()

    server = grpc.aio.server(interceptors=(AuthzInterceptor(),))
    runtime_pb2_grpc.add_RuntimeServiceServicer_to_server(Starts(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = runtime_pb2_grpc.RuntimeServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.StartRun(runtime_pb2.StartRunRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "mutual TLS" in (err.value.details() or "")
    finally:
        await server.stop(0)


async def test_no_identity_but_runtime_reads_a_provider_key(servers: Servers) -> None:
    secret = "sk-ant-only-for-the-runtime"
    async with service_channel(servers.room, "admin") as admin:
        company = await room_call(admin, "CreateCompany", room_pb2.RoomServiceCreateCompanyRequest(name="Acme"))
    async with service_channel(servers.room, "gateway") as gateway:
        room = await room_call(
            gateway,
            "CreateRoom",
            room_pb2.RoomServiceCreateRoomRequest(company_id=company.company.company_id, name="r"),
        )
        agent = await room_call(
            gateway,
            "RegisterAgent",
            room_pb2.RoomServiceRegisterAgentRequest(
                company_id=company.company.company_id,
                name="planner",
                provider=common_pb2.PROVIDER_ANTHROPIC,
                model="m",
                provider_key=secret,
            ),
        )
    agent_id = agent.agent.agent_id
    credentials = room_pb2.RoomServiceGetAgentCredentialsRequest(agent_id=agent_id)
    context = room_pb2.RoomServiceReadRunContextRequest(agent_id=agent_id, room_id=room.room.room_id)
    for identity in IDENTITIES:
        async with service_channel(servers.room, identity) as channel:
            for method, request in (("GetAgentCredentials", credentials), ("ReadRunContext", context)):
                if identity == "runtime":
                    answer = await room_call(channel, method, request)
                    assert answer.provider_key == secret
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await room_call(channel, method, request)
                    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (identity, method)


def _room_method(name: str) -> Rpc:
    return Rpc("quayutec.v1.RoomService", room_pb2.DESCRIPTOR.services_by_name["RoomService"].methods_by_name[name])


async def room_call(channel: grpc.aio.Channel, method: str, request: Any) -> Any:
    """RoomService ``method`` with ``request`` over ``channel``."""
    rpc = _room_method(method)
    response = message_factory.GetMessageClass(rpc.method.output_type)
    stub = channel.unary_unary(
        rpc.path, request_serializer=type(request).SerializeToString, response_deserializer=response.FromString
    )
    return await stub(request, timeout=10)


async def test_the_interceptor_guards_streaming_handlers_too() -> None:
    """A server-streaming RPC: refused before its first message to an identity not in the table,
    streamed in full to one that is."""
    path = "/quayutec.test.Stream/Count"

    async def count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for n in range(3):
            yield bytes([n])

    handler = grpc.method_handlers_generic_handler(
        "quayutec.test.Stream", {"Count": grpc.unary_stream_rpc_method_handler(count)}
    )
    server = grpc.aio.server(interceptors=(AuthzInterceptor({path: frozenset({"runtime"})}),))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_secure_port("127.0.0.1:0", pki_identity("claims").server_credentials())
    await server.start()
    try:
        for identity, expected in (("runtime", [b"\x00", b"\x01", b"\x02"]), ("gateway", None)):
            async with service_channel(f"127.0.0.1:{port}", identity) as channel:
                call = channel.unary_stream(path)(b"", timeout=10)
                if expected is not None:
                    assert [m async for m in call] == expected
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    _ = [m async for m in call]
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "gateway may not call" in (err.value.details() or "")
    finally:
        await server.stop(0)
