"""A multi-host test bed in network namespaces: a database host and two service hosts.

Every pod (one service of one host) is a network namespace of its own with one address; the wire
(``tests.cluster.wire``) routes between them, so every call between services and every SQL
statement crosses the bed's network, as between pods on Kubernetes. A *host* is a failure domain:
a set of pods that a fault cuts off, slows down or kills together.

    db host   10.77.1.10  PostgreSQL (the embedded pgserver binaries of the venv)
    host a    10.77.2.11 gateway  .12 room  .13 claims  .14 runtime (+ the stand-in provider)
    host b    10.77.3.11 gateway  .12 room  .13 claims  .14 runtime (+ the stand-in provider)
    client    10.77.9.1   the namespace the bed runs in (tests, `scripts.cluster exec`)

With ``ha=True`` the database is highly available instead (``tests.cluster.ha``): three database
hosts pg1, pg2, pg3 (10.77.1.11-13), each running an etcd member, Patroni and PostgreSQL 15, and
the services get a URL listing all three with ``target_session_attrs=read-write``.

Each client of an internal service dials every replica (``ipv4:a:port,b:port``) and spreads its
calls over them; every process presents a certificate of the bed's own CA that names its identity,
its pod's host name and its address.

Safety: the bed refuses to start unless the namespace it runs in has no interface but loopback
(made by ``unshare --net``; ``python -m scripts.cluster`` makes it). Every address and device it
creates lives inside that namespace; the pods' namespaces are held by processes, never mounted,
so nothing outlives the bed's processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quayutec.config import CLAIMS, GATEWAY, ROOM, RUNTIME, ServiceSpec
from quayutec.tls import ADMIN, CA_ENV, CERT_ENV, KEY_ENV, MtlsConfig, write_host_pki
from services.stack import REPO, wait_serving
from tests.cluster.ha import HA_HOSTS, HA_IPS, HaDatabase, HaError, multi_host_url, node_url
from tests.cluster.ha import SERVICE_PORTS as HA_SERVICE_PORTS

DB_HOST = "db"
SERVICE_HOSTS = ("a", "b")
CLIENT_HOST = "client"
CLIENT_IP = "10.77.9.1"
DB_IP = "10.77.1.10"
DB_PORT = 5432
DB_NAME = "quayutec"
STANDIN_PORT = 8089
NETWORK = "10.77.0.0/16"
# Start order: each service SERVING before those that call it.
START_ORDER: tuple[ServiceSpec, ...] = (CLAIMS, ROOM, RUNTIME, GATEWAY)
_POD_OCTET = {GATEWAY.name: 11, ROOM.name: 12, CLAIMS.name: 13, RUNTIME.name: 14}
_HOST_OCTET = {"a": 2, "b": 3}
# The Room's key for provider keys at rest: every Room replica must hold the same one.
BED_ENCRYPTION_KEY = "cXVheXV0ZWMtY2x1c3Rlci1iZWQta2V5LTMyLWJ5dGU="
PG_USER = "pgserver"
REQUIRED_TOOLS = {
    "ip": "iproute2 (apt-get install iproute2)",
    "tc": "iproute2 (apt-get install iproute2)",
    "unshare": "util-linux (apt-get install util-linux)",
    "nsenter": "util-linux (apt-get install util-linux)",
    "setpriv": "util-linux (apt-get install util-linux)",
}

# Settings of every service of the bed: short leases and timeouts so that a fault and its
# recovery fit in a test's minute, nothing else changed from the defaults.
BED_SETTINGS: dict[str, str] = {
    "QUAYUTEC_LOG_LEVEL": "INFO",
    **{f"QUAYUTEC_{name.upper()}_GRACE_SECONDS": "1" for name in ("gateway", "room", "claims", "runtime")},
    # Two replicas of each: the connection budget each service checks at start counts both.
    **{f"QUAYUTEC_{name.upper()}_REPLICAS_MAX": "2" for name in ("gateway", "room", "claims")},
    "QUAYUTEC_ENCRYPTION_KEY": BED_ENCRYPTION_KEY,
    "QUAYUTEC_GATEWAY_LEASE_SECONDS": "6",
    "QUAYUTEC_GATEWAY_BACKOFF_BASE_SECONDS": "0.2",
    "QUAYUTEC_GATEWAY_BACKOFF_CEILING_SECONDS": "2",
    "QUAYUTEC_GATEWAY_START_RUN_TIMEOUT_SECONDS": "4",
    "QUAYUTEC_GATEWAY_ROOM_TIMEOUT_SECONDS": "3",
    "QUAYUTEC_GATEWAY_EXPIRE_INTERVAL_SECONDS": "1",
    "QUAYUTEC_GATEWAY_ABANDON_AFTER_SECONDS": "60",
    "QUAYUTEC_GATEWAY_WATCH_HEARTBEAT_SECONDS": "1",
    "QUAYUTEC_GATEWAY_RECONNECT_BACKOFF_MAX_MS": "1000",
    "QUAYUTEC_GATEWAY_POST_RATE": "200",
    "QUAYUTEC_GATEWAY_POST_BURST": "400",
    "QUAYUTEC_RUNTIME_BACKEND_TIMEOUT_SECONDS": "2",
    "QUAYUTEC_RUNTIME_ROOM_RETRY_SECONDS": "20",
    "QUAYUTEC_RUNTIME_RUN_SECONDS": "45",
    "QUAYUTEC_RUNTIME_MODEL_TIMEOUT_SECONDS": "20",
    "QUAYUTEC_CLAIMS_ACQUIRE_TIMEOUT_SECONDS": "2",
}


class BedError(RuntimeError):
    """The bed cannot start here; the message says what to install or how to run it."""


def pod_ip(host: str, service: str) -> str:
    return f"10.77.{_HOST_OCTET[host]}.{_POD_OCTET[service]}"


def pod_name(host: str, service: str) -> str:
    """The pod's host name (in its certificate) and the name of its network device (at most 15 bytes)."""
    return f"qy{host}-{service}"


