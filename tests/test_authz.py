"""Least privilege, pinned by a specification written here by hand: for every RPC of every service
our protos declare, who may call it. It is on purpose not read from ``quayutec.authz.RPC_CALLERS``:
the code's table is compared with it, and so are the running servers (each internal RPC called as
every identity; each Gateway RPC with no key, an unknown key, a company's key and a session key).
An RPC with no row here fails by name until someone writes down who may call it; a row in the code
or a server that admits more than this specification fails too. Provider keys reach the Runtime's
identity only."""

from __future__ import annotations

import pkgutil
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from importlib import import_module
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor, message_factory
from google.protobuf.message import Message

import quayutec.v1
from quayutec.authz import RPC_CALLERS, AuthzInterceptor
from quayutec.tls import IDENTITIES, MtlsConfig, ensure_dev_pki, load_identity
from quayutec.v1 import common_pb2, gateway_pb2, room_pb2, runtime_pb2, runtime_pb2_grpc
from tests.harness.channels import pki_identity, service_channel
from tests.harness.claims import running_claims
from tests.harness.gateway import authed_gateway, make_company, running_gateway
from tests.harness.room import running_room
from tests.harness.runtime import running_runtime

# The callers, spelled here rather than imported: a renamed identity must fail this test too.
GATEWAY, RUNTIME, ADMIN = "gateway", "runtime", "admin"
# The public API's callers (the Gateway's AuthInterceptor): a company's live API key, and a live
# short-lived session key made with one (what a console sign-in holds).
COMPANY_KEY = "a company's API key"
SESSION_KEY = "a session key"
# SignInService: how a person signs in, before there is any key (tests/gateway/test_signin.py calls it so).
ANYONE = "anyone, without a key"

ROOM_SERVICE = "quayutec.v1.RoomService"
CLAIMS_SERVICE = "quayutec.v1.ClaimsService"
RUNTIME_SERVICE = "quayutec.v1.RuntimeService"
GATEWAY_SERVICE = "quayutec.v1.GatewayService"
SIGNIN_SERVICE = "quayutec.v1.SignInService"

_G, _R, _A, _GR = frozenset({GATEWAY}), frozenset({RUNTIME}), frozenset({ADMIN}), frozenset({GATEWAY, RUNTIME})
_KEY = frozenset({COMPANY_KEY, SESSION_KEY})

