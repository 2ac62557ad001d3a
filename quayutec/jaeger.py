"""Jaeger, where people read our traces: the UI's address that a run links to, and a local Jaeger v2.

Three readers share this module:
- the console's run page and `quayutec run` link each of a run's traces to ``<base>/trace/<id>``,
  ``base`` being QUAYUTEC_CONSOLE_JAEGER_URL (``ui_base_url`` refuses anything but an http(s) URL
  with a host, naming the setting);
- `make jaeger` (scripts/jaeger.py) runs the Jaeger v2 binary built by `make jaeger-bin` with
  deploy/k8s/base/jaeger-config.yaml, in the background, its log and pid in ``<data folder>/jaeger``;
- `quayutec demo` traces its services to that Jaeger when its health check answers.

The local Jaeger's addresses are the config file's own variables (JAEGER_OTLP_GRPC_ADDR, ...), with
the file's loopback defaults: whoever starts Jaeger and whoever exports to it read the same ones.
Standard library only: `make jaeger` runs this with the system's Python, before any .venv exists.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from quayutec.envread import DATA_DIR_ENV, ConfigError, env_str
from quayutec.settings import setting

UI_URL_ENV = "QUAYUTEC_CONSOLE_JAEGER_URL"
FOLDER = "jaeger"
PID_FILE = "jaeger.pid"
LOG_FILE = "jaeger.log"
# The config's listeners, each by its variable: what it is, for a refusal that says which port is taken.
LISTENERS = {
    "JAEGER_OTLP_GRPC_ADDR": "OTLP/gRPC receiver",
    "JAEGER_OTLP_HTTP_ADDR": "OTLP/HTTP receiver",
    "JAEGER_QUERY_HTTP_ADDR": "query API and UI",
    "JAEGER_QUERY_GRPC_ADDR": "query gRPC API",
    "JAEGER_HEALTH_ADDR": "health check",
}


def ui_base_url(env: Mapping[str, str]) -> str:
    """QUAYUTEC_CONSOLE_JAEGER_URL without its trailing slash ("" when unset). Anything but an
    http(s) URL with a host is refused, naming the setting and the value, since a link built on it
    would lead nowhere (or, with another scheme, somewhere a link should never go)."""
    raw = env_str(env, setting(UI_URL_ENV)).strip()
    if not raw:
        return ""
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(
            f"{UI_URL_ENV} must be the Jaeger UI's http(s) address as people reach it, such as "
            f"http://localhost:16686 (no query or fragment), got {raw!r}"
        )
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ConfigError(f"{UI_URL_ENV} has a port that is not a number: {raw!r}") from None
    return raw.rstrip("/")


def trace_ids(first: str, more: Iterable[str]) -> list[str]:
    """A run's trace ids as the ledger keeps them (``Run.trace_id``, then ``Run.trace_ids``): each
    once, the first first."""
    return list(dict.fromkeys(t for t in (first, *more) if t))


def trace_page(base: str, trace_id: str) -> str:
    """The Jaeger UI's page of one trace ("" when no UI address is set)."""
    return f"{base}/trace/{trace_id}" if base else ""


