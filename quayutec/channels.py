"""Client channels between our services: one per target per process, retrying UNAVAILABLE only."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc

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


def internal_channel(target: str, *, interceptors: Sequence[Any] = ()) -> grpc.aio.Channel:
    """A channel to one of our internal services."""
    return grpc.aio.insecure_channel(
        target,
        options=[
            ("grpc.enable_retries", 1),
            ("grpc.service_config", _SERVICE_CONFIG),
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ("grpc.max_send_message_length", 16 * 1024 * 1024),
        ],
        interceptors=interceptors,
    )