# THE SPECIFICATION: service → RPC → who may call it. Change a row only when the design changes.
SPEC: dict[str, dict[str, frozenset[str]]] = {
    ROOM_SERVICE: {
        "CreateCompany": _A,  # the operator's command line
        "GetCompany": frozenset({GATEWAY, ADMIN}),
        "CreateRoom": _G,
        "RenameRoom": _G,
        "ArchiveRoom": _G,
        "GetRoom": _G,
        "ListRooms": _G,
        "CreateInvitation": _G,
        "ListInvitations": _G,
        "AcceptInvitation": _G,
        "DeclineInvitation": _G,
        "ListRoomInvitations": _G,
        "WithdrawInvitation": _G,
        "LeaveRoom": _G,
        "RemoveMember": _G,
        "ListMembers": _G,
        "ReadRoomEvents": _G,  # every audience when no company is named
        "RegisterAgent": _G,
        "RenameAgent": _G,
        "RetireAgent": _G,
        "GetAgent": _G,
        "ListAgents": _G,
        "GetAgentCredentials": _R,  # carries a provider key
        "PostMessage": _GR,  # people through the Gateway, agents' replies through the Runtime
        "ListMessages": _G,
        "GetMessage": _G,  # one message, read through the public API (the console's message page)
        "CreateTask": _GR,
        "UpdateTask": _GR,
        "GetTask": _G,
        "ListTasks": _G,
        "WriteMemory": _R,  # memory is written by runs only
        "ListMemory": _G,
        "UploadFile": _G,
        "ListFiles": _G,
        "SearchPassages": _G,
        "RecordRun": _R,  # the run ledger is written by the Runtime only
        "GetRun": _GR,
        "ListRuns": _G,
        "LeaseWakes": _G,  # wake delivery and housekeeping: the Gateway's loops
        "SettleWake": _G,
        "SettleWakes": _G,
        "CountPendingWakes": _G,
        "ExpireWaitpoints": _G,
        "AbandonStaleRuns": _G,
        "RecordNotStartedRuns": _G,  # the Gateway records a claim its Runtime never wrote a row for
        "SetAgentRights": _G,  # rights and decisions: companies, through the Gateway
        "GetAgentRights": _G,
        "ListWaitpoints": _G,
        "DecideHeldAction": _G,
        "CreateWaitpoint": _R,  # a run parks its held actions ...
        "GetWaitpoint": _R,  # ... and reads their decision
        "ReadRunContext": _R,  # carries a provider key
    },
    CLAIMS_SERVICE: {
        "ClaimOnce": _R,  # burning a wake is the Runtime's alone
        "ClaimMany": _R,
        "GetClaim": frozenset({RUNTIME, ADMIN}),
    },
    RUNTIME_SERVICE: {
        "StartRun": _G,  # runs start from delivered wakes only
        "StartRuns": _G,
    },
    GATEWAY_SERVICE: {
        "WhoAmI": _KEY,
        "CreateRoom": _KEY,
        "RenameRoom": _KEY,
        "ArchiveRoom": _KEY,
        "ListRooms": _KEY,
        "InviteCompany": _KEY,
        "ListInvitations": _KEY,
        "AcceptInvitation": _KEY,
        "DeclineInvitation": _KEY,
        "ListRoomInvitations": _KEY,
        "WithdrawInvitation": _KEY,
        "LeaveRoom": _KEY,
        "RemoveMember": _KEY,
        "ListMembers": _KEY,
        "RegisterAgent": _KEY,
        "RenameAgent": _KEY,
        "RetireAgent": _KEY,
        "ListAgents": _KEY,
        "PostMessage": _KEY,
        "ListMessages": _KEY,
        "GetMessage": _KEY,
        "SendTask": _KEY,
        "UpdateTask": _KEY,
        "ListTasks": _KEY,
        "GetTask": _KEY,
        "ListMemory": _KEY,
        "UploadFile": _KEY,
        "ListFiles": _KEY,
        "SearchPassages": _KEY,
        "ListRuns": _KEY,
        "GetRun": _KEY,
        "SetAgentRights": _KEY,
        "GetAgentRights": _KEY,
        "ListApprovals": _KEY,
        "DecideApproval": _KEY,
        "WatchRoom": _KEY,
        "WatchRooms": _KEY,
        "CreateSessionKey": frozenset({COMPANY_KEY}),  # a session key cannot make another
        "EndSession": frozenset({SESSION_KEY}),  # a company key is revoked with `quayutec keys revoke`
        # A session key cannot make a company key: a key it made would outlive the session (docs/api.md).
        "CreateApiKey": frozenset({COMPANY_KEY}),
        "ListApiKeys": _KEY,
        "RevokeApiKey": _KEY,  # revoking grants nothing, so a session may stop a leaked key
        # Who signs the company's people in is the company's to say, never a signed-in person's.
        "SetSignInProvider": frozenset({COMPANY_KEY}),
        "GetSignInProvider": _KEY,
        "RemoveSignInProvider": frozenset({COMPANY_KEY}),
    },
    SIGNIN_SERVICE: {
        "FindSignInProvider": frozenset({ANYONE}),
        "CompleteSignIn": frozenset({ANYONE}),  # the provider's signed word, checked by the Gateway, is the key
    },
}
INTERNAL_SERVICES = (ROOM_SERVICE, CLAIMS_SERVICE, RUNTIME_SERVICE)
GATEWAY_CALLERS = {COMPANY_KEY, SESSION_KEY}
REFUSED_BY_AUTHZ = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}
# What an admitted caller must never see: a refusal, or no handler at all.
NOT_ADMITTED = {*REFUSED_BY_AUTHZ, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED}


@dataclass(frozen=True)
class Rpc:
    service: str  # "quayutec.v1.RoomService"
    method: descriptor.MethodDescriptor

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method.name}"

    @property
    def name(self) -> str:
        return f"{self.service}/{self.method.name}"

    async def outcome(
        self,
        channel: grpc.aio.Channel,
        metadata: tuple[tuple[str, str], ...] | None = None,
        message: Message | None = None,
    ) -> tuple[grpc.StatusCode, str]:
        """The status of the RPC called over ``channel`` with ``message`` (an empty request by
        default); OK for a stream that sent its first message."""
        request = message_factory.GetMessageClass(self.method.input_type)
        sent = message if message is not None else request()
        response = message_factory.GetMessageClass(self.method.output_type)
        codecs: dict[str, Any] = {
            "request_serializer": request.SerializeToString,
            "response_deserializer": response.FromString,
        }
        assert not self.method.client_streaming, f"{self.name}: this test sends single requests only"
        try:
            if not self.method.server_streaming:
                await channel.unary_unary(self.path, **codecs)(sent, timeout=10, metadata=metadata)
                return grpc.StatusCode.OK, ""
            call = channel.unary_stream(self.path, **codecs)(sent, timeout=10, metadata=metadata)
            try:
                async for _ in call:
                    break
            finally:
                call.cancel()
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""