def host_ips(host: str) -> list[str]:
    """Every address of ``host`` (``db``, ``a``, ``b``, ``client``, or ``pg1``-``pg3`` in an HA bed)."""
    if host in HA_IPS:
        return [HA_IPS[host]]
    if host not in (DB_HOST, CLIENT_HOST, *SERVICE_HOSTS):
        raise BedError(f"unknown host {host!r}: one of {DB_HOST}, {', '.join(SERVICE_HOSTS)}, {CLIENT_HOST}")
    if host == DB_HOST:
        return [DB_IP]
    if host == CLIENT_HOST:
        return [CLIENT_IP]
    return [pod_ip(host, s.name) for s in START_ORDER]


def check_tools() -> None:
    missing = [f"{tool} (from {package})" for tool, package in REQUIRED_TOOLS.items() if shutil.which(tool) is None]
    if missing:
        raise BedError(f"the multi-host test bed needs {', '.join(missing)}")
    if not Path("/dev/net/tun").exists():
        raise BedError("the multi-host test bed needs /dev/net/tun (a kernel with CONFIG_TUN)")


def interfaces() -> list[str]:
    """The network interfaces of this process's network namespace."""
    out = subprocess.run(["ip", "-o", "link", "show"], check=True, capture_output=True, text=True).stdout
    return [line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines() if line.strip()]


def check_isolated() -> None:
    """Refuse to touch any network unless this namespace has loopback only (a fresh ``unshare --net``)."""
    found = interfaces()
    if found != ["lo"]:
        raise BedError(
            "the multi-host test bed runs only inside a network namespace of its own, whose only interface is "
            f"lo; this one has {', '.join(found)}. Run it through `python -m scripts.cluster` (up, test, exec), "
            "which makes one with `unshare --net`"
        )


