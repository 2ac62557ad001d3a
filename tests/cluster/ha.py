"""The bed's highly available database: three hosts, each running an etcd member, Patroni and the
PostgreSQL 15 it manages, all from Debian's packages (``postgresql-15``, ``patroni``, ``etcd-server``).

    pg1  10.77.1.11   pg2  10.77.1.12   pg3  10.77.1.13
    each: PostgreSQL :5432, Patroni's REST API :8008, etcd :2379 (clients) and :2380 (peers)

Replication is synchronous through Patroni's ``synchronous_mode`` with ``synchronous_mode_strict``:
a commit is answered only once one standby has it, and when no standby is left the primary stops
answering commits rather than keep the only copy (see docs/operations.md, "With Patroni"). Patroni
promotes only the standby it made synchronous, so an answered commit survives the loss of any one
host. The timings are short (TTL 10 s, a loop each second) so that a failover fits in a test.

PostgreSQL and Patroni refuse to run as root: they run as the ``postgres`` user that Debian's
package creates, and so does etcd. Every process binds only its pod's address and loopback.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

HA_HOSTS = ("pg1", "pg2", "pg3")
HA_IPS = {"pg1": "10.77.1.11", "pg2": "10.77.1.12", "pg3": "10.77.1.13"}
PG_PORT = 5432
PATRONI_PORT = 8008
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
HA_USER = "postgres"
SCOPE = "quayutec"
PG_BIN = Path("/usr/lib/postgresql/15/bin")
PATRONI = Path("/usr/bin/patroni")
PATRONICTL = Path("/usr/bin/patronictl")
ETCD = Path("/usr/bin/etcd")
# What to install when one is missing (the Makefile's `ha-packages` and .ci/run install them).
HA_PACKAGES = {PG_BIN / "postgres": "postgresql-15", PATRONI: "patroni", ETCD: "etcd-server"}
# Patroni's clocks: a leader key lives TTL seconds; the loop runs every LOOP_WAIT seconds; a DCS or
# PostgreSQL call is retried for RETRY_TIMEOUT seconds. Patroni needs LOOP_WAIT + 2 * RETRY_TIMEOUT <= TTL.
TTL = 10
LOOP_WAIT = 1
RETRY_TIMEOUT = 4
SERVICE_PORTS = (PATRONI_PORT, ETCD_CLIENT_PORT, ETCD_PEER_PORT)
# Why Patroni uses etcd's v2 API here (its ``etcd`` section, not ``etcd3``): Patroni 3.0.2's etcd3
# code renews the leader key with a plain put once its lease changed, not a compare-and-swap, so a
# primary cut off longer than the TTL can, when the cut heals, overwrite the key that a promoted
# standby took meanwhile: the new primary demotes itself and the old one leads again, discarding what
# the new one committed. This bed showed it (fault 2 of tests/cluster/test_failover.py). Its v2 code
# renews with ``prevValue`` (a compare-and-swap) and is safe; later Patroni releases fixed etcd3.


class HaError(RuntimeError):
    """The highly available database cannot start or answer; the message says why."""


def check_packages() -> None:
    missing = sorted({pkg for path, pkg in HA_PACKAGES.items() if not path.exists()})
    if missing:
        raise HaError(
            f"the highly available bed needs Debian's {', '.join(missing)} "
            f"(`make ha-packages`, or apt-get install {' '.join(HA_PACKAGES.values())})"
        )
    try:
        pwd.getpwnam(HA_USER)
    except KeyError:
        raise HaError(f"no {HA_USER!r} user: Debian's postgresql-common package creates it") from None


def multi_host_url(dbname: str, hosts_up: Sequence[str] = HA_HOSTS) -> str:
    """Every database host, the client keeping the one that accepts writes (the primary)."""
    hosts = ",".join(f"{HA_IPS[h]}:{PG_PORT}" for h in hosts_up)
    return f"postgresql://postgres@{hosts}/{dbname}?target_session_attrs=read-write"


def node_url(host: str, dbname: str) -> str:
    """One database host, whatever its role."""
    return f"postgresql://postgres@{HA_IPS[host]}:{PG_PORT}/{dbname}"


def patroni_config(root: Path, host: str, *, synchronous: bool = True) -> dict[str, Any]:
    """Patroni's configuration for ``host``; ``synchronous`` sets the cluster's mode at bootstrap."""
    ip = HA_IPS[host]
    home = root / host
    trust = [
        "local all all trust",
        "host all all 127.0.0.1/32 trust",
        "host replication all 127.0.0.1/32 trust",
        # The bed's network only (its own namespace); a production cluster uses passwords or certificates.
        "host all all 10.77.0.0/16 trust",
        "host replication all 10.77.0.0/16 trust",
    ]
    return {
        "scope": SCOPE,
        "name": host,
        "namespace": "/qy/",
        "log": {"level": "INFO"},
        "restapi": {"listen": f"{ip}:{PATRONI_PORT}", "connect_address": f"{ip}:{PATRONI_PORT}"},
        "etcd": {"hosts": [f"{HA_IPS[h]}:{ETCD_CLIENT_PORT}" for h in HA_HOSTS]},
        "bootstrap": {
            "dcs": {
                "ttl": TTL,
                "loop_wait": LOOP_WAIT,
                "retry_timeout": RETRY_TIMEOUT,
                # A standby further behind than this is never promoted (1 MiB).
                "maximum_lag_on_failover": 1048576,
                "synchronous_mode": synchronous,
                "synchronous_mode_strict": synchronous,
                "postgresql": {
                    "use_pg_rewind": True,
                    "parameters": {
                        "max_connections": 200,
                        "wal_keep_size": "256MB",
                        # Our fault is a killed process or host, never a lost page cache: skip the
                        # flushes to keep the bed fast. Replication and commits behave as in production.
                        "fsync": "off",
                    },
                },
            },
            "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
        },
        "postgresql": {
            "listen": f"{ip},127.0.0.1:{PG_PORT}",
            "connect_address": f"{ip}:{PG_PORT}",
            "data_dir": str(home / "data"),
            "bin_dir": str(PG_BIN),
            "pgpass": str(home / "pgpass"),
            "authentication": {
                "superuser": {"username": "postgres"},
                "replication": {"username": "postgres"},
                "rewind": {"username": "postgres"},
            },
            "parameters": {"unix_socket_directories": str(home)},
            "pg_hba": trust,
        },
        "tags": {},
    }


def etcd_argv(root: Path, host: str) -> list[str]:
    ip = HA_IPS[host]
    cluster = ",".join(f"{h}=http://{HA_IPS[h]}:{ETCD_PEER_PORT}" for h in HA_HOSTS)
    return [
        str(ETCD),
        "--name",
        host,
        "--data-dir",
        str(root / host / "etcd"),
        "--listen-peer-urls",
        f"http://{ip}:{ETCD_PEER_PORT}",
        "--initial-advertise-peer-urls",
        f"http://{ip}:{ETCD_PEER_PORT}",
        "--listen-client-urls",
        f"http://{ip}:{ETCD_CLIENT_PORT},http://127.0.0.1:{ETCD_CLIENT_PORT}",
        "--advertise-client-urls",
        f"http://{ip}:{ETCD_CLIENT_PORT}",
        "--initial-cluster",
        cluster,
        "--initial-cluster-state",
        "new",
        "--initial-cluster-token",
        "quayutec-bed",
        "--heartbeat-interval",
        "100",
        "--election-timeout",
        "1000",
        # Patroni talks to etcd's v2 API (see above, at SERVICE_PORTS).
        "--enable-v2=true",
    ]


def as_user() -> list[str]:
    return ["setpriv", f"--reuid={HA_USER}", f"--regid={HA_USER}", "--init-groups", "--"]


@dataclass
class Member:
    """One database host's processes as the bed started them (Patroni's PostgreSQL is Patroni's child)."""

    host: str
    etcd: subprocess.Popen[bytes] | None = None
    patroni: subprocess.Popen[bytes] | None = None


