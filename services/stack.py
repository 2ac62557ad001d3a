"""All four services on this machine, each as its own process, on one embedded PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from quayutec.authz import CALLER_PREFERENCE, CallersStub
from quayutec.channels import channel_as
from quayutec.config import CLAIMS, DATA_DIR_ENV, GATEWAY, ROOM, RUNTIME, SERVICES, DatabaseConfig, ServiceSpec
from quayutec.datadir import DataDirLock, Owner
from quayutec.db import create_pool, embedded_ctl, embedded_pgdata, embedded_pid, resolve_database_url
from quayutec.migrate import migrate
from quayutec.server import PORT_IN_USE_EXIT
from quayutec.tls import ADMIN, MtlsConfig, ensure_dev_pki

REPO = Path(__file__).resolve().parent.parent
STOP_SECONDS = 15.0
CONSOLE_LISTEN_ENV = "QUAYUTEC_CONSOLE_LISTEN"
CONSOLE_SECURE_COOKIE_ENV = "QUAYUTEC_CONSOLE_SECURE_COOKIE"
CONSOLE_DEFAULT_LISTEN = "127.0.0.1:8080"
# The Gateway's console port (mutual TLS; the console passes on its browsers' addresses there).
GATEWAY_CONSOLE_LISTEN_ENV = "QUAYUTEC_GATEWAY_CONSOLE_LISTEN"
GATEWAY_CONSOLE_DEFAULT_PORT = 50055
# How often a service of an ephemeral stack is started on new ports when another program took one of
# its ports in the moment between the hold and its bind (``LocalStack.start_services``).
PORT_ATTEMPTS = 5


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def orphan_guard() -> list[str]:
    """A command prefix that has the kernel send SIGTERM to a service when the process that started
    it dies, even by SIGKILL, so a killed `quayutec up` leaves no service behind (Linux's
    ``setpriv --pdeathsig``, from util-linux; none where it is missing)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--"] if setpriv and sys.platform.startswith("linux") else []


def port_of(addr: str, name: str) -> int | None:
    """The port of ``host:port`` (``[::]:50051``, ``localhost:50051``); None for an empty address."""
    if not addr:
        return None
    _, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"{name} must be host:port, got {addr!r}")
    return int(port)


def free_port() -> int:
    """A port free now, but free to anyone until used: a stack reserves its ports instead (``reserve_port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reserve_port(port: int = 0) -> socket.socket:
    """A loopback port held for a service we start (a free one for ``port`` 0): bound, never
    listening, without ``SO_REUSEADDR`` or ``SO_REUSEPORT``, so no other program can bind it meanwhile.
    The stack lets it go just before it starts the service, which binds it alone (our servers never
    share a port: quayutec/server.py ``EXCLUSIVE_PORTS``); should another program take it in that
    moment, the service says so and exits ``PORT_IN_USE_EXIT``, and the stack starts it again on
    another port (``LocalStack.start_services``)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
    except BaseException:
        s.close()
        raise
    return s


async def wait_serving(
    addr: str,
    service: str = "",
    *,
    limit: float = 60.0,
    proc: subprocess.Popen[bytes] | None = None,
    what: str = "",
    internal: str | None = None,
    mtls: MtlsConfig | None = None,
) -> None:
    """Poll gRPC health at ``addr`` until ``service`` is SERVING; fail early if ``proc`` exits.
    ``internal`` names the internal service at ``addr`` (mutual TLS, as the admin identity);
    otherwise the port is plaintext (the Gateway's public port without TLS, or a health port)."""
    what = what or addr
    deadline = time.monotonic() + limit
    channel = (
        channel_as(addr, identity=ADMIN, server=internal, mtls=mtls, retry_unavailable=False)
        if internal
        else grpc.aio.insecure_channel(addr)
    )
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not become SERVING in {limit:g} s")
            await asyncio.sleep(0.1)


