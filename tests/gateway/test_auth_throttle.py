"""Failed authentications are throttled per source address and per key id: beyond the burst they are
answered RESOURCE_EXHAUSTED (with the wait in the message and the retry-after-ms trailer) without
being checked when they carry no key, one log line per burst; an attempt with a key is always checked,
so the right secret is never locked out, whatever was guessed with its id from any address; memory
stays bounded."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import grpc
import pytest

from quayutec.throttle import AuthThrottle, ThrottleConfig, source_of
from quayutec.v1 import gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import NOWHERE
from tests.harness.gateway import CompanyKey, running_gateway

THROTTLE_LOG = "quayutec.gateway.auth"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_two_hundred_wrong_keys_are_throttled_with_one_log_line(
    database_url: str, room_addr: str, acme: CompanyKey, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, THROTTLE_LOG)
    async with (
        running_gateway(database_url, room_addr, NOWHERE, QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false") as addr,
        grpc.aio.insecure_channel(addr) as channel,
    ):
        gw = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def who(secret: str) -> grpc.aio.AioRpcError | None:
            try:
                await gw.WhoAmI(
                    gateway_pb2.WhoAmIRequest(), metadata=(("authorization", f"Bearer {secret}"),), timeout=10
                )
            except grpc.aio.AioRpcError as exc:
                return exc
            return None

        # The company's key works before the attack, so this replica knows it.
        assert await who(acme.secret) is None
        answers = [await who(f"qyk_{uuid.uuid4()}_{'x' * 43}") for _ in range(200)]
        codes = [a.code() if a else None for a in answers]
        # The default burst (20) is answered as usual; the rest is refused unchecked (the rate refills
        # about one a second, so a slow machine may see a few more checked).
        unauthenticated = codes.count(grpc.StatusCode.UNAUTHENTICATED)
        exhausted = [a for a in answers if a and a.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert codes[:20] == [grpc.StatusCode.UNAUTHENTICATED] * 20
        assert unauthenticated + len(exhausted) == 200 and len(exhausted) >= 100, codes
        refusal = exhausted[0]
        assert "too many failed authentications from your address" in (refusal.details() or "")
        assert "QUAYUTEC_GATEWAY_AUTH_FAILURE_BURST" in (refusal.details() or "")
        assert "retry after" in (refusal.details() or "")
        trailer = dict(refusal.trailing_metadata() or ())
        assert int(trailer["retry-after-ms"]) > 0
        # A key that works here is not locked out by its address's throttle.
        assert await who(acme.secret) is None
    lines = [r for r in caplog.records if "failed authentications at once" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # one line per burst, not per try
    assert "source:127.0.0.1" in lines[0].getMessage()


def test_a_key_id_is_throttled_from_any_address_yet_its_right_secret_is_always_checked() -> None:
    clock = Clock()
    log = logging.getLogger("test.throttle")
    throttle = AuthThrottle(
        ThrottleConfig(rate_per_second=1.0, burst=3, max_subjects=50), log, what="sign-ins", settings="S", clock=clock
    )
    key_id = str(uuid.uuid4())
    key = "key:" + key_id
    for n in range(3):  # three addresses, one key id
        assert throttle.refusal([f"source:10.0.0.{n}", key], key_id) is None
        assert throttle.failed([f"source:10.0.0.{n}", key]) is None
    # A fourth wrong secret, from a fourth address: refused as too many "with this key id".
    refused = throttle.failed(["source:10.0.0.9", key])
    assert refused is not None and "with this key id" in refused[1] and refused[0] == 1000
    # An attempt with a key is always checked (the right secret gets in); one with no key is refused
    # unchecked while its address is throttled.
    assert throttle.refusal(["source:10.0.0.9", key], key_id) is None
    for _ in range(3):
        throttle.failed(["source:10.0.0.9"])
    no_key = throttle.refusal(["source:10.0.0.9"], None)
    assert no_key is not None and "from your address" in no_key[1]
    clock.now += 10.0  # tokens back
    assert throttle.failed(["source:10.0.0.9", key]) is None
    # A flood of made-up key ids and addresses keeps at most max_subjects buckets.
    for n in range(10_000):
        throttle.failed([f"source:{n}", f"key:{n}"])
    assert len(throttle) <= 50


def test_sources_are_addresses_without_ports_and_ipv6_by_its_64() -> None:
    assert source_of("ipv4:127.0.0.1:54321") == "127.0.0.1"
    assert source_of("ipv6:[2001:db8:1:2:3:4:5:6]:443") == "2001:db8:1:2::/64"
    assert source_of("ipv6:[::1]:5") == "::/64"
    assert source_of("10.1.2.3") == "10.1.2.3"
    assert source_of("unix:/tmp/sock") == "unix:/tmp/sock"
    assert source_of("ipv6:[::ffff:127.0.0.1]:5") == "127.0.0.1"  # IPv4 through a dual-stack listener


async def test_a_throttled_stream_is_refused_with_the_retry_after_trailer_too(
    database_url: str, room_addr: str, acme: CompanyKey
) -> None:
    """WatchRoom and WatchRooms refused by the throttle carry the same retry-after-ms trailer as unary
    calls, so a client that resumes a watch waits as advised instead of hammering."""
    async with (
        running_gateway(
            database_url,
            room_addr,
            NOWHERE,
            QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false",
            QUAYUTEC_GATEWAY_AUTH_FAILURE_BURST="2",
            QUAYUTEC_GATEWAY_AUTH_FAILURE_RATE="0.01",
        ) as addr,
        grpc.aio.insecure_channel(addr) as channel,
    ):
        gw = gateway_pb2_grpc.GatewayServiceStub(channel)
        wrong = (("authorization", f"Bearer qyk_{uuid.uuid4()}_{'x' * 43}"),)
        room = str(uuid.uuid4())

        def open_stream(n: int) -> Any:
            if n % 2:
                return gw.WatchRooms(gateway_pb2.WatchRoomsRequest(), metadata=wrong, timeout=10)
            return gw.WatchRoom(gateway_pb2.WatchRoomRequest(room_id=room), metadata=wrong, timeout=10)

        codes = []
        for n in range(6):  # WatchRoom and WatchRooms in turn
            call = open_stream(n)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            codes.append(refused.value.code())
            if refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                trailers = [await call.trailing_metadata(), refused.value.trailing_metadata()]
                for trailer in (dict(t or ()) for t in trailers):
                    assert int(trailer["retry-after-ms"]) > 0, (n, trailer)
                assert "retry after" in (refused.value.details() or "")
        assert codes[:2] == [grpc.StatusCode.UNAUTHENTICATED] * 2
        assert codes[2:] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4, codes


async def test_a_hundred_wrong_secrets_with_a_keys_id_never_lock_the_right_secret_out(
    database_url: str, room_addr: str, acme: CompanyKey
) -> None:
    """On a fresh Gateway (it has never seen the key work, as after a restart): 100 wrong secrets with
    acme's key id from one address (IPv6 ::1), then the right secret from another (127.0.0.1) and from
    the same one: each served, while the guesses beyond the burst are told to back off."""
    key_id = acme.key_id
    async with running_gateway(
        database_url,
        room_addr,
        NOWHERE,
        QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false",
        QUAYUTEC_GATEWAY_LISTEN="[::]:0",
    ) as addr:
        port = addr.rpartition(":")[2]

        async def who(target: str, secret: str) -> grpc.StatusCode:
            async with grpc.aio.insecure_channel(target) as channel:
                try:
                    await gateway_pb2_grpc.GatewayServiceStub(channel).WhoAmI(
                        gateway_pb2.WhoAmIRequest(), metadata=(("authorization", f"Bearer {secret}"),), timeout=10
                    )
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
            return grpc.StatusCode.OK

        guesser = f"[::1]:{port}"
        async with grpc.aio.insecure_channel(guesser) as channel:
            gw = gateway_pb2_grpc.GatewayServiceStub(channel)
            codes = []
            for _ in range(100):
                try:
                    await gw.WhoAmI(
                        gateway_pb2.WhoAmIRequest(),
                        metadata=(("authorization", f"Bearer qyk_{key_id}_{'x' * 43}"),),
                        timeout=10,
                    )
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
        assert grpc.StatusCode.OK not in codes
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 50, codes  # the guesser is throttled
        assert await who(f"127.0.0.1:{port}", acme.secret) == grpc.StatusCode.OK  # the owner, elsewhere
        assert await who(guesser, acme.secret) == grpc.StatusCode.OK  # and from the guesser's own address
        # The guesser's next wrong secret is still refused as too many.
        assert await who(guesser, f"qyk_{key_id}_{'y' * 43}") == grpc.StatusCode.RESOURCE_EXHAUSTED