@dataclass(frozen=True)
class LocalJaeger:
    """Where the local Jaeger listens (the config file's variables, with its defaults)."""

    otlp_grpc: str
    query_http: str
    health: str
    listeners: dict[str, str]
    metrics: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LocalJaeger:
        env = os.environ if env is None else env
        listeners = {name: _host_port(env, name) for name in LISTENERS}
        metrics_host = env_str(env, setting("JAEGER_METRICS_HOST")).strip()
        metrics_port = env_str(env, setting("JAEGER_METRICS_PORT")).strip()
        if not metrics_port.isdigit():
            raise ConfigError(f"JAEGER_METRICS_PORT must be a port number, got {metrics_port!r}")
        return cls(
            otlp_grpc=listeners["JAEGER_OTLP_GRPC_ADDR"],
            query_http=listeners["JAEGER_QUERY_HTTP_ADDR"],
            health=listeners["JAEGER_HEALTH_ADDR"],
            listeners=listeners,
            metrics=f"{metrics_host}:{metrics_port}",
        )

    @property
    def otlp_endpoint(self) -> str:
        """OTEL_EXPORTER_OTLP_ENDPOINT for exporting to it."""
        return f"http://{_dialable(self.otlp_grpc)}"

    @property
    def ui_url(self) -> str:
        """The query API's and UI's base address, as a browser on this machine reaches it."""
        return f"http://{_dialable(self.query_http)}"

    def api_trace_url(self, trace_id: str) -> str:
        """The query API's answer for one trace (404 "No traces found" until it is stored)."""
        return f"{self.ui_url}/api/v3/traces/{trace_id}"

    def healthy(self, timeout: float = 1.0) -> bool:
        """Whether Jaeger's health check answers 200 (GET /status): the pipeline is up."""
        try:
            with urllib.request.urlopen(f"http://{_dialable(self.health)}/status", timeout=timeout) as answer:
                return bool(answer.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def services_of(self, trace_id: str, timeout: float = 2.0) -> set[str]:
        """The service names of the spans Jaeger holds for ``trace_id`` (empty while none is stored)."""
        try:
            with urllib.request.urlopen(self.api_trace_url(trace_id), timeout=timeout) as answer:
                body = json.load(answer)
        except (OSError, urllib.error.URLError, ValueError):
            return set()
        found = set()
        for resource_spans in body.get("result", {}).get("resourceSpans", []):
            for attribute in resource_spans.get("resource", {}).get("attributes", []):
                if attribute.get("key") == "service.name":
                    found.add(str(attribute.get("value", {}).get("stringValue", "")))
        return found


def _host_port(env: Mapping[str, str], name: str) -> str:
    value = env_str(env, setting(name)).strip()
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{name} must be host:port, got {value!r}")
    return value


def _dialable(addr: str) -> str:
    """``addr`` as a client on this machine dials it (a wildcard listener is reached on loopback)."""
    host, _, port = addr.rpartition(":")
    return f"127.0.0.1:{port}" if host.strip("[]") in ("0.0.0.0", "::", "") else addr


def folder(env: Mapping[str, str] | None = None) -> Path:
    """``<QUAYUTEC_DATA_DIR>/jaeger``: the local Jaeger's pid file and log."""
    env = os.environ if env is None else env
    return Path(env_str(env, setting(DATA_DIR_ENV))).absolute() / FOLDER


class JaegerError(RuntimeError):
    """`make jaeger` or `make jaeger-stop` cannot do what was asked; the message says why and what to do."""


def running_pid(where: Path) -> int | None:
    """The pid of the Jaeger the pid file names, when that process still runs and is a jaeger."""
    try:
        pid = int((where / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return None
    return pid if Path(command.decode(errors="replace")).name == "jaeger" else None


def _taken(addr: str) -> bool:
    """Whether another program listens on ``addr`` (we bind it as Jaeger will, then let it go)."""
    host, _, port = addr.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError:
            return True
    return False


def start(binary: Path, config: Path, env: Mapping[str, str] | None = None, limit: float = 60.0) -> LocalJaeger:
    """Start Jaeger in the background (its own session, so it outlives the caller), its log and pid
    in ``folder()``, and wait until its health check answers. Refused, saying why, when one started
    here still runs or when another program holds one of its ports."""
    env = dict(os.environ if env is None else env)
    where = folder(env)
    jaeger = LocalJaeger.from_env(env)
    pid = running_pid(where)
    if pid is not None:
        raise JaegerError(
            f"Jaeger already runs here (pid {pid}, log {where / LOG_FILE}): its UI and query API at "
            f"{jaeger.ui_url}; `make jaeger-stop` stops it"
        )
    checks = [(name, addr, LISTENERS[name]) for name, addr in jaeger.listeners.items()]
    checks.append(("JAEGER_METRICS_PORT", jaeger.metrics, "Jaeger's own metrics"))
    for name, addr, what in checks:
        if _taken(addr):
            raise JaegerError(
                f"{addr} ({what}) is taken by another program: stop it, or give Jaeger another port with "
                f"{name} (then `quayutec demo` reads the same variable to find it)"
            )
    where.mkdir(parents=True, exist_ok=True)
    with (where / LOG_FILE).open("ab") as log:
        proc = subprocess.Popen(
            [str(binary.absolute()), "--config", str(config.absolute())],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (where / PID_FILE).write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + limit
    while not jaeger.healthy():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            (where / PID_FILE).unlink(missing_ok=True)
            tail = (where / LOG_FILE).read_text(errors="replace").splitlines()[-15:]
            raise JaegerError(
                f"Jaeger {'exited with ' + str(proc.returncode) if proc.returncode is not None else 'did not answer'}"
                f" before its health check at {jaeger.health} answered (within {limit:g} s); the end of its "
                f"log, {where / LOG_FILE}:\n" + "\n".join(tail)
            )
        time.sleep(0.2)
    return jaeger


def stop(env: Mapping[str, str] | None = None, limit: float = 15.0) -> int | None:
    """Stop the Jaeger started here (SIGTERM, then SIGKILL past ``limit``); its pid, or None when
    none runs. Only the process the pid file names, and only when it is a jaeger."""
    where = folder(env)
    pid = running_pid(where)
    if pid is None:
        (where / PID_FILE).unlink(missing_ok=True)
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + limit
    while running_pid(where) == pid and _alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.1)
    (where / PID_FILE).unlink(missing_ok=True)
    return pid


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
