"""Where an owner-supplied model address may take us: the egress policy and the guarded transport.

An agent's owner names a ``base_url``; without a check, the Runtime would POST to any address it can
reach, internal ones included. The policy: ``https`` only (plain ``http`` for listed hosts), and every
address the host resolves to must be a public one, unless the operator's allow-list
(``QUAYUTEC_RUNTIME_EGRESS_ALLOW``: CIDRs and host names) lists it. The Room applies it when an agent
is registered; the Runtime applies it again to the address it actually dials (``EgressTransport``),
so a name that resolves differently later (DNS rebinding) gains nothing. TLS is still verified
against the URL's host name.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx

from quayutec.config import ConfigError, env_str
from quayutec.settings import setting

EGRESS_ALLOW_ENV = "QUAYUTEC_RUNTIME_EGRESS_ALLOW"

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# ``host, port`` → the addresses the name stands for (text form, as getaddrinfo gives them).
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

# Cloud instance metadata and host-agent endpoints: credentials live behind these.
METADATA_ADDRESSES: frozenset[Address] = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OCI, DigitalOcean, OpenStack
        "169.254.170.2",  # AWS ECS task metadata
        "169.254.169.253",  # AWS VPC DNS
        "fd00:ec2::254",  # AWS IMDS over IPv6
        "fd00:ec2::253",  # AWS VPC DNS over IPv6
        "100.100.100.200",  # Alibaba Cloud
        "168.63.129.16",  # Azure WireServer
        "192.0.0.192",  # Oracle Cloud (classic)
    )
)

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT: internal to a provider's network

# The refused classes, each with the words an error message uses for it.
RULES: Mapping[str, str] = {
    "metadata": "a cloud metadata address",
    "unspecified": "an unspecified address",
    "loopback": "a loopback address",
    "link_local": "a link-local address",
    "multicast": "a multicast address",
    "private": "a private address",
    "reserved": "a reserved (non-public) address",
    # What a refused host *name* is told, whatever class its address falls in: naming the class or
    # the address would let a caller map what internal names resolve to.
    "non_public": "a non-public address",
}

RESOLVE_TIMEOUT_SECONDS = 5.0


class EgressRefused(Exception):
    """The policy refuses this destination; ``rule`` names which rule (``scheme``, ``loopback``, ...).

    ``rule`` and ``message`` may be shown to whoever named the destination: for a host name they
    say only ``non_public``, never the address nor its class. ``cause`` is the precise class, for
    our own logs."""

    def __init__(self, rule: str, message: str, *, cause: str | None = None) -> None:
        super().__init__(message)
        self.rule = rule
        self.message = message
        self.cause = cause or rule


class ResolutionFailed(Exception):
    """The host name could not be resolved; ``temporary`` when trying again later may help."""

    def __init__(self, host: str, temporary: bool, reason: str) -> None:
        super().__init__(f"{host} does not resolve ({reason})")
        self.host = host
        self.temporary = temporary


def address_class(address: Address) -> str | None:
    """The refused class ``address`` falls in (a key of ``RULES``), or None for a public address.

    IPv6 forms that carry an IPv4 address (mapped, 6to4, NAT64) are judged by that address."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            return address_class(embedded)
    if address in METADATA_ADDRESSES:
        return "metadata"
    if address.is_unspecified:
        return "unspecified"
    if address.is_loopback:
        return "loopback"
    if address.is_link_local:
        return "link_local"
    if address.is_multicast:
        return "multicast"
    if address.is_private or (isinstance(address, ipaddress.IPv4Address) and address in _SHARED):
        return "private"
    if address.is_reserved or not address.is_global:
        return "reserved"
    return None


def _parse_address(text: str) -> Address | None:
    try:
        return ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def _normal_host(host: str) -> str:
    return host.strip("[]").rstrip(".").lower()


