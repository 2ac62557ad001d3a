"""Gateway settings from the environment, and TLS on the public port with a self-signed certificate."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quayutec.config import ConfigError
from quayutec.crypto import Fernet, InvalidToken
from quayutec.v1 import gateway_pb2
from services.gateway.config import DeliveryConfig, GatewayConfig
from tests.harness.gateway import authed_gateway, running_gateway, self_signed_tls

NOWHERE = "127.0.0.1:9"


def test_defaults() -> None:
    config = GatewayConfig.from_env({})
    assert config.server.listen == "[::]:50051"
    assert config.room_addr == "127.0.0.1:50052" and config.runtime_addr == "127.0.0.1:50054"
    assert not config.tls_enabled
    assert config.delivery.enabled and config.delivery.lease_seconds == 30
    assert config.delivery.poll_interval_seconds == 0.2
    assert config.delivery.backoff_base_seconds == 0.5 and config.delivery.backoff_ceiling_seconds == 30.0


def test_backoff_doubles_to_the_ceiling() -> None:
    delivery = DeliveryConfig()
    assert [delivery.retry_delay_seconds(n) for n in (1, 2, 3, 4, 7, 8, 100)] == [
        0.5,
        1.0,
        2.0,
        4.0,
        30.0,
        30.0,
        30.0,
    ]


@pytest.mark.parametrize("only", ["QUAYUTEC_GATEWAY_TLS_CERT", "QUAYUTEC_GATEWAY_TLS_KEY"])
def test_tls_needs_both_files(only: str) -> None:
    with pytest.raises(ConfigError) as err:
        GatewayConfig.from_env({only: "/etc/quayutec/tls/x.pem"})
    assert "QUAYUTEC_GATEWAY_TLS_CERT" in str(err.value) and "QUAYUTEC_GATEWAY_TLS_KEY" in str(err.value)


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"QUAYUTEC_GATEWAY_DELIVERY_ENABLED": "maybe"}, "QUAYUTEC_GATEWAY_DELIVERY_ENABLED"),
        ({"QUAYUTEC_GATEWAY_LEASE_SECONDS": "5"}, "QUAYUTEC_GATEWAY_START_RUN_TIMEOUT_SECONDS"),
        ({"QUAYUTEC_GATEWAY_DELIVERY_BATCH_SIZE": "501"}, "QUAYUTEC_GATEWAY_DELIVERY_BATCH_SIZE"),
        ({"QUAYUTEC_GATEWAY_POST_BURST": "0"}, "QUAYUTEC_GATEWAY_POST_BURST"),
        ({"QUAYUTEC_GATEWAY_POST_RATE": "fast"}, "QUAYUTEC_GATEWAY_POST_RATE"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        GatewayConfig.from_env(env)


async def test_tls_serves_only_tls(database_url: str, tmp_path: Path) -> None:
    cert_path, key_path, cert_pem = self_signed_tls(tmp_path)
    async with running_gateway(
        database_url,
        NOWHERE,
        NOWHERE,
        QUAYUTEC_GATEWAY_DELIVERY_ENABLED="false",
        QUAYUTEC_GATEWAY_TLS_CERT=str(cert_path),
        QUAYUTEC_GATEWAY_TLS_KEY=str(key_path),
    ) as addr:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert_pem)
        async with grpc.aio.secure_channel(addr, credentials) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            response = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        # The interceptor runs over TLS too.
        async with authed_gateway(addr, "nope", credentials=credentials) as gw:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gw.WhoAmI(gateway_pb2.WhoAmIRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Plaintext is refused.
        async with grpc.aio.insecure_channel(addr) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_unreadable_tls_files_are_a_config_error(database_url: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="QUAYUTEC_GATEWAY_TLS_CERT"):
        async with running_gateway(
            database_url,
            NOWHERE,
            NOWHERE,
            QUAYUTEC_GATEWAY_TLS_CERT=str(tmp_path / "missing.crt"),
            QUAYUTEC_GATEWAY_TLS_KEY=str(tmp_path / "missing.key"),
        ):
            pass


def test_sign_in_secrets_are_sealed_with_the_gateways_own_key(tmp_path: Path) -> None:
    own, rooms = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    env = {"QUAYUTEC_GATEWAY_ENCRYPTION_KEY": own, "QUAYUTEC_ENCRYPTION_KEY": rooms, "QUAYUTEC_DATA_DIR": str(tmp_path)}
    sealed = GatewayConfig.from_env(env).cipher.encrypt(b"client secret")
    assert Fernet(own.encode()).decrypt(sealed) == b"client secret"
    with pytest.raises(InvalidToken):
        Fernet(rooms.encode()).decrypt(sealed)
    # Without it (development), a key file of the Gateway's own in the data folder, kept across starts.
    dev = {"QUAYUTEC_DATA_DIR": str(tmp_path)}
    sealed = GatewayConfig.from_env(dev).cipher.encrypt(b"client secret")
    assert GatewayConfig.from_env(dev).cipher.decrypt(sealed) == b"client secret"
    assert (tmp_path / "gateway-encryption.key").is_file() and not (tmp_path / "encryption.key").exists()
    with pytest.raises(ConfigError, match="QUAYUTEC_GATEWAY_ENCRYPTION_KEY"):
        GatewayConfig.from_env({**dev, "QUAYUTEC_GATEWAY_ENCRYPTION_KEY": "not a key"})
