"""The bench comparison's tooling (bench/compare.py, the benches' --json): the figures a real bench run
writes, read back beside its table, and the per-round ratios new/baseline. No venv is built, no
timing is asserted: both sides are this checkout on this interpreter."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
import pytest

from bench import compare, statements
from bench.common import BenchError, read_figures, write_figures
from quayutec.sql import Queries

REPO = Path(__file__).resolve().parent.parent
CLAIMS = Path("bench/claims.py")
CLAIMS_ARGS = ["--seconds", "0.2", "--concurrency", "1", "--default-only", "--no-coalesced"]
CLAIMS_RATE = "default (batched): ClaimOnce per call c=1 claims/s"
CLAIMS_RAW = "default (batched): ClaimOnce per call c=1 raw/s"
CLAIMS_RATIO = "default (batched): ClaimOnce per call c=1 gRPC/raw"
# The claims bench's table row of the same measurement: name, concurrency, claims/s, raw/s, gRPC/raw.
TABLE_ROW = re.compile(r"^default \(batched\): ClaimOnce per call\s+1\s+(\d+)\s+(\d+)\s+([\d.]+)$", re.MULTILINE)


def test_two_rounds_of_the_claims_bench_give_each_figure_the_ratio_of_its_rounds(
    pg_server_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATABASE_URL", pg_server_url)
    here = Path(sys.executable)
    baseline = compare.Side("baseline", REPO, here, "this checkout as the baseline")
    new = compare.Side("new", REPO, here, "this checkout as the new side")

    rounds = compare.run_rounds(baseline, new, CLAIMS, CLAIMS_ARGS, 2, tmp_path)

    assert len(rounds) == 2
    for i, one in enumerate(rounds, start=1):
        assert one["baseline"].keys() == one["new"].keys() >= {CLAIMS_RATE, CLAIMS_RAW, CLAIMS_RATIO}
        for side in compare.SIDES:
            figures = one[side]
            rate, raw, ratio = figures[CLAIMS_RATE], figures[CLAIMS_RAW], figures[CLAIMS_RATIO]
            assert rate is not None and raw is not None and ratio is not None
            assert rate > 0 and raw > 0
            assert ratio == pytest.approx(rate / raw)
            # The JSON is the same measurement as the human table the run printed (kept in its log).
            printed = TABLE_ROW.search((tmp_path / f"round-{i}-{side}.log").read_text())
            assert printed is not None
            assert int(printed.group(1)) == round(rate)
            assert int(printed.group(2)) == round(raw)
            assert float(printed.group(3)) == pytest.approx(ratio, abs=0.005)

    rows = {row.figure: row for row in compare.summarize(rounds)}
    assert rows.keys() == rounds[0]["baseline"].keys()
    for name, row in rows.items():
        pairs = [(r["baseline"][name], r["new"][name]) for r in rounds]
        expected = [n / b for b, n in pairs if b and n is not None]
        assert row.ratios == pytest.approx(expected)
        if len(expected) == 2:
            assert row.median == pytest.approx((expected[0] + expected[1]) / 2)
            assert (row.low, row.high) == (min(expected), max(expected))
        base = [b for b, _ in pairs if b is not None]
        assert row.baseline == pytest.approx(sum(base) / len(base))


def test_ratios_skip_a_round_with_a_missing_or_zero_baseline() -> None:
    rounds: list[compare.RoundFigures] = [
        {"baseline": {"runs/s": 10.0, "p50 ms": 4.0}, "new": {"runs/s": 5.0, "p50 ms": None}},
        {"baseline": {"runs/s": 20.0, "p50 ms": 0.0}, "new": {"runs/s": 30.0, "p50 ms": 2.0}},
        {"baseline": {"runs/s": 0.0, "p50 ms": 8.0}, "new": {"runs/s": 7.0, "p50 ms": 2.0, "only new": 1.0}},
        {"baseline": {"runs/s": 40.0, "p50 ms": 5.0}, "new": {"runs/s": 40.0, "p50 ms": 5.0}},
    ]
    rows = {row.figure: row for row in compare.summarize(rounds)}

    runs = rows["runs/s"]
    assert runs.ratios == [0.5, 1.5, 1.0]
    assert (runs.median, runs.low, runs.high) == (1.0, 0.5, 1.5)
    assert (runs.baseline, runs.new) == (15.0, 18.5)
    p50 = rows["p50 ms"]
    assert p50.ratios == [0.25, 1.0]
    assert (p50.median, p50.low, p50.high) == (0.625, 0.25, 1.0)
    assert rows["only new"].ratios == []
    assert math.isnan(rows["only new"].median) and math.isnan(rows["only new"].baseline)


def test_figures_round_trip_as_strict_json_with_nan_as_null(tmp_path: Path) -> None:
    path = tmp_path / "figures.json"
    write_figures(str(path), {"runs/s": 12.5, "p99 ms": float("nan")})
    assert "NaN" not in path.read_text()
    assert read_figures(path.read_text()) == {"runs/s": 12.5, "p99 ms": None}
    # A whole stdout parses: the figures are its last line.
    assert read_figures("a table\n" + path.read_text() + "\n") == {"runs/s": 12.5, "p99 ms": None}
    for bad in ("", "a table\n", '{"figures": {"x": "fast"}}', '{"other": 1}'):
        with pytest.raises(BenchError):
            read_figures(bad)


def test_the_baseline_tree_is_the_commits_files_with_this_checkouts_bench(tmp_path: Path) -> None:
    sha = compare.resolve_ref("HEAD")
    tree = tmp_path / "src"
    compare.export_tree(sha, tree)
    (tree / "bench" / "stale.py").write_text("# a bench file this checkout does not have\n")
    compare.overlay_bench(tree)

    committed = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{sha}:services/room/servicer.py"], capture_output=True, check=True
    ).stdout
    assert (tree / "services" / "room" / "servicer.py").read_bytes() == committed
    assert (tree / "bench" / "compare.py").read_bytes() == (REPO / "bench" / "compare.py").read_bytes()
    assert not (tree / "bench" / "stale.py").exists()
    assert not (tree / ".git").exists()
    with pytest.raises(BenchError, match="not a commit"):
        compare.resolve_ref("no-such-ref-for-the-bench")


def test_the_bench_to_compare_must_be_a_script_in_bench() -> None:
    assert compare.bench_script(str(REPO / "bench" / "runs.py")) == Path("bench/runs.py")
    for wrong in (str(REPO / "README.md"), str(REPO / "bench" / "missing.py"), "/tmp/runs.py"):
        with pytest.raises(BenchError):
            compare.bench_script(wrong)


def run_bench(
    script: str, args: list[str], database_url: str, tmp_path: Path
) -> tuple[subprocess.CompletedProcess[str], dict[str, float | None]]:
    """``bench/<script>`` with ``args`` on ``database_url``'s server; it must succeed. Its run and figures."""
    out = tmp_path / f"{script}.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args, "--json", str(out)],
        cwd=REPO,
        env={**os.environ, "DATABASE_URL": database_url},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done, read_figures(out.read_text())