def declared_rpcs() -> Iterator[Rpc]:
    """Every RPC of every service in every generated module of quayutec.v1 (a new proto file too)."""
    for module in pkgutil.iter_modules(quayutec.v1.__path__):
        if not module.name.endswith("_pb2"):
            continue
        file = import_module(f"quayutec.v1.{module.name}").DESCRIPTOR
        for service in file.services_by_name.values():
            for method in service.methods:
                yield Rpc(service.full_name, method)


def test_every_rpc_has_a_row_in_the_specification_and_every_row_an_rpc() -> None:
    declared = {rpc.name for rpc in declared_rpcs()}
    written = {f"{service}/{method}" for service, rows in SPEC.items() for method in rows}
    missing = sorted(declared - written)
    assert not missing, (
        f"RPCs with no row in tests/test_authz.py SPEC: {', '.join(missing)}. Write down who may call each "
        "(and give quayutec.authz.RPC_CALLERS the same entry for an internal service)."
    )
    gone = sorted(written - declared)
    assert not gone, f"rows in tests/test_authz.py SPEC for RPCs no proto declares: {', '.join(gone)}"
    for service, rows in SPEC.items():
        for method, callers in rows.items():
            assert callers, f"{service}/{method}: a row names at least one caller"
            known = set(IDENTITIES) if service in INTERNAL_SERVICES else GATEWAY_CALLERS | {ANYONE}
            assert callers <= known, f"{service}/{method}: unknown callers {sorted(callers - known)}"


def test_the_code_table_is_the_specification() -> None:
    """quayutec.authz.RPC_CALLERS admits exactly the specification's callers: no more, no fewer."""
    wrong: list[str] = []
    for service in INTERNAL_SERVICES:
        for method, callers in SPEC[service].items():
            path = f"/{service}/{method}"
            coded = RPC_CALLERS.get(path, frozenset())
            if wider := sorted(coded - callers):
                wrong.append(f"{path}: quayutec.authz admits {', '.join(wider)} beyond the specification")
            if narrower := sorted(callers - coded):
                wrong.append(f"{path}: quayutec.authz refuses {', '.join(narrower)}, whom the specification admits")
    internal = {f"/{service}/{method}" for service in INTERNAL_SERVICES for method in SPEC[service]}
    wrong += [f"{path}: quayutec.authz has an entry the specification does not" for path in set(RPC_CALLERS) - internal]
    assert not wrong, "\n".join(sorted(wrong))


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
    answering = [rpc for rpc in declared_rpcs() if _message_has_field(rpc.method.output_type, "provider_key", set())]
    assert {rpc.name for rpc in answering} == {f"{ROOM_SERVICE}/GetAgentCredentials", f"{ROOM_SERVICE}/ReadRunContext"}
    for rpc in answering:
        assert SPEC[rpc.service][rpc.method.name] == {RUNTIME}, rpc.name


@dataclass(frozen=True)
class Servers:
    room: str
    claims: str
    runtime: str

    def addr(self, service: str) -> str:
        return {ROOM_SERVICE: self.room, CLAIMS_SERVICE: self.claims, RUNTIME_SERVICE: self.runtime}[service]


@pytest.fixture
async def servers(database_url: str) -> AsyncIterator[Servers]:
    async with (
        running_claims(database_url) as claims_addr,
        running_room(database_url) as room_addr,
        running_runtime(claims_addr, room_addr, standin_url="http://127.0.0.1:9") as runtime_addr,
    ):
        yield Servers(room=room_addr, claims=claims_addr, runtime=runtime_addr)


def internal_rpcs() -> list[Rpc]:
    return [rpc for rpc in declared_rpcs() if rpc.service in INTERNAL_SERVICES]


