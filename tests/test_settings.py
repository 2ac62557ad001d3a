"""One source of truth for settings: every variable the code reads is declared in
quayutec/settings.py, docs/settings.md's table is generated from those declarations, and `quayutec config`
prints them with the values in effect."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from quayutec.config import ConfigError
from quayutec.server import process_settings
from quayutec.settings import SETTINGS, for_service, setting
from services.claims.config import ClaimsConfig
from services.gateway.config import GatewayConfig
from services.runtime.config import RuntimeConfig

REPO = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("quayutec", "services") for p in (REPO / d).rglob("*.py") if "v1" not in p.parts]
# Process plumbing, not settings: the stack hands its children the import path.
NOT_SETTINGS = {"PYTHONPATH"}

# A variable named in a string literal ("QUAYUTEC_X", "OTEL_X", "DATABASE_URL"), read with a literal
# name (env.get("X"), os.environ["X"], os.getenv("X")), or built from a service prefix (f"{p}X").
_NAMED = re.compile(r"""["'](QUAYUTEC_[A-Z0-9_]*[A-Z0-9]|OTEL_[A-Z0-9_]+|DATABASE_URL)["']""")
_READ = re.compile(r"""(?:environ\.get|env\.get|getenv|environ\[)\(?\s*["']([A-Za-z0-9_]+)["']""")
_PREFIXED = re.compile(r"""\{(?:p|P|prefix|spec\.prefix|self\.prefix|[A-Z]+\.prefix)\}([A-Z0-9_]+)""")


def undeclared(text: str) -> set[str]:
    """Names a source text reads or names that quayutec/settings.py does not declare."""
    found = {m for m in _NAMED.findall(text) if m not in SETTINGS}
    found |= {m for m in _READ.findall(text) if m not in SETTINGS and m not in NOT_SETTINGS}
    suffixes = {name.split("_", 2)[2] for name in SETTINGS if name.startswith("QUAYUTEC_") and name.count("_") >= 2}
    found |= {f"<prefix>{m}" for m in _PREFIXED.findall(text) if m not in suffixes}
    return found


def test_the_scan_catches_an_undeclared_read() -> None:
    assert undeclared('os.environ.get("QUAYUTEC_NOT_A_SETTING", "")') == {"QUAYUTEC_NOT_A_SETTING"}
    assert undeclared('env.get("HOME")') == {"HOME"}
    assert undeclared('env_int(env, f"{p}NO_SUCH_THING", 3)') == {"<prefix>NO_SUCH_THING"}
    assert undeclared('env_int(env, setting(f"{P}MAX_RUNS"), minimum=1)') == set()


def test_the_code_reads_only_declared_settings() -> None:
    found = {f"{p.relative_to(REPO)}: {name}" for p in SOURCES for name in undeclared(p.read_text())}
    assert found == set(), "declare these in quayutec/settings.py (name, default, meaning, service)"


def _gen_table(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_settings_table.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_settings_table_is_generated_from_the_declarations(tmp_path: Path) -> None:
    checked = _gen_table("--check")
    assert checked.returncode == 0, checked.stderr
    current = (REPO / "docs" / "settings.md").read_text()
    for name in SETTINGS:
        assert f"| `{name}` |" in current
    assert "| `QUAYUTEC_" not in (REPO / "README.md").read_text()  # the table lives in docs/settings.md only
    # A page whose table lost a row is stale, and regenerating it puts the row back.
    stale = tmp_path / "settings.md"
    stale.write_text(current.replace("| `QUAYUTEC_RUNTIME_MAX_RUNS` |", "| `QUAYUTEC_RUNTIME_MAX_RUNZ` |"))
    refused = _gen_table("--check", "--page", str(stale))
    assert refused.returncode == 1 and "stale" in refused.stderr
    assert _gen_table("--page", str(stale)).returncode == 0
    assert stale.read_text() == current


def test_readers_use_the_declared_defaults() -> None:
    runtime = RuntimeConfig.from_env({})
    assert runtime.max_runs == setting("QUAYUTEC_RUNTIME_MAX_RUNS").default
    assert runtime.anthropic_base_url == setting("QUAYUTEC_RUNTIME_ANTHROPIC_BASE_URL").default
    assert runtime.server.listen == setting("QUAYUTEC_RUNTIME_LISTEN").default
    assert runtime.room_addr == setting("QUAYUTEC_ROOM_ADDR").default
    gateway = GatewayConfig.from_env({})
    assert gateway.delivery.lease_seconds == setting("QUAYUTEC_GATEWAY_LEASE_SECONDS").default
    assert gateway.rate_limit.burst == setting("QUAYUTEC_GATEWAY_POST_BURST").default
    claims = ClaimsConfig.from_env({})
    assert claims.batch_max == setting("QUAYUTEC_CLAIMS_BATCH_MAX").default
    assert claims.database.pool_max == setting("QUAYUTEC_CLAIMS_DB_POOL_MAX").default
    assert gateway.delivery.not_started_after_seconds == setting("QUAYUTEC_GATEWAY_NOT_STARTED_AFTER_SECONDS").default
    # And the environment still wins.
    assert RuntimeConfig.from_env({"QUAYUTEC_RUNTIME_MAX_RUNS": "3"}).max_runs == 3


def test_failpoints_name_step_boundaries_and_how_many_runs_pass_first() -> None:
    env = {"QUAYUTEC_RUNTIME_FAILPOINTS": "before_room_read:70, model_called"}
    assert RuntimeConfig.from_env(env).failpoints == {"before_room_read": 70, "model_called": 0}
    for wrong, says in (("nowhere", "unknown point 'nowhere'"), ("claimed:x", "NAME or NAME:N")):
        with pytest.raises(ConfigError, match=says):
            RuntimeConfig.from_env({"QUAYUTEC_RUNTIME_FAILPOINTS": wrong})


def test_quayutec_config_prints_the_values_in_effect() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "QUAYUTEC_RUNTIME_MAX_RUNS": "7",
        "QUAYUTEC_ENCRYPTION_KEY": "not-shown-anywhere",
    }
    env.pop("QUAYUTEC_RUNTIME_RUN_SECONDS", None)
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "config", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    assert set(rows) == set(SETTINGS)
    assert (
        rows["QUAYUTEC_RUNTIME_MAX_RUNS"]["value"] == "7" and rows["QUAYUTEC_RUNTIME_MAX_RUNS"]["from"] == "environment"
    )
    assert rows["QUAYUTEC_RUNTIME_RUN_SECONDS"] == {
        "name": "QUAYUTEC_RUNTIME_RUN_SECONDS",
        "value": "300",
        "from": "default",
        "read_by": "runtime",
        "meaning": setting("QUAYUTEC_RUNTIME_RUN_SECONDS").meaning,
    }
    assert "not-shown-anywhere" not in done.stdout and rows["QUAYUTEC_ENCRYPTION_KEY"]["value"] == "(set, hidden)"
    table = subprocess.run(
        [sys.executable, "-m", "services.cli", "config", "--service", "claims"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.splitlines()
    assert table[0].split()[:4] == ["NAME", "VALUE", "FROM", "READ_BY"]
    assert len(table) == 1 + len(for_service("claims"))


def test_the_process_settings_default_to_uvloop_and_info_and_refuse_other_values() -> None:
    assert process_settings({}) == ("uvloop", logging.INFO)
    assert process_settings({"QUAYUTEC_EVENT_LOOP": "asyncio", "QUAYUTEC_LOG_LEVEL": "warning"}) == (
        "asyncio",
        logging.WARNING,
    )
    with pytest.raises(ConfigError, match=r"QUAYUTEC_EVENT_LOOP must be one of uvloop, asyncio, got 'trio'"):
        process_settings({"QUAYUTEC_EVENT_LOOP": "trio"})
    with pytest.raises(ConfigError, match=r"QUAYUTEC_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR"):
        process_settings({"QUAYUTEC_LOG_LEVEL": "loud"})


def test_a_service_process_runs_on_the_configured_event_loop(tmp_path: Path) -> None:
    """run_service, as `python -m services.<name>` calls it, on each loop (a tiny main, no server)."""
    script = (
        "import asyncio, sys\n"
        "from quayutec.server import run_service\n"
        "async def main():\n"
        "    print(type(asyncio.get_running_loop()).__module__)\n"
        "run_service(main, 'claims')\n"
    )
    seen = {}
    for name in ("uvloop", "asyncio"):
        env = {**os.environ, "QUAYUTEC_EVENT_LOOP": name, "OTEL_TRACES_EXPORTER": "none"}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        seen[name] = out.stdout.strip()
    assert seen["uvloop"].startswith("uvloop")
    assert seen["asyncio"].startswith("asyncio")
