"""A newcomer's Jaeger: `make jaeger` starts Jaeger v2 in the background and `make demo` traces to it.

- `make jaeger` on ports of its own (the config's JAEGER_* variables) and a data folder of its own:
  it answers, says where to send traces and read them, refuses a second start, and `make jaeger-stop`
  stops it; a port held by another program is refused, naming the variable that moves it;
- the demo, run beside the session's Jaeger (tests.harness.jaeger) with those same variables, traces
  to it: its first run's trace, read back through Jaeger's query API, holds spans of all four services.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import httpx

from services.stack import free_port
from tests.harness.jaeger import Jaeger
from tests.test_cli import quayutec

REPO = Path(__file__).resolve().parent.parent
FOUR = {"quayutec-gateway", "quayutec-room", "quayutec-claims", "quayutec-runtime"}
NAMES = ("JAEGER_OTLP_GRPC_ADDR", "JAEGER_OTLP_HTTP_ADDR", "JAEGER_QUERY_HTTP_ADDR", "JAEGER_QUERY_GRPC_ADDR")


def _make(target: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-s", "--no-print-directory", target],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=1800,  # a cold build of the binary, when `make jaeger` has to make it
    )


def _own_ports(data_dir: Path) -> dict[str, str]:
    ports = {name: f"127.0.0.1:{free_port()}" for name in NAMES}
    return {
        **ports,
        "JAEGER_HEALTH_ADDR": f"127.0.0.1:{free_port()}",
        "JAEGER_METRICS_HOST": "127.0.0.1",
        "JAEGER_METRICS_PORT": str(free_port()),
        "JAEGER_MAX_TRACES": "100",
        "QUAYUTEC_DATA_DIR": str(data_dir),
    }


def test_make_jaeger_starts_it_once_and_make_jaeger_stop_stops_it(tmp_path: Path) -> None:
    env = _own_ports(tmp_path / "data")
    folder = tmp_path / "data" / "jaeger"
    started = _make("jaeger", env)
    try:
        assert started.returncode == 0, (started.stdout, started.stderr)
        pid = int((folder / "jaeger.pid").read_text())
        query = env["JAEGER_QUERY_HTTP_ADDR"]
        assert f"OTEL_EXPORTER_OTLP_ENDPOINT=http://{env['JAEGER_OTLP_GRPC_ADDR']}" in started.stdout
        assert f"http://{query}/api/v3/traces/TRACE_ID" in started.stdout
        # It is up and answers as the README says: healthy, its query API (no trace yet), the UI's placeholder.
        assert httpx.get(f"http://{env['JAEGER_HEALTH_ADDR']}/status", timeout=5).status_code == 200
        assert httpx.get(f"http://{query}/api/v3/services", timeout=5).status_code == 200
        assert "not the Jaeger UI" in httpx.get(f"http://{query}/", timeout=5).text
        assert (folder / "jaeger.log").stat().st_size > 0
        again = _make("jaeger", env)
        assert again.returncode != 0
        assert f"Jaeger already runs here (pid {pid}" in again.stderr and "make jaeger-stop" in again.stderr
    finally:
        stopped = _make("jaeger-stop", env)
    assert stopped.returncode == 0 and f"Jaeger (pid {pid}) stopped" in stopped.stdout, stopped.stderr
    assert not Path(f"/proc/{pid}/cmdline").exists() or Path(f"/proc/{pid}/cmdline").read_bytes() == b""
    assert not (folder / "jaeger.pid").exists()
    with socket.create_server(("127.0.0.1", int(env["JAEGER_HEALTH_ADDR"].rpartition(":")[2]))):
        pass  # its port is free again
    assert "no Jaeger started here runs" in _make("jaeger-stop", env).stdout


def test_a_port_another_program_holds_is_refused_naming_its_variable(tmp_path: Path) -> None:
    env = _own_ports(tmp_path / "data")
    with socket.create_server(("127.0.0.1", 0)) as other:
        env["JAEGER_QUERY_HTTP_ADDR"] = f"127.0.0.1:{other.getsockname()[1]}"
        refused = _make("jaeger", env)
    assert refused.returncode != 0
    assert f"{env['JAEGER_QUERY_HTTP_ADDR']} (query API and UI) is taken by another program" in refused.stderr
    assert "JAEGER_QUERY_HTTP_ADDR" in refused.stderr
    assert not (tmp_path / "data" / "jaeger" / "jaeger.pid").exists()


async def test_the_demo_traces_its_first_run_to_jaeger(empty_database_url: str, tmp_path: Path, jaeger: Jaeger) -> None:
    env = {k: v for k, v in jaeger.env().items() if k.startswith("JAEGER_")}
    done = await quayutec(
        "demo",
        "--then-stop",
        env={**env, "DATABASE_URL": empty_database_url, "QUAYUTEC_DATA_DIR": str(tmp_path)},
        limit=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert f"traced to the Jaeger at {jaeger.query} (OTLP {jaeger.otlp_grpc})" in out, out[:2000]
    found = re.search(r"its trace ([0-9a-f]{32}), in Jaeger's query API: (\S+)", out)
    assert found is not None, out
    trace_id, api_url = found.groups()
    assert api_url == f"{jaeger.query}/api/v3/traces/{trace_id}"
    # The first run's ledger row names that trace (the demo prints the row first).
    first_run = out[: found.start()].rsplit("\nrun ", 1)[1]
    assert f"\n  trace {trace_id}\n" in first_run
    # Read back from Jaeger itself: the wake's trace, with spans of all four services.
    spans = await jaeger.trace(trace_id, until=lambda spans: FOUR <= {s.service for s in spans})
    assert FOUR <= {s.service for s in spans}, sorted({s.service for s in spans})
    assert {s.trace_id for s in spans} == {trace_id}
    assert any(s.name == "run" and s.service == "quayutec-runtime" for s in spans)
    assert FOUR <= set(await jaeger.services())
