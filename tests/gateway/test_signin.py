"""Sign-in through a company's OpenID provider, from the API: a real provider (npm's oidc-provider) on
loopback, the Gateway redeeming its codes and checking its ID tokens, and each way a sign-in is refused."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import parse_qs, urlencode, urlsplit

import grpc
import pytest
from authlib.oauth2.rfc7636 import create_s256_code_challenge

from quayutec.v1 import gateway_pb2, signin_pb2, signin_pb2_grpc
from services.gateway.auth import CLIENT_ADDRESS_METADATA
from tests.gateway.conftest import NOWHERE
from tests.gateway.helpers import GatewayStub, create_room, expect_error
from tests.harness.channels import service_channel
from tests.harness.gateway import CompanyKey, authed_gateway, make_company, running_gateway, running_gateway_ports
from tests.harness.oidc import RunningProvider, authorize, running_provider
from tests.test_cli import client_env, quayutec, succeeding

# The provider sends the browser back here; nothing is dialled (the test reads the redirect).
REDIRECT = "http://127.0.0.1:9/signin/callback"
# The Gateway may call the loopback provider over plain http (the egress guard's allow-list).
LOOPBACK = {"QUAYUTEC_RUNTIME_EGRESS_ALLOW": "127.0.0.0/8"}
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture
async def gateway_addr(database_url: str, room_addr: str) -> AsyncIterator[str]:
    async with running_gateway(
        database_url,
        room_addr,
        NOWHERE,
        QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false",
        QUAYUTEC_GATEWAY_POST_RATE="0",
        **LOOPBACK,
    ) as addr:
        yield addr


@pytest.fixture
async def signin(gateway_addr: str) -> AsyncIterator[signin_pb2_grpc.SignInServiceStub]:
    async with grpc.aio.insecure_channel(gateway_addr) as channel:
        yield signin_pb2_grpc.SignInServiceStub(channel)


async def set_provider(gw: GatewayStub, provider: RunningProvider, *domains: str, api_keys: bool = False) -> None:
    await gw.SetSignInProvider(
        gateway_pb2.SetSignInProviderRequest(
            issuer=provider.issuer,
            client_id=provider.client_id,
            client_secret=provider.client_secret,
            email_domains=list(domains),
            allow_api_key_sign_in=api_keys,
        ),
        timeout=20,
    )


async def code_for(signin: signin_pb2_grpc.SignInServiceStub, who: str, login: str) -> tuple[str, dict[str, str]]:
    """Start a sign-in as the console does, go through the provider's pages, and answer the code and
    what the console kept (verifier, nonce, company)."""
    by = {"email": who} if "@" in who else {"company_name": who}
    found = await signin.FindSignInProvider(signin_pb2.FindSignInProviderRequest(**by), timeout=20)
    kept = {"verifier": secrets.token_urlsafe(48), "nonce": secrets.token_urlsafe(16), "company": found.company_id}
    state = secrets.token_urlsafe(16)
    query = {
        "response_type": "code",
        "client_id": found.client_id,
        "redirect_uri": REDIRECT,
        "scope": "openid email profile",
        "state": state,
        "nonce": kept["nonce"],
        "code_challenge": create_s256_code_challenge(kept["verifier"]),
        "code_challenge_method": "S256",
    }
    back = parse_qs(
        urlsplit(await authorize(f"{found.authorization_endpoint}?{urlencode(query)}", REDIRECT, login)).query
    )
    assert back["state"] == [state]
    return back["code"][0], kept


async def complete(
    signin: signin_pb2_grpc.SignInServiceStub, code: str, kept: dict[str, str], *, nonce: str | None = None
) -> signin_pb2.CompleteSignInResponse:
    done: signin_pb2.CompleteSignInResponse = await signin.CompleteSignIn(
        signin_pb2.CompleteSignInRequest(
            company_id=kept["company"],
            code=code,
            code_verifier=kept["verifier"],
            redirect_uri=REDIRECT,
            nonce=kept["nonce"] if nonce is None else nonce,
            ttl_seconds=600,
        ),
        timeout=20,
    )
    return done


async def test_a_person_signs_in_through_the_company_provider(
    gateway_addr: str, signin: signin_pb2_grpc.SignInServiceStub, acme: CompanyKey, acme_gw: GatewayStub
) -> None:
    async with running_provider([REDIRECT], names={"ana@acme.test": "Ana Lima"}) as provider:
        # No provider yet: the API key signs in, and the finder says no company serves the domain.
        await acme_gw.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=600), timeout=10)
        await expect_error(
            grpc.StatusCode.NOT_FOUND,
            signin.FindSignInProvider(signin_pb2.FindSignInProviderRequest(email="ana@acme.test"), timeout=10),
            "acme.test",
        )
        await set_provider(acme_gw, provider, "acme.test")
        got = await acme_gw.GetSignInProvider(gateway_pb2.GetSignInProviderRequest(), timeout=10)
        assert (
            got.found and got.provider.issuer == provider.issuer and list(got.provider.email_domains) == ["acme.test"]
        )
        assert provider.client_secret not in str(got)
        by_name = await signin.FindSignInProvider(signin_pb2.FindSignInProviderRequest(company_name="acme"), timeout=10)
        assert by_name.company_id == acme.company_id and by_name.authorization_endpoint.startswith(provider.issuer)
        # With a provider set, the API-key sign-in is off (unless the company keeps it on).
        await expect_error(
            grpc.StatusCode.FAILED_PRECONDITION,
            acme_gw.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=600), timeout=10),
            "API key is off",
        )

        code, kept = await code_for(signin, "ana@acme.test", "ana@acme.test")
        done = await complete(signin, code, kept)
        assert (done.person.name, done.person.email, done.person.issuer) == (
            "Ana Lima",
            "ana@acme.test",
            provider.issuer,
        )
        assert done.company_name == "Acme"
        async with authed_gateway(gateway_addr, done.secret) as person_gw:
            who = await person_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)
            assert who.company.company_id == acme.company_id
            # A person's sign-in cannot change the provider.
            await expect_error(DENIED, set_provider(person_gw, provider), "company API key")
            # The code was used once: the same code again is refused by the provider, said in words.
            await expect_error(DENIED, complete(signin, code, kept), "already used")
            # Removing the provider ends the sign-ins made through it.
            await acme_gw.RemoveSignInProvider(gateway_pb2.RemoveSignInProviderRequest(), timeout=10)
            await expect_error(
                grpc.StatusCode.UNAUTHENTICATED, person_gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)
            )
        await acme_gw.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=600), timeout=10)


async def test_refusals(
    signin: signin_pb2_grpc.SignInServiceStub, acme_gw: GatewayStub, globex_gw: GatewayStub
) -> None:
    async with running_provider([REDIRECT]) as provider:
        await set_provider(acme_gw, provider, "acme.test", api_keys=True)
        # Another company cannot claim a domain that is taken.
        await expect_error(grpc.StatusCode.ALREADY_EXISTS, set_provider(globex_gw, provider, "acme.test"), "acme.test")
        # The API-key sign-in stays on when the company keeps it on.
        await acme_gw.CreateSessionKey(gateway_pb2.CreateSessionKeyRequest(ttl_seconds=600), timeout=10)
        # A nonce other than the sign-in's.
        code, kept = await code_for(signin, "ana@acme.test", "ana@acme.test")
        await expect_error(DENIED, complete(signin, code, kept, nonce="another"), "nonce")
        # An email the provider vouches for, but outside the company's domains.
        code, kept = await code_for(signin, "ana@acme.test", "eve@elsewhere.test")
        await expect_error(DENIED, complete(signin, code, kept), "eve@elsewhere.test is not an email of Acme")


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("bad_signature", "signature does not match"),
        ("expired_id_token", "expired"),
        ("wrong_issuer", "/elsewhere', not by your company's provider"),
    ],
)
async def test_a_faulty_provider_is_refused(
    signin: signin_pb2_grpc.SignInServiceStub, acme_gw: GatewayStub, mode: str, says: str
) -> None:
    async with running_provider([REDIRECT], mode=mode) as provider:
        await set_provider(acme_gw, provider)
        code, kept = await code_for(signin, "Acme", "ana@acme.test")
        await expect_error(DENIED, complete(signin, code, kept), says)


async def test_a_verified_person_acts_only_as_themselves(
    gateway_addr: str, signin: signin_pb2_grpc.SignInServiceStub, acme_gw: GatewayStub
) -> None:
    room = await create_room(acme_gw, "verified")
    async with running_provider([REDIRECT], names={"ana@acme.test": "Ana Lima"}) as provider:
        await set_provider(acme_gw, provider, "acme.test")
        code, kept = await code_for(signin, "ana@acme.test", "ana@acme.test")
        done = await complete(signin, code, kept)
    async with authed_gateway(gateway_addr, done.secret) as ana:
        # Another name is refused, for a post, a task and a decision alike.
        post = gateway_pb2.PostMessageRequest(room_id=room.room_id, person="Bob", body="as Bob")
        await expect_error(DENIED, ana.PostMessage(post, timeout=10), "this sign-in is Ana Lima's")
        decide = gateway_pb2.DecideApprovalRequest(token=str(uuid.uuid4()), index=0, person="Bob", approve=True)
        await expect_error(DENIED, ana.DecideApproval(decide, timeout=10), "cannot act as 'Bob'")
        # No name, or the verified one: recorded as Ana, verified by the provider.
        for person in ("", "Ana Lima"):
            sent = await ana.PostMessage(
                gateway_pb2.PostMessageRequest(room_id=room.room_id, person=person, body="hello"), timeout=10
            )
            assert (sent.message.author.person, sent.message.author.verified_by) == ("Ana Lima", provider.issuer)
    # The company's service names whom it likes: recorded as stated (no verifier).
    stated = await acme_gw.PostMessage(
        gateway_pb2.PostMessageRequest(room_id=room.room_id, person="Bob", body="from the service"), timeout=10
    )
    assert (stated.message.author.person, stated.message.author.verified_by) == ("Bob", "")
    listed = await acme_gw.ListMessages(gateway_pb2.ListMessagesRequest(room_id=room.room_id), timeout=10)
    assert [(m.author.person, m.author.verified_by) for m in listed.messages] == [
        ("Ana Lima", provider.issuer),
        ("Ana Lima", provider.issuer),
        ("Bob", ""),
    ]


async def test_the_provider_is_set_from_the_command_line(
    database_url: str, room_addr: str, gateway_addr: str, acme: CompanyKey
) -> None:
    env = {**client_env(database_url, room_addr, gateway_addr), "QUAYUTEC_API_KEY": acme.secret}
    async with running_provider([REDIRECT]) as provider:
        args = ("sign-in", "set", "--issuer", provider.issuer, "--client-id", provider.client_id)
        no_secret = await quayutec(*args, env=env)
        assert no_secret.returncode != 0 and "QUAYUTEC_SIGNIN_CLIENT_SECRET" in no_secret.stderr
        ok = succeeding({**env, "QUAYUTEC_SIGNIN_CLIENT_SECRET": provider.client_secret})
        said = await ok(*args, "--domain", "acme.test", "--domain", "@Acme.example")
        assert said.splitlines() == [
            f"issuer {provider.issuer}",
            f"client id {provider.client_id}",
            "email domains acme.test, acme.example",
            "API-key sign-in off",
        ]
        assert (await ok("sign-in", "show")) == said
        assert provider.client_secret not in said
        unreadable = await quayutec(
            "sign-in", "set", "--issuer", "http://127.0.0.1:9", "--client-id", "x",
            env={**env, "QUAYUTEC_SIGNIN_CLIENT_SECRET": "s"},
        )  # fmt: skip
        assert unreadable.returncode != 0
        assert "FAILED_PRECONDITION" in unreadable.stderr, unreadable.stderr
        assert (await ok("sign-in", "remove")).strip() == "removed; its sign-ins are ended"
        assert "no sign-in provider" in await ok("sign-in", "show")


async def test_an_unverified_email_is_refused_where_the_company_admits_only_its_domains(
    signin: signin_pb2_grpc.SignInServiceStub, acme_gw: GatewayStub
) -> None:
    """Issue 35: an ID token saying email_verified false does not pass an email-domain rule; with no
    such rule the person signs in, and the unverified address is not kept as theirs."""
    async with running_provider([REDIRECT], unverified=["ana@acme.test"]) as provider:
        await set_provider(acme_gw, provider, "acme.test")
        code, kept = await code_for(signin, "Acme", "ana@acme.test")
        await expect_error(DENIED, complete(signin, code, kept), "your email address is not verified")
        await set_provider(acme_gw, provider)
        code, kept = await code_for(signin, "Acme", "ana@acme.test")
        done = await complete(signin, code, kept)
        assert (done.person.name, done.person.email) == ("ana@acme.test", "")


async def test_companies_whose_names_differ_only_in_case_cannot_both_have_a_provider(
    database_url: str, room_addr: str, gateway_addr: str, signin: signin_pb2_grpc.SignInServiceStub, acme: CompanyKey
) -> None:
    """People find a provider by company name without regard to case: a second "ACME" is told so
    (ALREADY_EXISTS), and Acme's provider stays as it was."""
    shouting = await make_company(database_url, room_addr, "ACME")
    async with (
        running_provider([REDIRECT]) as provider,
        authed_gateway(gateway_addr, acme.secret) as acme_gw,
        authed_gateway(gateway_addr, shouting.secret) as shouting_gw,
    ):
        await set_provider(acme_gw, provider)
        await expect_error(grpc.StatusCode.ALREADY_EXISTS, set_provider(shouting_gw, provider), "only in case")
        got = await shouting_gw.GetSignInProvider(gateway_pb2.GetSignInProviderRequest(), timeout=10)
        assert not got.found
        found = await signin.FindSignInProvider(signin_pb2.FindSignInProviderRequest(company_name="acme"), timeout=20)
        assert found.company_id == acme.company_id