@dataclass
class HaDatabase:
    """The three database hosts. ``enter(host, argv)`` runs ``argv`` in the host's network namespace;
    ``ns_of(host)`` is the path of that namespace (to find every process of the host)."""

    root: Path
    log_dir: Path
    enter: Callable[[str, Sequence[str]], list[str]]
    ns_of: Callable[[str], str]
    synchronous: bool = True
    members: dict[str, Member] = field(default_factory=dict)

    # -- start and stop ----------------------------------------------------------------------------

    def start(self) -> None:
        check_packages()
        user = pwd.getpwnam(HA_USER)
        for host in HA_HOSTS:
            home = self.root / host
            home.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chown(home, user.pw_uid, user.pw_gid)
            config = home / "patroni.yml"
            config.write_text(yaml.safe_dump(patroni_config(self.root, host, synchronous=self.synchronous)))
            os.chown(config, user.pw_uid, user.pw_gid)
        (self.root / "patronictl.yml").write_text(
            yaml.safe_dump(
                {
                    "scope": SCOPE,
                    "namespace": "/qy/",
                    "etcd": {"hosts": [f"{HA_IPS[h]}:{ETCD_CLIENT_PORT}" for h in HA_HOSTS]},
                }
            )
        )
        for host in HA_HOSTS:
            self.members[host] = Member(host)
            self._start_etcd(host)
        for host in HA_HOSTS:
            self._start_patroni(host)

    def _spawn(self, host: str, what: str, argv: Sequence[str], *, user: bool = True) -> subprocess.Popen[bytes]:
        log = (self.log_dir / f"{host}-{what}.log").open("ab")
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(self.root / host)}
        proc = subprocess.Popen(
            self.enter(host, ["setpriv", "--pdeathsig", "KILL", "--", *(as_user() if user else []), *argv]),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.root / host,
        )
        log.close()
        return proc

    def _start_etcd(self, host: str) -> None:
        self.members[host].etcd = self._spawn(host, "etcd", etcd_argv(self.root, host))

    def _start_patroni(self, host: str) -> None:
        # Patroni as the first process of a PID namespace of its own (and /proc to match): PostgreSQL's
        # postmaster is orphaned by design, and Patroni, as PID 1, reaps it (it waits for its postmaster
        # to be gone before it starts it again as a standby: a zombie nobody reaps stalls a switchover).
        own_pids = ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--"]
        argv = [*own_pids, *as_user(), str(PATRONI), str(self.root / host / "patroni.yml")]
        self.members[host].patroni = self._spawn(host, "patroni", argv, user=False)

    def start_host(self, host: str) -> None:
        """The host's etcd member and Patroni started afresh on their old data (Patroni starts
        PostgreSQL, which rejoins as a standby of whoever leads now, rewound if it had diverged)."""
        self.members[host] = Member(host)
        self._start_etcd(host)
        self._start_patroni(host)

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL to every process of the host (etcd, Patroni, PostgreSQL and its backends); their pids."""
        ns = os.readlink(self.ns_of(host))
        killed = []
        holder = self.ns_of(host).split("/")[2]
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or entry.name == holder:
                continue
            try:
                if os.readlink(entry / "ns" / "net") != ns:
                    continue
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
            except (OSError, ProcessLookupError):
                continue
        member = self.members.get(host)
        if member is not None:
            for proc in (member.etcd, member.patroni):
                if proc is not None:
                    proc.wait()
        return killed

    def stop(self) -> None:
        """Every process of every database host killed (the bed's data goes with it: no need to be gentle)."""
        for host in list(self.members):
            self.kill_host(host)
        self.members.clear()

    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [p for m in self.members.values() for p in (m.etcd, m.patroni) if p is not None]

    # -- what Patroni says -------------------------------------------------------------------------

    def status(self, host: str, timeout: float = 0.5) -> dict[str, Any] | None:
        """Patroni's view of ``host`` (its REST API's ``/patroni``), or None when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://{HA_IPS[host]}:{PATRONI_PORT}/patroni", timeout=timeout) as r:
                got: dict[str, Any] = json.loads(r.read())
                return got
        except (OSError, ValueError):
            return None

    def statuses(self, hosts: Sequence[str] = HA_HOSTS) -> dict[str, dict[str, Any] | None]:
        with ThreadPoolExecutor(len(hosts)) as pool:
            return dict(zip(hosts, pool.map(self.status, hosts), strict=True))

    def primaries(self, hosts: Sequence[str] = HA_HOSTS) -> list[str]:
        """The hosts whose PostgreSQL runs as a primary right now (more than one: split brain)."""
        return [
            h
            for h, s in self.statuses(hosts).items()
            if s is not None and s.get("role") in ("master", "primary") and s.get("state") == "running"
        ]

    def cluster(self, via: Sequence[str] = HA_HOSTS) -> dict[str, Any]:
        """The cluster as one member sees it (``/cluster``: members, roles, lag, leader): the running
        primary's view when there is one. A member just healed from a cut reads its own etcd member,
        which may still hold the keys from before the cut (etcd v2 reads are served locally), and so
        may call itself the leader for a moment after it has followed the new one."""
        for host in dict.fromkeys([*self.primaries(via), *via]):
            try:
                with urllib.request.urlopen(f"http://{HA_IPS[host]}:{PATRONI_PORT}/cluster", timeout=2) as r:
                    got: dict[str, Any] = json.loads(r.read())
                    return got
            except (OSError, ValueError):
                continue
        raise HaError(f"no Patroni of {', '.join(via)} answers")

    def roles(self, via: Sequence[str] = HA_HOSTS) -> dict[str, str]:
        """Each member's role as the cluster sees it: leader, sync_standby, replica."""
        return {m["name"]: f"{m['role']}/{m['state']}" for m in self.cluster(via).get("members", [])}

    def sync_standbys(self, via: Sequence[str] = HA_HOSTS) -> list[str]:
        return [m["name"] for m in self.cluster(via).get("members", []) if m["role"] == "sync_standby"]

    def wait_for(self, what: str, check: Callable[[], bool], limit: float, every: float = 0.2) -> float:
        started = time.monotonic()
        while not _holds(check):
            if time.monotonic() - started > limit:
                raise HaError(f"{what}: not within {limit:g} s; cluster {self._safe_roles()}")
            time.sleep(every)
        return time.monotonic() - started

    def wait_primary(self, *, among: Sequence[str] = HA_HOSTS, limit: float = 60.0) -> str:
        self.wait_for("a primary", lambda: len(self.primaries(among)) == 1, limit)
        return self.primaries(among)[0]

    def wait_healthy(self, limit: float = 90.0) -> None:
        """One leader, one synchronous standby (in synchronous mode), every member streaming."""

        def healthy() -> bool:
            try:
                members = self.cluster().get("members", [])
            except HaError:
                return False
            if len(members) != len(HA_HOSTS) or any(m["state"] not in ("running", "streaming") for m in members):
                return False
            leaders = [m for m in members if m["role"] == "leader"]
            syncs = [m for m in members if m["role"] == "sync_standby"]
            # The leader of the view is the one host whose PostgreSQL runs as the primary, and every
            # other member streams from it (the primary's pg_stat_replication, as its Patroni reports
            # it): a member that came back with a history of its own never streams.
            primary = leaders[0]["name"] if len(leaders) == 1 else None
            if primary is None or self.primaries() != [primary]:
                return False
            own = self.status(primary, timeout=1.0) or {}
            streaming = {r.get("application_name") for r in own.get("replication", []) if r.get("state") == "streaming"}
            if streaming != set(HA_HOSTS) - {primary}:
                return False
            return len(syncs) == 1 or not self.synchronous

        self.wait_for("a healthy cluster", healthy, limit)

    def _safe_roles(self) -> dict[str, str] | str:
        try:
            return self.roles()
        except (HaError, KeyError):
            return "unknown"

    def local_sql(self, host: str, sql: str, *, timeout: float = 5.0) -> tuple[bool, str]:
        """``sql`` through ``psql`` inside the host's own namespace (on loopback: reached even when the
        host is cut from every other); whether it succeeded, and its output or error."""
        argv = self.enter(
            host, [str(PG_BIN / "psql"), "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-XAtc", sql]
        )
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout,
                env={"PATH": "/usr/bin:/bin", "PGCONNECT_TIMEOUT": "2"},
            )
        except subprocess.TimeoutExpired:
            return False, f"no answer within {timeout:g} s"
        return done.returncode == 0, (done.stdout if done.returncode == 0 else done.stderr).strip()

    # -- what an operator does ---------------------------------------------------------------------

    def patronictl(self, *args: str, timeout: float = 60.0) -> str:
        """``patronictl`` against the cluster, from the namespace the bed runs in."""
        done = subprocess.run(
            [str(PATRONICTL), "-c", str(self.root / "patronictl.yml"), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(self.root)},
        )
        if done.returncode != 0:
            raise HaError(f"patronictl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def reinit(self, host: str) -> str:
        """Rebuild ``host``'s data from the primary (``patronictl reinit``): what an operator does with a
        member that cannot follow the new primary."""
        return self.patronictl("reinit", SCOPE, host, "--force")

    def switchover(self, leader: str, candidate: str) -> str:
        return self.patronictl("switchover", SCOPE, "--leader", leader, "--candidate", candidate, "--force")

    def set_config(self, **values: Any) -> None:
        """Change the cluster's dynamic configuration (Patroni's ``PATCH /config``) on any member."""
        body = json.dumps(values).encode()
        for host in HA_HOSTS:
            request = urllib.request.Request(
                f"http://{HA_IPS[host]}:{PATRONI_PORT}/config",
                data=body,
                method="PATCH",
                headers={"content-type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=5) as answer:
                    answer.read()
                    return
            except (OSError, urllib.error.HTTPError):
                continue
        raise HaError("no Patroni accepted the configuration change")

    def set_synchronous(self, synchronous: bool) -> None:
        """Synchronous (strict) or asynchronous replication from now on; waits until the cluster runs so."""
        self.synchronous = synchronous
        self.set_config(
            synchronous_mode=synchronous,
            synchronous_mode_strict=synchronous,
            # Asynchronous is the negative control: let a lagging standby be promoted, as with no Patroni at all.
            maximum_lag_on_failover=1048576 if synchronous else 1 << 40,
        )
        self.wait_for(
            "the replication mode",
            lambda: bool(self.sync_standbys()) == synchronous,
            limit=30,
        )


def _holds(check: Callable[[], bool]) -> bool:
    """``check()``, False while no Patroni answers (a loaded machine may keep one from answering in time)."""
    try:
        return check()
    except (HaError, KeyError, IndexError):
        return False