def test_the_runs_bench_runs_ours_and_the_floor_on_the_rooms_current_statements(
    pg_server_url: str, tmp_path: Path
) -> None:
    """The floor calls the Room's own queries: a query that gains a parameter breaks it (it did once,
    unnoticed); a few runs of each side show it still runs, and every run succeeds."""
    args = ["--runs", "4", "--warmup", "1", "--concurrency", "1", "--baseline", "floor"]
    done, figures = run_bench("runs.py", args, pg_server_url, tmp_path)
    for system in ("quayutec", "floor"):
        rate = figures[f"{system} c=1 runs/s"]
        assert rate is not None and rate > 0
    assert "floor (plain calls)" in done.stdout


async def test_statement_stats_from_the_servers_log_name_each_query_and_count_its_calls(database_url: str) -> None:
    """bench/statements.py's reading of PostgreSQL's log_statement_stats output, on a real server's log."""
    conn = await asyncpg.connect(database_url)
    try:
        log = Path(await conn.fetchval("SELECT current_setting('data_directory')")) / "log"
        if not log.is_file():
            pytest.skip("the server's log is not on this machine (DATABASE_URL's server)")
        queries = Queries(REPO / "services" / "room" / "sql" / "queries.sql")
        offset = log.stat().st_size
        await conn.execute("SET log_min_error_statement = 'log'")
        await conn.execute("SET log_statement_stats = on")
        for _ in range(3):
            await conn.fetchrow(queries["room_event_bounds"], uuid.uuid4())
        async with conn.transaction():
            await conn.fetchrow(queries["room_event_bounds"], uuid.uuid4())
            await conn.fetchval(queries["agent_company"], uuid.uuid4())
        await conn.execute("RESET log_statement_stats")
    finally:
        await conn.close()
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")

    costs = statements.parse_statement_stats(text, statements.statement_names())

    assert costs["room.room_event_bounds"].calls == 4
    assert costs["room.agent_company"].calls == 1
    assert costs["BEGIN"].calls == 1 and costs["COMMIT"].calls == 1
    # Parse, bind and execute each took some CPU, and all of it is the statement's.
    assert costs["room.room_event_bounds"].cpu_s > 0
    assert statements.service_of("room.room_event_bounds") == "room"
    assert statements.service_of("COMMIT") == "BEGIN/COMMIT"


def test_the_tables_bench_measures_and_explains_the_rooms_statements(pg_server_url: str, tmp_path: Path) -> None:
    """Like the floor, bench/tables.py calls the Room's queries itself (its EXPLAIN ANALYZE of each)."""
    done, figures = run_bench("tables.py", ["--sizes", "0", "--calls", "10"], pg_server_url, tmp_path)
    for call in ("PostMessage", "ReadRunContext", "SettleWake"):
        p50 = figures[f"{call} 0 rows p50 ms"]
        assert p50 is not None and p50 > 0
    for statement in ("post_check", "insert_message_with_wakes", "run_context", "lease_wakes"):
        assert f"\n-- {statement}\n" in done.stdout
