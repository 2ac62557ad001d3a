"""An owner's base_url is checked at registration against the egress rules (issue 9 item 4).

Names resolve through a table (tests.harness.egress): no DNS query leaves the machine and the Room
never connects to the address it checks.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from quayutec.config import ROOM
from quayutec.v1 import common_pb2, room_pb2, room_pb2_grpc
from tests.harness.channels import callers_stub
from tests.harness.egress import PUBLIC, TableResolver
from tests.harness.room import running_room
from tests.room.conftest import Stub, expect_error, make_company

INVALID = grpc.StatusCode.INVALID_ARGUMENT

TABLE = {
    "models.acme.test": (PUBLIC,),
    "loop.test": ("127.0.0.1",),
    "loop6.test": ("::1",),
    "intranet.test": ("10.0.0.5",),
    "home.test": ("192.168.1.20",),
    "ula.test": ("fd12:3456::1",),
    "cgnat.test": ("100.64.1.1",),
    "metadata.test": ("169.254.169.254",),
    "metadata6.test": ("fd00:ec2::254",),
    "alibaba.test": ("100.100.100.200",),
    "linklocal.test": ("169.254.10.10",),
    "linklocal6.test": ("fe80::1",),
    "mapped.test": ("::ffff:127.0.0.1",),
    "multicast.test": ("224.0.0.251",),
    "multicast6.test": ("ff02::1",),
    "zero.test": ("0.0.0.0",),
    "zero6.test": ("::",),
    "split.test": (PUBLIC, "10.9.8.7"),  # one bad answer among good ones is enough to refuse
}

# (url, the rule the caller is told, the precise class our log names). A host *name* is told only
# "non_public": naming the class or the address would map what internal names resolve to; an
# address given literally is named with its class (that tells the caller nothing new).
REFUSED = [
    ("https://loop.test/v1", "non_public", "loopback"),
    ("https://loop6.test/v1", "non_public", "loopback"),
    ("https://127.0.0.1:8443/v1", "loopback", "loopback"),
    ("https://[::1]/v1", "loopback", "loopback"),
    ("https://mapped.test/v1", "non_public", "loopback"),
    ("https://intranet.test/v1", "non_public", "private"),
    ("https://home.test/v1", "non_public", "private"),
    ("https://ula.test/v1", "non_public", "private"),
    ("https://cgnat.test/v1", "non_public", "private"),
    ("https://split.test/v1", "non_public", "private"),
    ("https://metadata.test/latest", "non_public", "metadata"),
    ("https://169.254.169.254/latest", "metadata", "metadata"),
    ("https://metadata6.test/latest", "non_public", "metadata"),
    ("https://alibaba.test/latest", "non_public", "metadata"),
    ("https://linklocal.test/v1", "non_public", "link_local"),
    ("https://linklocal6.test/v1", "non_public", "link_local"),
    ("https://multicast.test/v1", "non_public", "multicast"),
    ("https://multicast6.test/v1", "non_public", "multicast"),
    ("https://zero.test/v1", "non_public", "unspecified"),
    ("https://zero6.test/v1", "non_public", "unspecified"),
    ("https://0.0.0.0/v1", "unspecified", "unspecified"),
    ("http://models.acme.test/v1", "plain_http", "plain_http"),
]


@pytest.fixture
async def resolver() -> TableResolver:
    return TableResolver(TABLE)


@pytest.fixture
async def room_as_gateway(database_url: str, resolver: TableResolver) -> AsyncIterator[Stub]:
    """RoomService, each RPC as its production caller (RegisterAgent as the Gateway, companies as admin)."""
    async with (
        running_room(database_url, resolver=resolver) as addr,
        callers_stub(addr, ROOM.grpc_service, room_pb2_grpc.RoomServiceStub) as stub,
    ):
        yield stub


def registration(company_id: str, base_url: str) -> room_pb2.RoomServiceRegisterAgentRequest:
    # Named after its address: a company's agent names are unique.
    return room_pb2.RoomServiceRegisterAgentRequest(
        company_id=company_id,
        name=f"own {base_url}",
        provider=common_pb2.PROVIDER_OPENAI_COMPATIBLE,
        model="own-1",
        base_url=base_url,
        provider_key="sk-own",
    )


@pytest.mark.parametrize(("url", "rule", "cause"), REFUSED)
async def test_a_refused_address_is_invalid_argument_naming_the_rule(
    room_as_gateway: Stub, url: str, rule: str, cause: str, caplog: pytest.LogCaptureFixture
) -> None:
    acme = await make_company(room_as_gateway)
    with caplog.at_level(logging.INFO):
        details = await expect_error(
            INVALID, room_as_gateway.RegisterAgent(registration(acme.company_id, url)), f"({rule})"
        )
    assert "QUAYUTEC_RUNTIME_EGRESS_ALLOW" in details or rule == "scheme"
    listed = await room_as_gateway.ListAgents(room_pb2.RoomServiceListAgentsRequest(company_id=acme.company_id))
    assert not listed.agents
    # One line in our log, without a traceback, naming the precise class for the operator.
    (line,) = [r for r in caplog.records if "RegisterAgent refused" in r.getMessage()]
    assert line.exc_info is None and f"({cause})" in line.getMessage() and acme.company_id in line.getMessage()
    assert [r for r in caplog.records if r.exc_info] == []


async def test_a_public_https_address_is_registered(room_as_gateway: Stub, resolver: TableResolver) -> None:
    acme = await make_company(room_as_gateway)
    got = await room_as_gateway.RegisterAgent(registration(acme.company_id, "https://models.acme.test/v1"))
    assert got.agent.base_url == "https://models.acme.test/v1"
    assert ("models.acme.test", 443) in resolver.asked


async def test_a_name_that_does_not_resolve_is_invalid_argument(room_as_gateway: Stub) -> None:
    acme = await make_company(room_as_gateway)
    await expect_error(
        INVALID, room_as_gateway.RegisterAgent(registration(acme.company_id, "https://nowhere.test/v1")), "resolve"
    )


async def test_the_allow_list_admits_listed_networks_and_hosts(database_url: str, resolver: TableResolver) -> None:
    allow = "10.0.0.0/8, home.test, 169.254.169.254/32"
    async with (
        running_room(database_url, resolver=resolver, QUAYUTEC_RUNTIME_EGRESS_ALLOW=allow) as addr,
        callers_stub(addr, ROOM.grpc_service, room_pb2_grpc.RoomServiceStub) as room,
    ):
        acme = await make_company(room)
        for url in (
            "https://intranet.test/v1",  # 10.0.0.5, inside 10.0.0.0/8
            "http://intranet.test/v1",  # plain http: every address is listed
            "http://10.1.2.3:8000/v1",
            "https://home.test/v1",  # listed by name
            "http://home.test/v1",
            "https://169.254.169.254/v1",  # listed on purpose by the operator
        ):
            got = await room.RegisterAgent(registration(acme.company_id, url))
            assert got.agent.base_url == url
        # split.test answers PUBLIC and 10.9.8.7: the one is public, the other listed.
        assert (await room.RegisterAgent(registration(acme.company_id, "https://split.test/v1"))).agent.base_url
        # What the list does not name stays refused.
        for url, rule in (
            ("https://loop.test/v1", "non_public"),
            ("https://metadata6.test/v1", "non_public"),
            ("http://models.acme.test/v1", "plain_http"),
        ):
            await expect_error(INVALID, room.RegisterAgent(registration(acme.company_id, url)), f"({rule})")


@pytest.mark.parametrize("host", [h for h in TABLE if h != "models.acme.test"])
async def test_the_message_never_says_what_a_name_resolves_to(room_as_gateway: Stub, host: str) -> None:
    """No DNS oracle: whatever class of address an internal name has, the answer is the same words
    with the host swapped, and holds none of its addresses."""
    acme = await make_company(room_as_gateway)
    details = await expect_error(
        INVALID, room_as_gateway.RegisterAgent(registration(acme.company_id, f"https://{host}/")), "base_url"
    )
    assert details.replace(host, "HOST") == (
        "base_url refused (non_public): HOST resolves to a non-public address; model requests go to public "
        "addresses only (an operator can admit it with QUAYUTEC_RUNTIME_EGRESS_ALLOW)"
    )
    for address in TABLE[host]:
        assert address not in details


async def test_an_unresolvable_host_is_one_line_without_a_traceback(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A host the resolver cannot answer for now: UNAVAILABLE (try again), one log line, no traceback."""
    resolver = TableResolver(TABLE, temporary={"flaky.test"})
    async with (
        running_room(database_url, resolver=resolver) as addr,
        callers_stub(addr, ROOM.grpc_service, room_pb2_grpc.RoomServiceStub) as room,
    ):
        acme = await make_company(room)
        with caplog.at_level(logging.INFO):
            for _ in range(3):
                await expect_error(
                    grpc.StatusCode.UNAVAILABLE,
                    room.RegisterAgent(registration(acme.company_id, "https://flaky.test/v1")),
                    "try again later",
                )
    lines = [r for r in caplog.records if "RegisterAgent refused" in r.getMessage()]
    assert len(lines) == 3
    assert [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR] == []
