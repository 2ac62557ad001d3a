"""Client channels between our services: one per target per process, retrying UNAVAILABLE only.

Every channel is mutual TLS: it presents this process's identity and accepts only a server whose
certificate names the service it meant to reach (``server``), whatever host or address was dialled."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc

from quayutec.server import MAX_MESSAGE_BYTES
from quayutec.tls import Identity, MtlsConfig, load_identity

# Transparent retries of UNAVAILABLE alone (the call never reached a handler, or the handler's
# writes are idempotent through dedupe keys); everything else reaches the caller at once.
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{}],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


# A peer that falls silent (a partition, a host gone: no reset ever comes) is found out by a ping
# unanswered for KEEPALIVE_TIMEOUT_MS, sent every KEEPALIVE_MS: the connection is closed, its calls
# fail UNAVAILABLE, and a target naming several replicas sends its calls to the others meanwhile.
# Without it a silent peer's connection stays "ready" until TCP gives up, many minutes later.
KEEPALIVE_MS = 5_000
KEEPALIVE_TIMEOUT_MS = 5_000


def internal_channel(
    target: str,
    *,
    identity: Identity,
    server: str,
    retry_unavailable: bool = True,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[Any] = (),
) -> grpc.aio.Channel:
    """A channel to the internal service ``server`` ("room", "claims", "runtime") at ``target``,
    calling as ``identity``. ``retry_unavailable=False`` for a caller whose writes are not all
    idempotent (the Gateway), which must see UNAVAILABLE itself."""
    retries = [("grpc.enable_retries", 1), ("grpc.service_config", _SERVICE_CONFIG)] if retry_unavailable else []
    return grpc.aio.secure_channel(
        target,
        identity.channel_credentials(),
        options=[
            *retries,
            # The server's certificate must name the service we meant, not the host we dialled.
            ("grpc.ssl_target_name_override", server),
            # A target naming several replicas (``ipv4:a:port,b:port``, or a name resolving to many
            # addresses) spreads the calls over every one that is connected, not only the first.
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *options,
        ],
        interceptors=interceptors,
    )


def channel_as(
    target: str, *, identity: str, server: str, mtls: MtlsConfig | None = None, **kwargs: Any
) -> grpc.aio.Channel:
    """A channel to ``server`` at ``target`` as the identity named ``identity``, its certificate
    from ``mtls`` (by default the environment: the QUAYUTEC_MTLS_* files or the development PKI)."""
    return internal_channel(target, identity=load_identity(identity, mtls), server=server, **kwargs)
