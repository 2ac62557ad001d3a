"""Channels from tests to the internal services (Room, Claims, Runtime).

Every test that talks to an internal service directly opens its channel here, naming the service
identity it stands for (``"gateway"``, ``"runtime"``, ``"admin"``...): the caller that would make
that call in production. One place to change when the services authenticate each other.
"""

from __future__ import annotations

from typing import Any

import grpc

IDENTITIES = ("gateway", "room", "claims", "runtime", "admin")


def service_channel(addr: str, identity: str, **kwargs: Any) -> grpc.aio.Channel:
    """A channel to the internal service at ``addr`` as the service ``identity``."""
    if identity not in IDENTITIES:
        raise ValueError(f"unknown identity {identity!r}; one of {', '.join(IDENTITIES)}")
    return grpc.aio.insecure_channel(addr, **kwargs)