@dataclass(frozen=True)
class EgressPolicy:
    """The operator's allow-list; everything else follows the fixed rules of this module."""

    allow_networks: tuple[Network, ...] = ()
    allow_hosts: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def parse(cls, raw: str, name: str = EGRESS_ALLOW_ENV) -> EgressPolicy:
        """``raw`` is a comma list of CIDRs (or single addresses) and host names."""
        networks: list[Network] = []
        hosts: set[str] = set()
        for entry in (e.strip() for e in raw.split(",")):
            if not entry:
                continue
            if _parse_address(entry) is not None or "/" in entry:
                try:
                    networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                except ValueError as exc:
                    raise ConfigError(f"{name}: {entry!r} is not a valid CIDR ({exc})") from None
                continue
            host = _normal_host(entry)
            if not host or any(c.isspace() or c in "/:@*" for c in host):
                raise ConfigError(f"{name}: {entry!r} is neither a CIDR nor a host name")
            hosts.add(host)
        return cls(allow_networks=tuple(networks), allow_hosts=frozenset(hosts))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EgressPolicy:
        env = os.environ if env is None else env
        return cls.parse(env_str(env, setting(EGRESS_ALLOW_ENV)))

    def host_listed(self, host: str) -> bool:
        return _normal_host(host) in self.allow_hosts

    def address_listed(self, address: Address) -> bool:
        return any(address.version == n.version and address in n for n in self.allow_networks)

    @staticmethod
    def check_scheme(scheme: str) -> None:
        """Only ``https`` and ``http``; whether plain ``http`` may go to a host is decided per
        address by ``check_address`` (listed host name, or an address inside a listed network)."""
        if scheme not in ("https", "http"):
            raise EgressRefused("scheme", f"the scheme must be https, not {scheme or 'none'}")

    def check_address(self, host: str, address: Address, *, plain_http: bool) -> None:
        """Refuse ``address`` (what ``host`` resolved to) unless it is public or listed; over plain
        http it must be listed."""
        if self.host_listed(host) or self.address_listed(address):
            return
        if plain_http:
            raise EgressRefused(
                "plain_http",
                f"plain http is allowed only for hosts on the allow-list ({EGRESS_ALLOW_ENV}); use https",
            )
        rule = address_class(address)
        if rule is None:
            return
        advice = f"model requests go to public addresses only (an operator can admit it with {EGRESS_ALLOW_ENV})"
        if _parse_address(host) is not None:  # the caller gave the address: naming its class tells nothing new
            raise EgressRefused(rule, f"{host} is {RULES[rule]}; {advice}")
        raise EgressRefused("non_public", f"{host} resolves to {RULES['non_public']}; {advice}", cause=rule)

    async def admitted_addresses(
        self,
        host: str,
        port: int,
        resolver: Resolver,
        *,
        plain_http: bool,
        resolve_seconds: float | None = RESOLVE_TIMEOUT_SECONDS,
    ) -> list[Address]:
        """Every address ``host`` stands for, each checked; refused when any one is refused."""
        literal = _parse_address(host)
        if literal is not None:
            addresses = [literal]
        else:
            addresses = await _resolve(host, port, resolver, resolve_seconds)
        for address in addresses:
            self.check_address(host, address, plain_http=plain_http)
        return addresses

    async def check_url(
        self, url: str, resolver: Resolver, *, resolve_seconds: float | None = RESOLVE_TIMEOUT_SECONDS
    ) -> None:
        """The whole check for a URL an owner supplies: scheme, then every address of its host."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        if not host:
            raise EgressRefused("host", "the URL has no host")
        scheme = parts.scheme.lower()
        self.check_scheme(scheme)
        port = parts.port or (443 if scheme == "https" else 80)
        await self.admitted_addresses(
            host, port, resolver, plain_http=scheme == "http", resolve_seconds=resolve_seconds
        )


async def system_resolver(host: str, port: int) -> Sequence[str]:
    """The operating system's resolver (getaddrinfo), as the Runtime would see the name."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


_TEMPORARY_GAI = frozenset(
    code for code in (getattr(socket, "EAI_AGAIN", None), getattr(socket, "EAI_SYSTEM", None)) if code is not None
)