async def test_every_internal_rpc_admits_exactly_its_callers(servers: Servers) -> None:
    """Each RPC of Room, Claims and Runtime, read from the descriptors, called as every identity on
    the running server: the specification's callers reach the handler, everyone else is refused."""
    rpcs = internal_rpcs()
    assert {rpc.service for rpc in rpcs} == set(INTERNAL_SERVICES)
    wrong: list[str] = []
    for service in INTERNAL_SERVICES:
        channels = {identity: service_channel(servers.addr(service), identity) for identity in IDENTITIES}
        try:
            for rpc in (r for r in rpcs if r.service == service):
                allowed = SPEC[service].get(rpc.method.name)
                if allowed is None:
                    wrong.append(f"{rpc.path}: no row in the specification")
                    continue
                for identity, channel in channels.items():
                    code, details = await rpc.outcome(channel)
                    if identity in allowed and code in NOT_ADMITTED:
                        wrong.append(f"{rpc.path} as {identity}: {code.name} {details}")
                    if identity not in allowed and (
                        code != grpc.StatusCode.PERMISSION_DENIED or identity not in details or rpc.path not in details
                    ):
                        wrong.append(f"{rpc.path} as {identity}: expected PERMISSION_DENIED, got {code.name} {details}")
        finally:
            for channel in channels.values():
                await channel.close()
    assert not wrong, "\n".join(wrong)


# A request each caller is judged on where the refusal comes after the request is checked (an empty
# one would be refused for itself first).
JUDGED_ON = {
    "CreateSessionKey": gateway_pb2.CreateSessionKeyRequest(ttl_seconds=600),
    # A well-formed key id no company has: the handler looks it up (NOT_FOUND) and revokes nothing.
    "RevokeApiKey": gateway_pb2.RevokeApiKeyRequest(key_id=str(uuid.uuid4())),
}
# RPCs that end the key they are called with: each call of one gets a fresh session key.
ENDS_ITS_KEY = {"EndSession"}
# How the Gateway refuses a key an RPC's row does not name.
GATEWAY_REFUSALS = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
}


def _bearer(secret: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {secret}"),)


async def test_every_gateway_rpc_admits_exactly_its_keys(database_url: str) -> None:
    """Each RPC of the public API, read from the descriptor, on a running Gateway: without a key, or
    with one that is not live, it is refused before any handler; a company's key and a session key
    are served where their row names them and refused where it does not."""
    rpcs = [rpc for rpc in declared_rpcs() if rpc.service == GATEWAY_SERVICE]
    assert rpcs
    unknown_key = f"qyk_{uuid.uuid4()}_not-a-secret"
    wrong: list[str] = []
    async with (
        running_room(database_url) as room_addr,
        running_gateway(
            database_url,
            room_addr,
            "127.0.0.1:9",
            QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false",
            QUAYUTEC_GATEWAY_POST_RATE="0",
            # Every RPC is called twice without a live key: no throttle of failed authentications.
            QUAYUTEC_GATEWAY_AUTH_FAILURE_RATE="0",
        ) as gateway_addr,
    ):
        acme = await make_company(database_url, room_addr, "Acme")

        async def session_key() -> str:
            async with authed_gateway(gateway_addr, acme.secret) as gw:
                made = await gw.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=3600), timeout=10)
            return str(made.secret)

        session = await session_key()
        async with grpc.aio.insecure_channel(gateway_addr) as channel:
            for rpc in rpcs:
                row = SPEC[GATEWAY_SERVICE].get(rpc.method.name)
                if row is None:
                    wrong.append(f"{rpc.path}: no row in the specification")
                    continue
                message = JUDGED_ON.get(rpc.method.name)
                for shown, metadata in (("no key", None), ("an unknown key", _bearer(unknown_key))):
                    code, details = await rpc.outcome(channel, metadata, message)
                    if code != grpc.StatusCode.UNAUTHENTICATED:
                        wrong.append(f"{rpc.path} with {shown}: expected UNAUTHENTICATED, got {code.name} {details}")
                for caller in (COMPANY_KEY, SESSION_KEY):
                    if caller == COMPANY_KEY:
                        secret = acme.secret
                    else:
                        secret = await session_key() if rpc.method.name in ENDS_ITS_KEY else session
                    code, details = await rpc.outcome(channel, _bearer(secret), message)
                    if caller in row and code in NOT_ADMITTED:
                        wrong.append(f"{rpc.path} with {caller}: {code.name} {details}")
                    if caller not in row and code not in GATEWAY_REFUSALS:
                        wrong.append(f"{rpc.path} with {caller}: expected a refusal, got {code.name} {details}")
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
                code, _ = await rpc.outcome(channel)
                assert code == grpc.StatusCode.UNAVAILABLE, rpc.path


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
