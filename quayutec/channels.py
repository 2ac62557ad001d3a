"""Client channels between our services: one per target per process, retrying UNAVAILABLE only."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc

from quayutec.server import MAX_MESSAGE_BYTES

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


def internal_channel(
    target: str,
    *,
    retry_unavailable: bool = True,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[Any] = (),
) -> grpc.aio.Channel:
    """A channel to one of our internal services. ``retry_unavailable=False`` for a caller whose
    writes are not all idempotent (the Gateway), which must see UNAVAILABLE itself."""
    retries = [("grpc.enable_retries", 1), ("grpc.service_config", _SERVICE_CONFIG)] if retry_unavailable else []
    return grpc.aio.insecure_channel(
        target,
        options=[
            *retries,
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *options,
        ],
        interceptors=interceptors,
    )