def netem_available() -> bool:
    """Whether this kernel has ``tc netem`` (tried on loopback in a throwaway ``unshare --net``)."""
    probe = subprocess.run(
        ["unshare", "--net", "--", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
        capture_output=True,
        text=True,
    )
    return probe.returncode == 0


def _run(argv: Sequence[str]) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if done.returncode != 0:
        raise BedError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")


def _guard() -> list[str]:
    """The kernel ends the child when the bed process dies, even by SIGKILL."""
    return ["setpriv", "--pdeathsig", "KILL", "--"]


@dataclass
class Pod:
    """One network namespace, held by a sleeping process, with one address on the bed's network."""

    host: str
    name: str
    ip: str
    holder: subprocess.Popen[bytes] | None = None

    def enter(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this pod's network namespace."""
        assert self.holder is not None
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "--", *argv]


@dataclass
class Bed:
    """Start with ``await bed.start()``, stop with ``bed.stop()`` (safe twice, leaves nothing)."""

    root: Path
    settings: Mapping[str, str] = field(default_factory=dict)
    ha: bool = False  # three database hosts under Patroni instead of one PostgreSQL
    pods: dict[str, Pod] = field(default_factory=dict)
    procs: dict[tuple[str, str], subprocess.Popen[bytes]] = field(default_factory=dict)
    wire: subprocess.Popen[bytes] | None = None
    postgres: subprocess.Popen[bytes] | None = None
    ha_db: HaDatabase | None = None
    # Database hosts of an HA bed that are down or cut off (kill_host, or a test's partition): left
    # out of ``counting_url`` so that the tests' own reads never wait on a silent host.
    unreachable_database_hosts: set[str] = field(default_factory=set)
    started: bool = False

    # -- addresses ----------------------------------------------------------------------------------------

    @property
    def database_url(self) -> str:
        if self.ha:
            return multi_host_url(DB_NAME)
        return f"postgresql://postgres@{DB_IP}:{DB_PORT}/{DB_NAME}"

    @property
    def admin_database_url(self) -> str:
        if self.ha:
            return multi_host_url("postgres")
        return f"postgresql://postgres@{DB_IP}:{DB_PORT}/postgres"

    @property
    def counting_url(self) -> str:
        """Where the tests count outcomes: the surviving database (every reachable host of an HA bed)."""
        if self.ha:
            return multi_host_url(DB_NAME, [h for h in HA_HOSTS if h not in self.unreachable_database_hosts])
        return self.database_url

    @property
    def database_hosts(self) -> tuple[str, ...]:
        return HA_HOSTS if self.ha else (DB_HOST,)

    def gateway_addr(self, host: str) -> str:
        return f"{pod_ip(host, GATEWAY.name)}:{GATEWAY.port}"

    def service_addr(self, host: str, spec: ServiceSpec) -> str:
        return f"{pod_ip(host, spec.name)}:{spec.port}"

    def spread_addr(self, spec: ServiceSpec) -> str:
        """How every client dials ``spec``: all its replicas, calls spread over them."""
        return "ipv4:" + ",".join(self.service_addr(h, spec) for h in SERVICE_HOSTS)

    def standin_url(self, host: str) -> str:
        return f"http://{pod_ip(host, RUNTIME.name)}:{STANDIN_PORT}"

    @property
    def pki_dir(self) -> Path:
        return self.root / "pki"

    @property
    def control_path(self) -> Path:
        return self.root / "wire.sock"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    def client_mtls(self) -> MtlsConfig:
        """The admin identity of the client namespace (health checks, admin calls)."""
        return MtlsConfig(
            pki_dir=self.pki_dir,
            ca_path=self.pki_dir / "ca.crt",
            cert_path=self.pki_dir / "client-admin.crt",
            key_path=self.pki_dir / "client-admin.key",
        )

    # -- start and stop -----------------------------------------------------------------------------------

    async def start(self) -> None:
        check_tools()
        check_isolated()
        self.started = True
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        self.log_dir.mkdir(exist_ok=True)
        _run(["ip", "link", "set", "lo", "up"])
        self._make_pods()
        self._start_wire()
        self._link_pods()
        self._make_pki()
        if self.ha:
            await asyncio.to_thread(self._start_ha)
        else:
            self._start_postgres()
        await self._bootstrap_database()
        for host in SERVICE_HOSTS:
            await self.start_host(host)

    def _make_pods(self) -> None:
        if self.ha:
            for host in HA_HOSTS:
                self.pods[host] = Pod(host, f"qy{host}", HA_IPS[host])
        else:
            self.pods[DB_HOST] = Pod(DB_HOST, "qydb", DB_IP)
        for host in SERVICE_HOSTS:
            for spec in START_ORDER:
                self.pods[pod_name(host, spec.name)] = Pod(host, pod_name(host, spec.name), pod_ip(host, spec.name))
        for pod in self.pods.values():
            pod.holder = subprocess.Popen([*_guard(), "unshare", "--net", "--", "sleep", "infinity"])

    def _start_wire(self) -> None:
        ports = [f"{p.name}={p.ip}@{p.host}" for p in self.pods.values()] + [f"qyclient={CLIENT_IP}@{CLIENT_HOST}"]
        service_ports = [DB_PORT, STANDIN_PORT, *(s.port for s in START_ORDER)]
        if self.ha:
            service_ports += HA_SERVICE_PORTS
        argv = [*_guard(), sys.executable, "-m", "tests.cluster.wire", "--control", str(self.control_path)]
        argv += [a for p in ports for a in ("--port", p)]
        argv += [a for p in service_ports for a in ("--service-port", str(p))]
        log = (self.log_dir / "wire.log").open("ab")
        self.wire = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=log, env=self._python_env())
        log.close()
        assert self.wire.stdout is not None
        line = self.wire.stdout.readline().decode().strip()
        if line != "ready":
            raise BedError(f"the wire did not start (said {line!r}; log: {self.log_dir / 'wire.log'})")

    def _link_pods(self) -> None:
        for pod in self.pods.values():
            assert pod.holder is not None
            # The holder may still be between fork and unshare: wait until its namespace is its own.
            deadline = time.monotonic() + 10
            while os.readlink(f"/proc/{pod.holder.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
                if time.monotonic() > deadline:
                    raise BedError(f"pod {pod.name} did not get a network namespace")
                time.sleep(0.01)
            _run(["ip", "link", "set", pod.name, "netns", str(pod.holder.pid)])
            for argv in (
                ["ip", "link", "set", "lo", "up"],
                ["ip", "link", "set", pod.name, "up"],
                ["ip", "addr", "add", f"{pod.ip}/16", "dev", pod.name],
            ):
                _run(pod.enter(argv))
        _run(["ip", "link", "set", "qyclient", "up"])
        _run(["ip", "addr", "add", f"{CLIENT_IP}/16", "dev", "qyclient"])

    def _make_pki(self) -> None:
        leaves: dict[str, tuple[str, Sequence[str], Sequence[str]]] = {}
        for host in SERVICE_HOSTS:
            for spec in START_ORDER:
                name = pod_name(host, spec.name)
                leaves[name] = (spec.name, [name], [pod_ip(host, spec.name)])
        leaves["client-admin"] = (ADMIN, ["qyclient"], [CLIENT_IP])
        write_host_pki(self.pki_dir, leaves)

    def _start_postgres(self) -> None:
        from quayutec.db import quiet_pgserver

        quiet_pgserver()
        import pgserver  # the embedded binaries; imported lazily like quayutec.db does

        bin_dir = Path(pgserver.__file__).parent / "pginstall" / "bin"
        _ensure_pg_user()
        pgdata = self.root / "pgdata"
        pgdata.mkdir(mode=0o700, exist_ok=True)
        user = pwd.getpwnam(PG_USER)
        os.chown(pgdata, user.pw_uid, user.pw_gid)
        as_pg = ["setpriv", f"--reuid={PG_USER}", f"--regid={PG_USER}", "--clear-groups", "--"]
        _run([*as_pg, str(bin_dir / "initdb"), "-D", str(pgdata), "-U", "postgres", "--auth=trust", "-E", "utf8"])
        with (pgdata / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {NETWORK} trust\n")
        log = (self.log_dir / "postgres.log").open("ab")
        self.postgres = subprocess.Popen(
            self.pods[DB_HOST].enter(
                [
                    *_guard(),
                    *as_pg,
                    str(bin_dir / "postgres"),
                    "-D",
                    str(pgdata),
                    "-c",
                    f"listen_addresses={DB_IP}",
                    "-c",
                    f"port={DB_PORT}",
                    "-c",
                    f"unix_socket_directories={pgdata}",
                    "-c",
                    "max_connections=200",
                    "-c",
                    "fsync=off",
                ]
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def _start_ha(self) -> None:
        self.ha_db = HaDatabase(
            root=self.root / "ha",
            log_dir=self.log_dir,
            enter=lambda host, argv: self.pods[host].enter(argv),
            ns_of=lambda host: f"/proc/{self.pods[host].holder.pid}/ns/net",  # type: ignore[union-attr]
        )
        (self.root / "ha").mkdir(exist_ok=True)
        (self.root / "ha").chmod(0o755)
        try:
            self.ha_db.start()
            self.ha_db.wait_healthy(limit=120)
        except HaError as exc:
            raise BedError(f"{exc} (logs: {self.log_dir}/pg*-patroni.log, pg*-etcd.log)") from exc

    async def _bootstrap_database(self) -> None:
        """The database the services use, from nothing: created, then migrated (one place, so that
        whatever else the database needs before the services start is added here)."""
        import asyncpg

        from quayutec.db import create_pool
        from quayutec.migrate import migrate

        deadline = time.monotonic() + 60
        while True:
            if self.postgres is not None and self.postgres.poll() is not None:
                raise BedError(f"PostgreSQL exited with {self.postgres.returncode} (log: {self.log_dir}/postgres.log)")
            try:
                conn = await asyncpg.connect(self.admin_database_url, timeout=5)
                break
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        try:
            if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DB_NAME):
                await conn.execute(f"CREATE DATABASE {DB_NAME}")
        finally:
            await conn.close()
        for host in self.database_hosts if self.ha else ():
            # A standby answers a client only once it has replayed the new database (a commit waits
            # for the standby's flush, not its replay): a multi-host client stops at the first that answers.
            await _wait_database(node_url(host, DB_NAME), deadline)
        pool = await create_pool(self.database_url, min_size=1, max_size=2)
        try:
            await migrate(pool)
        finally:
            await pool.close()

    def _python_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("QUAYUTEC_", "OTEL_")) and k != "DATABASE_URL"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        return env

    def service_env(self, host: str, spec: ServiceSpec) -> dict[str, str]:
        name = pod_name(host, spec.name)
        env = self._python_env()
        env.update(BED_SETTINGS)
        env.update(self.settings)
        env.update(
            {
                "DATABASE_URL": self.database_url,
                "QUAYUTEC_DATA_DIR": str(self.root / "data" / name),
                CA_ENV: str(self.pki_dir / "ca.crt"),
                CERT_ENV: str(self.pki_dir / f"{name}.crt"),
                KEY_ENV: str(self.pki_dir / f"{name}.key"),
                spec.listen_env: f"{pod_ip(host, spec.name)}:{spec.port}",
                f"{spec.prefix}MIGRATE_ON_START": "false",
                "QUAYUTEC_ROOM_ADDR": self.spread_addr(ROOM),
                "QUAYUTEC_CLAIMS_ADDR": self.spread_addr(CLAIMS),
                "QUAYUTEC_RUNTIME_ADDR": self.spread_addr(RUNTIME),
                "QUAYUTEC_RUNTIME_ANTHROPIC_BASE_URL": f"http://127.0.0.1:{STANDIN_PORT}",
                "QUAYUTEC_RUNTIME_OPENAI_BASE_URL": f"http://127.0.0.1:{STANDIN_PORT}",
            }
        )
        return env

    def _spawn(self, host: str, what: str, pod: Pod, argv: Sequence[str], env: Mapping[str, str]) -> None:
        log = (self.log_dir / f"{host}-{what}.log").open("ab")
        self.procs[(host, what)] = subprocess.Popen(
            pod.enter([*_guard(), *argv]), cwd=REPO, env=dict(env), stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    async def start_host(self, host: str) -> None:
        """Start the host's stand-in and its four services, each SERVING before the next."""
        runtime_pod = self.pods[pod_name(host, RUNTIME.name)]
        self._spawn(
            host,
            "standin",
            runtime_pod,
            [sys.executable, "-m", "services.runtime.standin", "--host", "0.0.0.0", "--port", str(STANDIN_PORT)],
            self._python_env(),
        )
        for spec in START_ORDER:
            pod = self.pods[pod_name(host, spec.name)]
            (self.root / "data" / pod.name).mkdir(parents=True, exist_ok=True)
            argv = [sys.executable, "-m", f"services.{spec.name}"]
            self._spawn(host, spec.name, pod, argv, self.service_env(host, spec))
            await self.wait_serving(host, spec)

    async def wait_serving(self, host: str, spec: ServiceSpec, limit: float = 60.0) -> None:
        await wait_serving(
            self.service_addr(host, spec),
            spec.grpc_service,
            limit=limit,
            proc=self.procs[(host, spec.name)],
            what=f"{spec.name} of host {host} (log: {self.log_dir}/{host}-{spec.name}.log)",
            internal=None if spec.public else spec.name,
            mtls=self.client_mtls(),
        )

    def kill_host(self, host: str) -> None:
        """The host dies at once: SIGKILL to every process of it, and its addresses stop answering
        (the machine is gone: its peers get no reset, only silence)."""
        self.partition(f"down-{host}", host_ips(host), [ip for p in self.pods.values() for ip in [p.ip]] + [CLIENT_IP])
        if host in HA_IPS:
            assert self.ha_db is not None
            self.unreachable_database_hosts.add(host)
            self.ha_db.kill_host(host)
            return
        for (h, what), proc in list(self.procs.items()):
            if h == host:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                del self.procs[(h, what)]

    async def restart_host(self, host: str) -> None:
        """The host comes back: reachable again, its processes started afresh."""
        self.heal(f"down-{host}")
        if host in HA_IPS:
            assert self.ha_db is not None
            self.ha_db.start_host(host)
            self.unreachable_database_hosts.discard(host)
            return
        await self.start_host(host)

    def stop(self) -> None:
        """Stop everything this bed started; safe to call twice, and after a failed start."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            _wait_or_kill(proc, deadline)
        self.procs.clear()
        if self.ha_db is not None:
            self.ha_db.stop()
            self.ha_db = None
        if self.postgres is not None:
            if self.postgres.poll() is None:
                self.postgres.send_signal(signal.SIGINT)  # fast shutdown
            _wait_or_kill(self.postgres, time.monotonic() + 15)
            self.postgres = None
        if self.wire is not None:
            if self.wire.poll() is None:
                self.wire.send_signal(signal.SIGTERM)
            _wait_or_kill(self.wire, time.monotonic() + 5)
            if self.wire.stdout is not None:
                self.wire.stdout.close()
            self.wire = None
        for pod in self.pods.values():
            if pod.holder is not None:
                if pod.holder.poll() is None:
                    pod.holder.kill()
                pod.holder.wait()
                pod.holder = None
        self.pods.clear()
        if self.started:
            subprocess.run(["ip", "link", "del", "qyclient"], capture_output=True)
        self.started = False

    def remove_files(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # -- the network's faults and counters ----------------------------------------------------------------

    def control(self, **request: Any) -> dict[str, Any]:
        """One request to the wire (``op`` and its arguments)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(self.control_path))
            s.sendall(json.dumps(request).encode() + b"\n")
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                answer += chunk
        reply: dict[str, Any] = json.loads(answer)
        if not reply.get("ok"):
            raise BedError(f"the wire refused {request}: {reply.get('error')}")
        return reply

    def partition(self, name: str, a: Sequence[str], b: Sequence[str], *, a_port: int = 0, b_port: int = 0) -> None:
        """Drop everything between addresses ``a`` (port ``a_port`` of them, 0: all) and ``b``."""
        self.control(op="drop", name=name, a=list(a), b=list(b), a_port=a_port, b_port=b_port)

    def heal(self, name: str | None = None) -> None:
        """Lift the partition ``name`` (every one when None)."""
        self.control(op="heal", name=name)
        if name is None:
            self.unreachable_database_hosts.clear()

    def set_delay(self, ms: float, *, every_hop: bool = False) -> None:
        """Delay each packet between hosts (or on every hop between pods) by ``ms`` one way."""
        self.control(op="delay", ms=ms, every_hop=every_hop)

    def counters(self, *, reset: bool = False) -> dict[str, Any]:
        counters: dict[str, Any] = self.control(op="counters", reset=reset)["counters"]
        return counters

    def processes(self) -> Iterator[subprocess.Popen[bytes]]:
        """Every process the bed holds."""
        yield from self.procs.values()
        if self.ha_db is not None:
            yield from self.ha_db.processes()
        for extra in (self.postgres, self.wire):
            if extra is not None:
                yield extra
        for pod in self.pods.values():
            if pod.holder is not None:
                yield pod.holder


def network_fault(root: Path, words: Sequence[str]) -> str:
    """A fault on a running bed's network, from another process (``python -m scripts.cluster fault``):
    ``partition HOST HOST``, ``heal``, ``delay MS [every-hop]``, ``counters``."""
    bed = Bed(root)
    match list(words):
        case ["partition", a, b]:
            bed.partition(f"{a}-{b}", host_ips(a), host_ips(b))
            return f"{a} and {b} cut from each other (`fault heal` lifts it)"
        case ["heal"]:
            bed.heal()
            return "every partition lifted"
        case ["delay", ms, *rest] if rest in ([], ["every-hop"]):
            bed.set_delay(float(ms), every_hop=bool(rest))
            return f"{ms} ms each way {'on every hop' if rest else 'between hosts'}"
        case ["counters"]:
            return json.dumps(bed.counters(), indent=2)
    raise BedError(f"unknown fault {' '.join(words)!r}: partition HOST HOST | heal | delay MS [every-hop] | counters")


def _wait_or_kill(proc: subprocess.Popen[bytes], deadline: float) -> None:
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _wait_database(url: str, deadline: float) -> None:
    import asyncpg

    while True:
        try:
            conn = await asyncpg.connect(url, timeout=2)
            await conn.close()
            return
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def _ensure_pg_user() -> None:
    try:
        pwd.getpwnam(PG_USER)
    except KeyError:
        _run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER])


def new_root() -> Path:
    """A fresh folder for one bed (short: PostgreSQL's socket lives in it)."""
    root = Path(tempfile.mkdtemp(prefix="qy-bed-"))
    root.chmod(0o755)  # PostgreSQL runs as its own user and must reach its folder inside
    return root