async def test_failed_sign_ins_are_throttled_per_address_and_a_right_code_still_signs_in(
    database_url: str, room_addr: str, acme: CompanyKey
) -> None:
    """Issue 35: CompleteSignIn failures count against the caller's address and the company (burst 2
    here); past the burst a failure is answered RESOURCE_EXHAUSTED with when to retry, yet every
    attempt is still checked, so a right code signs in."""
    async with (
        running_gateway(
            database_url, room_addr, NOWHERE,
            QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false", QUAYUTEC_GATEWAY_POST_RATE="0",
            QUAYUTEC_GATEWAY_AUTH_FAILURE_BURST="2", QUAYUTEC_GATEWAY_AUTH_FAILURE_RATE="0.001", **LOOPBACK,
        ) as addr,
        grpc.aio.insecure_channel(addr) as channel,
        authed_gateway(addr, acme.secret) as acme_gw,
        running_provider([REDIRECT]) as provider,
    ):  # fmt: skip
        signin = signin_pb2_grpc.SignInServiceStub(channel)
        await set_provider(acme_gw, provider)
        nowhere = {"company": str(uuid.uuid4()), "verifier": "v" * 43, "nonce": "n"}
        await expect_error(grpc.StatusCode.NOT_FOUND, complete(signin, "a-code", nowhere), "no sign-in provider")
        code, kept = await code_for(signin, "Acme", "ana@acme.test")
        await expect_error(DENIED, complete(signin, code, kept, nonce="another"), "nonce")
        # Two failures from this address: the third is answered "too many", with a retry-after.
        code, kept = await code_for(signin, "Acme", "ana@acme.test")
        with pytest.raises(grpc.aio.AioRpcError) as third:
            await complete(signin, code, kept, nonce="another")
        assert third.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too many failed sign-ins from your address" in str(third.value.details())
        trailers = dict(third.value.trailing_metadata() or ())
        assert int(trailers["retry-after-ms"]) > 0, trailers
        # The right code still signs in.
        code, kept = await code_for(signin, "Acme", "ana@acme.test")
        done = await complete(signin, code, kept)
        assert done.person.email == "ana@acme.test"

        # From another address (127.0.0.2): its own failures are its own, but Acme's are past the burst.
        async with from_address("127.0.0.2", addr) as other_addr, grpc.aio.insecure_channel(other_addr) as other:
            elsewhere = signin_pb2_grpc.SignInServiceStub(other)
            await expect_error(grpc.StatusCode.NOT_FOUND, complete(elsewhere, "a-code", nowhere))
            acme_company = {**nowhere, "company": acme.company_id}
            await expect_error(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                complete(elsewhere, "not-a-code", acme_company),
                "too many failed sign-ins for this company",
            )


