"""`make jaeger` and `make jaeger-stop`: a local Jaeger v2 to read the demo's traces in.

    python3 scripts/jaeger.py up BINARY CONFIG   # start it in the background, wait until it is healthy
    python3 scripts/jaeger.py down               # stop the one started here

`up` runs the binary `make jaeger-bin` built with deploy/k8s/base/jaeger-config.yaml, its log and pid
in <QUAYUTEC_DATA_DIR>/jaeger/ (.quayutec/jaeger/), waits until its health check (GET /status)
answers, and prints where to send traces and where to read them. It refuses, saying why, when one
started here still runs or another program holds one of its ports. Addresses are the config's
variables (JAEGER_OTLP_GRPC_ADDR, ...; loopback by default); `quayutec demo` reads the same ones.

The work is in quayutec/jaeger.py (the demo shares its addresses and health check); this file is its
command line. Standard library only, so it runs before .venv exists.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from quayutec.envread import ConfigError  # noqa: E402
from quayutec.jaeger import LOG_FILE, JaegerError, folder, start, stop  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/jaeger.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start Jaeger in the background and wait until it is healthy")
    up.add_argument("binary", type=Path, help="the jaeger binary (`make jaeger-bin` prints its path)")
    up.add_argument("config", type=Path, help="its config file (deploy/k8s/base/jaeger-config.yaml)")
    up.add_argument("--wait", type=float, default=60.0, help="seconds to wait for its health check (default 60)")
    sub.add_parser("down", help="stop the Jaeger started here")
    opts = p.parse_args(argv)
    try:
        if opts.action == "up":
            if not opts.binary.is_file():
                raise JaegerError(f"no Jaeger binary at {opts.binary}: `make jaeger-bin` builds it")
            jaeger = start(opts.binary, opts.config, limit=opts.wait)
            print(f"Jaeger v2 runs in the background (log {folder() / LOG_FILE}):")
            print(f"  send traces to    OTEL_EXPORTER_OTLP_ENDPOINT={jaeger.otlp_endpoint}  (OTLP/gRPC)")
            print(f"  read them at      {jaeger.ui_url}  (query API: {jaeger.ui_url}/api/v3/traces/TRACE_ID)")
            print("  `make demo` now traces to it; `make jaeger-stop` stops it (its traces are kept in memory only)")
        else:
            pid = stop()
            print(f"Jaeger (pid {pid}) stopped" if pid is not None else "no Jaeger started here runs")
    except (JaegerError, ConfigError) as exc:
        print(f"make jaeger: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
