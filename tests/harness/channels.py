"""Channels from tests to the internal services (Room, Claims, Runtime).

Every test that talks to an internal service directly opens its channel here, naming the service
identity it stands for (``"gateway"``, ``"runtime"``, ``"admin"``...): the caller that would make
that call in production. The channel presents that identity's certificate from the test PKI
(``TEST_MTLS``), the same one the harness servers serve with.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import grpc

from quayutec.authz import CALLER_PREFERENCE, CallersStub
from quayutec.tls import CA_ENV, CERT_ENV, IDENTITIES, KEY_ENV, Identity, MtlsConfig, ensure_dev_pki, load_identity

# One development PKI for every test session of this user (made once, under a lock, reused; the
# folder name says its layout, so sessions of an older layout keep theirs).
TEST_MTLS = MtlsConfig.dev(Path(tempfile.gettempdir()) / f"qy-test-pki2-{os.getuid()}")


def make_test_pki() -> None:
    """The tests play the admin tooling: they make the test PKI the servers they start read."""
    ensure_dev_pki(TEST_MTLS.pki_dir)


def pki_identity(identity: str) -> Identity:
    """The certificate and key of ``identity`` in the test PKI."""
    if identity not in IDENTITIES:
        raise ValueError(f"unknown identity {identity!r}; one of {', '.join(IDENTITIES)}")
    make_test_pki()
    return load_identity(identity, TEST_MTLS)


def mtls_env(identity: str) -> dict[str, str]:
    """The QUAYUTEC_MTLS_* settings that make a child process ``identity`` of the test PKI."""
    pki_identity(identity)
    ca, cert, key = TEST_MTLS.identity_files(identity)
    return {CA_ENV: str(ca), CERT_ENV: str(cert), KEY_ENV: str(key)}


def service_channel(addr: str, identity: str, **kwargs: Any) -> grpc.aio.Channel:
    """A channel to the internal service at ``addr`` ("127.0.0.1:PORT") as the service ``identity``."""
    return grpc.aio.secure_channel(addr, pki_identity(identity).channel_credentials(), **kwargs)


@asynccontextmanager
async def callers_stub(addr: str, service: str, stub_class: Callable[[grpc.aio.Channel], Any]) -> AsyncIterator[Any]:
    """Yields a ``CallersStub`` of ``service`` ("quayutec.v1.RoomService") at ``addr``."""
    async with AsyncExitStack() as stack:
        stubs = {}
        for identity in CALLER_PREFERENCE:
            channel = await stack.enter_async_context(service_channel(addr, identity))
            stubs[identity] = stub_class(channel)
        yield CallersStub(service, stubs)


def open_callers_stub(addr: str, service: str, stub_class: Callable[[grpc.aio.Channel], Any]) -> tuple[Any, list[Any]]:
    """A ``CallersStub`` and the channels it holds (the caller closes them)."""
    channels = [service_channel(addr, identity) for identity in CALLER_PREFERENCE]
    stub = CallersStub(service, {i: stub_class(c) for i, c in zip(CALLER_PREFERENCE, channels, strict=True)})
    return stub, channels