async def _resolve(host: str, port: int, resolver: Resolver, seconds: float | None) -> list[Address]:
    try:
        answers = await asyncio.wait_for(resolver(host, port), seconds)
    except TimeoutError:
        raise ResolutionFailed(host, True, "the resolver did not answer in time") from None
    except socket.gaierror as exc:
        raise ResolutionFailed(host, exc.errno in _TEMPORARY_GAI, exc.strerror or str(exc)) from None
    except OSError as exc:
        raise ResolutionFailed(host, True, str(exc)) from None
    addresses: list[Address] = []
    for answer in answers:
        address = _parse_address(answer)
        if address is None:
            raise EgressRefused(
                "non_public", f"{host} resolves to something that is not an IP address", cause="reserved"
            )
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise ResolutionFailed(host, False, "no addresses")
    return addresses


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """An httpcore network backend that resolves the host itself, checks every address against the
    policy, then dials the checked address (never the name again), through ``dialer``."""

    def __init__(
        self,
        policy: EgressPolicy,
        *,
        plain_http: bool,
        resolver: Resolver | None = None,
        dialer: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        self._policy = policy
        self._plain_http = plain_http
        self._resolver = resolver or system_resolver
        self._dialer = dialer or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            addresses = await self._policy.admitted_addresses(
                host, port, self._resolver, plain_http=self._plain_http, resolve_seconds=timeout
            )
        except ResolutionFailed as exc:
            raise httpcore.ConnectError(str(exc)) from None
        last: Exception | None = None
        for address in addresses:
            try:
                return await self._dialer.connect_tcp(
                    str(address), port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise EgressRefused("scheme", "model requests never go to a unix socket")

    async def sleep(self, seconds: float) -> None:
        await self._dialer.sleep(seconds)


class EgressTransport(httpx.AsyncBaseTransport):
    """An httpx transport for owner-supplied addresses: two connection pools (https, and plain http
    for listed hosts), each over a ``GuardedBackend``. No proxies; redirects are the client's to
    refuse (``follow_redirects=False``)."""

    def __init__(
        self,
        policy: EgressPolicy,
        *,
        resolver: Resolver | None = None,
        dialer: httpcore.AsyncNetworkBackend | None = None,
        ssl_context: ssl.SSLContext | None = None,
        limits: httpx.Limits | None = None,
    ) -> None:
        self._policy = policy
        limits = limits or httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)
        context = ssl_context or ssl.create_default_context()

        def pool(plain_http: bool) -> httpcore.AsyncConnectionPool:
            return httpcore.AsyncConnectionPool(
                ssl_context=context,
                max_connections=limits.max_connections,
                max_keepalive_connections=limits.max_keepalive_connections,
                keepalive_expiry=limits.keepalive_expiry,
                network_backend=GuardedBackend(policy, plain_http=plain_http, resolver=resolver, dialer=dialer),
            )

        self._pools = {"https": pool(False), "http": pool(True)}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        scheme = request.url.scheme
        self._policy.check_scheme(scheme)
        pool = self._pools[scheme]
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _httpx_errors():
            response = await pool.handle_async_request(core_request)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(response.stream),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        for pool in self._pools.values():
            await pool.aclose()


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, stream: Any) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_errors():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        if hasattr(self._stream, "aclose"):
            await self._stream.aclose()


@contextmanager
def _httpx_errors() -> Iterator[None]:
    """httpcore's exceptions as httpx's of the same name, so callers classify them as usual."""
    try:
        yield
    except httpcore.ConnectError as exc:  # the most common: keep it cheap and explicit
        raise httpx.ConnectError(str(exc)) from exc
    except Exception as exc:
        for kind in type(exc).__mro__:
            if kind.__module__.startswith("httpcore") and hasattr(httpx, kind.__name__):
                raise getattr(httpx, kind.__name__)(str(exc)) from exc
        raise