@dataclass
class LocalStack:
    """Starts, restarts and stops the services as child processes; the parent owns the database."""

    ports: dict[str, int]
    extra_env: Mapping[str, str] = field(default_factory=dict)
    database_url: str = ""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_dir: Path = field(default_factory=lambda: Path(".quayutec") / "logs")
    # Where each service listens and how the others dial it; a name missing uses 127.0.0.1:<port>.
    listens: dict[str, str] = field(default_factory=dict)
    addrs: dict[str, str] = field(default_factory=dict)
    # The embedded PostgreSQL folder this stack started (and so stops), if any.
    started_pgdata: Path | None = None
    # Where the console (services/console, HTTP) listens; None: the stack has no console.
    console_listen: str | None = None
    # The Gateway's console port, which the console calls with its certificate; None: the console
    # calls the public port.
    gateway_console_port: int | None = None
    # The data folder (QUAYUTEC_DATA_DIR) of the services and the embedded PostgreSQL; None: the
    # environment's. With ``folder`` this stack owns it (quayutec.datadir) and stops what runs there.
    data_dir: Path | None = None
    folder: DataDirLock | None = None
    # Ephemeral ports held for the services until each starts (``reserve_port``), by port, and held
    # again while one is down after ``kill``; ``stop_all`` lets them all go.
    reserved: dict[int, socket.socket] = field(default_factory=dict)
    # The ports this stack chose itself (ephemeral): it may choose others when one is taken.
    chosen: set[int] = field(default_factory=set)
    # The command the data folder's record names (``owner``), to record it again when ports change.
    owner_command: str = ""

    @classmethod
    def with_ports(
        cls,
        *,
        ephemeral: bool,
        extra_env: Mapping[str, str] | None = None,
        base_port: int | None = None,
        env: Mapping[str, str] | None = None,
        data_dir: Path | None = None,
    ) -> LocalStack:
        """Ports for the four services: ephemeral ones (demo, tests); ``base_port`` and the next three
        (Gateway, Room, Claims, Runtime); or each service's ``QUAYUTEC_<SVC>_LISTEN`` / ``_ADDR`` when
        set, its default port (50051-50054) when not. The console's: ephemeral, ``base_port`` + 4, or
        ``QUAYUTEC_CONSOLE_LISTEN`` (8080 by default); the Gateway's console port: ephemeral,
        ``base_port`` + 5, or ``QUAYUTEC_GATEWAY_CONSOLE_LISTEN``'s port (50055 by default). The data
        folder: ``data_dir``, else ``QUAYUTEC_DATA_DIR``'s."""
        env = os.environ if env is None else env
        folder = data_dir or DatabaseConfig.from_env(env).data_dir
        ports: dict[str, int] = {}
        listens: dict[str, str] = {}
        addrs: dict[str, str] = {}
        reserved: dict[int, socket.socket] = {}

        def reserved_port() -> int:
            hold = reserve_port()
            port = int(hold.getsockname()[1])
            reserved[port] = hold
            return port

        for s in SERVICES:
            if ephemeral:
                ports[s.name] = reserved_port()
            elif base_port is not None:
                ports[s.name] = base_port + (s.port - GATEWAY.port)
            else:
                listen = env.get(s.listen_env, "").strip()
                addr = env.get(s.addr_env, "").strip()
                ports[s.name] = port_of(listen or addr, s.listen_env if listen else s.addr_env) or s.port
                if listen:
                    listens[s.name] = listen
                if addr:
                    addrs[s.name] = addr
        if ephemeral:
            console = f"127.0.0.1:{reserved_port()}"
        elif base_port is not None:
            console = f"127.0.0.1:{base_port + 4}"
        else:
            console = env.get(CONSOLE_LISTEN_ENV, "").strip() or CONSOLE_DEFAULT_LISTEN
        if ephemeral:
            gateway_console = reserved_port()
        elif base_port is not None:
            gateway_console = base_port + 5
        else:
            listen = env.get(GATEWAY_CONSOLE_LISTEN_ENV, "").strip()
            gateway_console = port_of(listen, GATEWAY_CONSOLE_LISTEN_ENV) or GATEWAY_CONSOLE_DEFAULT_PORT
        if not ephemeral:
            console_port = port_of(console, CONSOLE_LISTEN_ENV)
            taken = [f"{name} ({port})" for name, port in ports.items() if not port_is_free(port)]
            if console_port is not None and not port_is_free(console_port):
                taken.append(f"console ({console_port})")
            if not port_is_free(gateway_console):
                taken.append(f"the Gateway's console port ({gateway_console})")
            if taken:
                raise SystemExit(
                    f"ports in use: {', '.join(taken)}; stop what holds them, or choose others with "
                    "--base-port or QUAYUTEC_<SVC>_LISTEN / QUAYUTEC_<SVC>_ADDR"
                )
        return cls(
            ports=ports,
            extra_env=dict(extra_env or {}),
            log_dir=folder / "logs",
            listens=listens,
            addrs=addrs,
            console_listen=console,
            gateway_console_port=gateway_console,
            data_dir=folder,
            reserved=reserved,
            chosen=set(reserved),
        )

    def addr(self, name: str) -> str:
        """How the other services (and this process) dial ``name``."""
        return self.addrs.get(name) or f"127.0.0.1:{self.ports[name]}"

    def listen(self, name: str) -> str:
        return self.listens.get(name) or f"127.0.0.1:{self.ports[name]}"

    def exports(self) -> str:
        """Shell lines that point the `quayutec` commands of another terminal at this stack."""
        lines = [f"export {spec.addr_env}={self.addr(spec.name)}" for spec in SERVICES]
        if self.started_pgdata is not None or not os.environ.get("DATABASE_URL", "").strip():
            lines.append(f"export {DATA_DIR_ENV}={self.database_config().data_dir}")
        return "\n".join(lines)

    def database_config(self) -> DatabaseConfig:
        """The database settings of this process, in this stack's data folder."""
        config = DatabaseConfig.from_env()
        return config if self.data_dir is None else replace(config, data_dir=self.data_dir)

    def owner(self, command: str) -> Owner:
        """What this stack says about itself in the data folder it owns: who, and where its parts answer."""
        addresses = {name: self.addr(name) for name in self.ports}
        if self.console_listen:
            addresses["console"] = self.console_url
        return Owner(os.getpid(), command, addresses)

    def env(self) -> dict[str, str]:
        env = {**os.environ, **self.extra_env, "DATABASE_URL": self.database_url}
        if self.data_dir is not None:
            env[DATA_DIR_ENV] = str(self.data_dir)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        for spec in SERVICES:
            env[spec.listen_env] = self.listen(spec.name)
            env[spec.addr_env] = self.addr(spec.name)
            # The parent migrated already; replicas need not race for it.
            env[f"{spec.prefix}MIGRATE_ON_START"] = "false"
        if self.console_listen:
            env[CONSOLE_LISTEN_ENV] = self.console_listen
            # The local console serves plain http on this machine: a Secure cookie would never come back.
            env.setdefault(CONSOLE_SECURE_COOKIE_ENV, "false")
        if self.console_listen and self.gateway_console_port:
            # The console calls it with the development PKI's console certificate, passing on each
            # browser's address (docs/operations.md, the throttle model).
            env[GATEWAY_CONSOLE_LISTEN_ENV] = f"127.0.0.1:{self.gateway_console_port}"
            env["QUAYUTEC_CONSOLE_GATEWAY_CONSOLE_ADDR"] = f"127.0.0.1:{self.gateway_console_port}"
        return env

    @property
    def console_url(self) -> str:
        """The console's address for a browser on this machine."""
        host, _, port = (self.console_listen or "").rpartition(":")
        host = host.strip("[]")
        return f"http://{'127.0.0.1' if host in ('', '0.0.0.0', '::') else host}:{port}"

    async def start_console(self, limit: float = 30.0) -> None:
        """Start the console and wait until it answers its sign-in page."""
        import httpx

        async def answering() -> None:
            proc = self.procs["console"]
            deadline = time.monotonic() + limit
            async with httpx.AsyncClient(timeout=1.0) as client:
                while True:
                    if proc.poll() is not None:
                        raise RuntimeError(f"console exited with {proc.returncode} (log: {self.log_dir}/console.log)")
                    try:
                        if (await client.get(f"{self.console_url}/signin")).status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"the console did not answer in {limit:g} s (log: {self.log_dir}/console.log)"
                        )
                    await asyncio.sleep(0.1)

        await self._start_serving("console", answering)

    async def prepare_database(self) -> str:
        """Resolve the database (starting the embedded one when there is no ``DATABASE_URL``) and
        migrate it. ``stop_database`` stops an embedded server this stack started, or, when the stack
        owns its folder, the one there (a server left running by a stack that ended is its own now)."""
        config = self.database_config()
        if config.url is None:
            pgdata = embedded_pgdata(config.data_dir)
            if self.folder is not None or embedded_pid(pgdata) is None:
                self.started_pgdata = pgdata
        self.database_url = await resolve_database_url(config)
        pool = await create_pool(self.database_url, min_size=1, max_size=2)
        try:
            await migrate(pool)
        finally:
            await pool.close()
        return self.database_url

    def ports_of(self, name: str) -> list[int]:
        """The ports the service ``name`` (or ``console``) listens on."""
        if name == "console":
            return [int(str(self.console_listen).rpartition(":")[2])] if self.console_listen else []
        found = [self.ports[name]]
        if name == GATEWAY.name and self.console_listen and self.gateway_console_port:
            found.append(self.gateway_console_port)
        return found

    def release_ports(self, name: str) -> None:
        """Let go of the holds on ``name``'s ports, just before it starts and binds them."""
        for port in self.ports_of(name):
            hold = self.reserved.pop(port, None)
            if hold is not None:
                hold.close()

    def _hold_again(self, name: str) -> None:
        """Hold the ports of a service that stopped, when they were the stack's own (ephemeral) ports;
        best effort: right after a crash its connections' TIME_WAIT may keep a plain bind out, and
        then the hold also allows ``SO_REUSEADDR`` (still refusing a plain bind)."""
        for port in self.ports_of(name):
            if port not in self.chosen or port in self.reserved:
                continue
            try:
                self.reserved[port] = reserve_port(port)
            except OSError:
                hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    hold.bind(("127.0.0.1", port))
                except OSError:
                    hold.close()
                    continue
                self.reserved[port] = hold

    def _choose_again(self, name: str) -> None:
        """New ports for ``name`` after another program took one in the moment between the hold and
        its bind; the data folder's record names them."""
        for old in self.ports_of(name):
            if old not in self.chosen:
                raise RuntimeError(f"{name}: port {old} is in use by another program (log: {self.log_dir}/{name}.log)")
            hold = reserve_port()
            port = int(hold.getsockname()[1])
            self.reserved[port] = hold
            self.chosen.discard(old)
            self.chosen.add(port)
            if name == "console":
                self.console_listen = f"{str(self.console_listen).rpartition(':')[0]}:{port}"
            elif old == self.gateway_console_port and name == GATEWAY.name and old != self.ports[name]:
                self.gateway_console_port = port
            else:
                self.ports[name] = port
        if self.folder is not None and self.owner_command:
            self.folder.record(self.owner(self.owner_command))

    def start(self, name: str) -> None:
        self.release_ports(name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [*orphan_guard(), sys.executable, "-m", f"services.{name}"],
            cwd=REPO,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    async def wait_serving(self, spec: ServiceSpec, limit: float = 60.0) -> None:
        proc = self.procs.get(spec.name)
        await wait_serving(
            self.addr(spec.name),
            spec.grpc_service,
            limit=limit,
            proc=proc,
            what=f"{spec.name} (log: {self.log_dir}/{spec.name}.log)",
            internal=None if spec.public else spec.name,
            mtls=self.mtls(),
        )

    def mtls(self) -> MtlsConfig:
        """Where the services' certificates are: the same data folder the children use."""
        return MtlsConfig.from_env(self.env())

    def callers(
        self, spec: ServiceSpec, stub_class: Callable[[grpc.aio.Channel], Any]
    ) -> tuple[CallersStub, list[Any]]:
        """A stub of internal service ``spec`` making each RPC as an identity allowed to, and its
        channels (the caller closes them): for tools that stand in for several callers."""
        channels = {identity: self.channel(spec.name, identity) for identity in CALLER_PREFERENCE}
        stubs = {identity: stub_class(channel) for identity, channel in channels.items()}
        return CallersStub(spec.grpc_service, stubs), list(channels.values())

    def channel(self, name: str, identity: str) -> grpc.aio.Channel:
        """A channel to the service ``name`` as ``identity`` (mutual TLS; plaintext to the Gateway)."""
        if name == GATEWAY.name:
            return grpc.aio.insecure_channel(self.addr(name))
        return channel_as(self.addr(name), identity=identity, server=name, mtls=self.mtls())

    async def start_all(self) -> None:
        await self.start_services([s.name for s in SERVICES])

    async def start_services(self, names: Sequence[str]) -> None:
        """Start in dependency order, each SERVING before the services that call it start. This
        admin tooling makes the development PKI first: a service only reads its own folder of it."""
        mtls = self.mtls()
        if not mtls.from_files:
            ensure_dev_pki(mtls.pki_dir)
        for spec in (CLAIMS, ROOM, RUNTIME, GATEWAY):
            if spec.name in names:
                await self._start_serving(spec.name, partial(self.wait_serving, spec))

    async def _start_serving(self, name: str, serving: Callable[[], Awaitable[None]]) -> None:
        """Start ``name`` and wait until it serves; when it exits saying a port of ours was taken in the
        moment between the hold and its bind (``PORT_IN_USE_EXIT``), again on new ports (bounded)."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self.release_ports(name)
            self.start(name)
            try:
                await serving()
                return
            except RuntimeError:
                proc = self.procs.get(name)
                if proc is None or proc.poll() != PORT_IN_USE_EXIT or attempt == PORT_ATTEMPTS:
                    raise
            self._choose_again(name)

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash would."""
        proc = self.procs.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        self._hold_again(name)  # until it starts again

    def stop_all(self) -> None:
        """SIGTERM to every service, SIGKILL to any still running after ``STOP_SECONDS``, then the ports'
        reservations go; safe twice."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        for reservation in self.reserved.values():
            reservation.close()
        self.reserved.clear()

    def stop_database(self) -> None:
        """Stop the embedded PostgreSQL if this stack started it (one already running is left alone)."""
        if self.started_pgdata is not None and embedded_pid(self.started_pgdata) is not None:
            try:
                embedded_ctl("stop", self.started_pgdata)
            except subprocess.CalledProcessError as exc:
                if embedded_pid(self.started_pgdata) is not None:  # not stopped by someone else meanwhile
                    raise RuntimeError(f"could not stop the embedded PostgreSQL: {exc.stderr}") from exc
        self.started_pgdata = None
