"""File descriptors for the runs in flight: a run waiting on its model holds one provider socket.

The Runtime raises its soft ``RLIMIT_NOFILE`` to the hard limit at start (the soft limit is often
1024 while the hard one is far higher) and refuses to start when that still cannot hold one socket
per run plus a reserve for everything else (gRPC listeners and channels, logs, the exporter, TLS
files): better a clear error at start than runs failing with EMFILE under load.
"""

from __future__ import annotations

import logging
import resource

from quayutec.config import RUNTIME, ConfigError

# Descriptors kept for what is not a run: listeners, channels, log files, exporters, /proc reads.
FD_RESERVE = 256

_log = logging.getLogger(__name__)


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (when the system lets us); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft == resource.RLIM_INFINITY or soft >= hard:
        return soft if soft != resource.RLIM_INFINITY else 1 << 30
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        _log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard


def fds_needed(max_runs: int) -> int:
    """Descriptors the Runtime needs with ``max_runs`` runs in flight."""
    return max_runs + FD_RESERVE


def check_fd_budget(max_runs: int, limit: int) -> None:
    """ConfigError unless ``limit`` open files cover ``max_runs`` runs in flight."""
    need = fds_needed(max_runs)
    if limit < need:
        raise ConfigError(
            f"{RUNTIME.prefix}MAX_RUNS={max_runs} needs {need} open files (one provider socket per run plus "
            f"{FD_RESERVE}) but this process may open {limit}: raise the hard limit (`ulimit -Hn`, "
            f"LimitNOFILE=, docker --ulimit nofile=) or lower {RUNTIME.prefix}MAX_RUNS to at most "
            f"{max(1, limit - FD_RESERVE)}"
        )


def ensure_fd_budget(max_runs: int) -> int:
    """Raise the soft limit and check it covers ``max_runs``; returns the limit in effect."""
    limit = raise_fd_limit()
    check_fd_budget(max_runs, limit)
    return limit