@asynccontextmanager
async def from_address(source: str, target: str) -> AsyncIterator[str]:
    """A loopback TCP relay whose connections reach ``target`` from the address ``source``: the Gateway
    sees another caller. Yields the relay's own address."""
    host, _, port = target.rpartition(":")

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def test_the_console_passes_on_its_browsers_addresses_and_no_one_else_can(
    database_url: str, room_addr: str, acme: CompanyKey
) -> None:
    """Issue 34, finding 4: on the Gateway's console port, a caller with the console's certificate
    passes on each browser's address (x-quayutec-client-address), and failed sign-ins count against
    that browser, not the console: one browser past the burst (2 here) leaves another's attempts
    answered as its own, and a right code still signs in. The entry is ignored from a caller without
    the console's certificate: on the public port, or on the console port with another identity's."""
    async with (
        running_gateway_ports(
            database_url, room_addr, NOWHERE,
            QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false", QUAYUTEC_GATEWAY_POST_RATE="0",
            QUAYUTEC_GATEWAY_AUTH_FAILURE_BURST="2", QUAYUTEC_GATEWAY_AUTH_FAILURE_RATE="0.001", **LOOPBACK,
        ) as (public_addr, console_addr),
        service_channel(console_addr, "console", options=[("grpc.ssl_target_name_override", "gateway")]) as console,
        service_channel(console_addr, "admin", options=[("grpc.ssl_target_name_override", "gateway")]) as admin,
        authed_gateway(public_addr, acme.secret) as acme_gw,
        running_provider([REDIRECT]) as provider,
    ):  # fmt: skip
        await set_provider(acme_gw, provider)
        via_console = signin_pb2_grpc.SignInServiceStub(console)

        async def nowhere(stub: signin_pb2_grpc.SignInServiceStub, browser: str) -> grpc.StatusCode:
            """A sign-in for a company with no provider: a failure counted against the source alone."""
            try:
                await stub.CompleteSignIn(
                    signin_pb2.CompleteSignInRequest(
                        company_id=str(uuid.uuid4()), code="c", code_verifier="v" * 43, redirect_uri=REDIRECT,
                        nonce="n", ttl_seconds=600,
                    ),
                    metadata=((CLIENT_ADDRESS_METADATA, browser),),
                    timeout=20,
                )  # fmt: skip
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        missing, too_many = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED
        # Browser 127.0.0.2 through the console: past its burst, told to back off.
        assert [await nowhere(via_console, "127.0.0.2") for _ in range(4)] == [missing, missing, too_many, too_many]
        # Browser 127.0.0.3 through the same console: its failures are its own.
        assert await nowhere(via_console, "127.0.0.3") == missing
        # The right code still signs in, for the throttled browser too.
        code, kept = await code_for(via_console, "Acme", "ana@acme.test")
        done = await via_console.CompleteSignIn(
            signin_pb2.CompleteSignInRequest(
                company_id=kept["company"], code=code, code_verifier=kept["verifier"], redirect_uri=REDIRECT,
                nonce=kept["nonce"], ttl_seconds=600,
            ),
            metadata=((CLIENT_ADDRESS_METADATA, "127.0.0.2"),),
            timeout=20,
        )  # fmt: skip
        assert done.person.email == "ana@acme.test"

        # Another identity on the console port (127.0.0.1): each attempt names another browser, yet
        # all count against its own address.
        as_admin = signin_pb2_grpc.SignInServiceStub(admin)
        answers = [await nowhere(as_admin, f"127.0.0.{n}") for n in (10, 11, 12)]
        assert answers == [missing, missing, too_many], answers
        # A client with no certificate on the public port (from 127.0.0.4), the same.
        async with from_address("127.0.0.4", public_addr) as relay, grpc.aio.insecure_channel(relay) as plain:
            anyone = signin_pb2_grpc.SignInServiceStub(plain)
            answers = [await nowhere(anyone, f"127.0.0.{n}") for n in (20, 21, 22)]
            assert answers == [missing, missing, too_many], answers
