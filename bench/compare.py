"""A change measured against a baseline commit in one run: the same bench on both trees, in
alternating rounds, and per figure the median ratio new/baseline with its spread.

``python bench/compare.py --baseline-ref REF [--rounds 3] [--bench-code current|own] [--json PATH]
-- bench/<name>.py [bench args]``

The baseline is REF's tree, exported with ``git archive`` (not a registered worktree) into
``<cache>/<sha>/src``, with a venv of its own in ``<cache>/<sha>/venv``: REF's ``pip install -e
'.[bench]'`` (its own pins) plus the current tree's ``bench`` extra (what the bench itself needs), built
once from PyPI and rebuilt when either list changes; ``<cache>`` is ``QY_BENCH_CACHE`` or
``~/.cache/quayutec-bench``. The new side is this checkout as it is (uncommitted edits included) on
the interpreter running compare.py (``.venv/bin/python`` after ``pip install -e '.[dev,bench]'``).
Neither side's venv sees the other's tree.

``--bench-code current`` (the default) copies this checkout's ``bench/`` over REF's before the rounds:
both sides run the same measurement and only the services, the common package and their pinned
dependencies differ (the current bench must still run against REF's code). ``--bench-code own`` runs
each tree's own bench script instead (REF's must accept ``--json``).

Each round runs the bench on the baseline, then on the new tree (A B A B ...), each as
``python bench/<name>.py [bench args] --json FILE`` in its own tree with its own venv, so drift on a
shared machine falls on both. The bench's output (its tables) of every run is kept in
``<cache>/compare/<time>-<name>/``, with ``compare.json``: every round's figures of both sides and the
summary. The summary gives, per figure, each side's median, the median of the per-round ratios
new/baseline and their min-max. Read a ratio by the figure's unit: for a rate (``per s``, ``runs/s``)
above 1 is better; for a latency or a cost (``ms``, ``CPU``, ``RSS``) below 1 is better.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

from bench.common import ROOT, BenchError, bench_cache_dir, print_table, read_figures

SIDES = ("baseline", "new")
# Variables that would make one side's interpreter import the other's tree or packages.
LEAKY_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")

RoundFigures = dict[str, dict[str, float | None]]  # side -> figure -> value


@dataclass(frozen=True)
class Side:
    """One tree to measure: its root, the interpreter of its venv, and what it is (a sha, or a sha plus edits)."""

    name: str
    root: Path
    python: Path
    label: str


@dataclass(frozen=True)
class Row:
    """One figure over the rounds: each side's median, and the ratio new/baseline per round."""

    figure: str
    baseline: float
    new: float
    ratios: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios) if self.ratios else float("nan")

    @property
    def low(self) -> float:
        return min(self.ratios, default=float("nan"))

    @property
    def high(self) -> float:
        return max(self.ratios, default=float("nan"))


# -- the baseline tree and its venv ----------------------------------------------------------------------


def git(*args: str) -> str:
    done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def resolve_ref(ref: str) -> str:
    try:
        return git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except BenchError as exc:
        raise BenchError(f"--baseline-ref {ref} is not a commit of this repository") from exc


def export_tree(sha: str, dest: Path, *paths: str) -> None:
    """The files of commit ``sha`` (or only those under ``paths``) into ``dest`` (replaced), from ``git archive``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", sha, *paths], capture_output=True)
    if archive.returncode != 0:
        raise BenchError(f"git archive {sha}: {archive.stderr.decode(errors='replace').strip()}")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")


def overlay_bench(tree: Path) -> None:
    """Replace ``tree``'s bench/ by this checkout's."""
    shutil.rmtree(tree / "bench", ignore_errors=True)
    shutil.copytree(ROOT / "bench", tree / "bench", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def bench_requirements(pyproject: Path) -> list[str]:
    """The ``bench`` extra of a pyproject.toml."""
    data = tomllib.loads(pyproject.read_text())
    extras = data.get("project", {}).get("optional-dependencies", {})
    return [str(r) for r in extras.get("bench", [])]


def ensure_venv(tree: Path, venv: Path, extra: Sequence[str]) -> Path:
    """A venv with ``tree`` installed with its ``bench`` extra and ``extra``, rebuilt when either changes."""
    stamp = hashlib.sha1("\n".join([(tree / "pyproject.toml").read_text(), *extra, sys.version]).encode()).hexdigest()
    python = venv / "bin" / "python"
    stamp_file = venv / ".quayutec-bench-stamp"
    if python.exists() and stamp_file.exists() and stamp_file.read_text() == stamp:
        return python
    shutil.rmtree(venv, ignore_errors=True)
    log = venv.parent / "venv-install.log"
    print(f"building the baseline venv in {venv} (log: {log}) ...", file=sys.stderr, flush=True)
    with log.open("w") as out:
        for command in (
            [sys.executable, "-m", "venv", str(venv)],
            [str(python), "-m", "pip", "install", "--quiet", "-e", f"{tree}[bench]", *extra],
        ):
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=side_env()).returncode != 0:
                raise BenchError(f"{' '.join(command)} failed; see {log}")
    stamp_file.write_text(stamp)
    return python


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (one comparison per baseline tree at a time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another comparison holding {path} ...", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def prepare_baseline(sha: str, label: str, cache: Path, bench_code: str) -> Side:
    """REF's tree (exported once) with this checkout's bench/ over it unless ``bench_code`` is "own", and its venv."""
    base = cache / sha
    tree = base / "src"
    done = tree / ".quayutec-bench-exported"
    if not done.exists():
        export_tree(sha, tree)
        done.touch()
    if bench_code == "current":
        overlay_bench(tree)
    else:  # the tree's own bench/, as committed (an earlier run may have copied ours over it)
        shutil.rmtree(tree / "bench", ignore_errors=True)
        scratch = base / "own-bench"
        export_tree(sha, scratch, "bench")
        shutil.move(scratch / "bench", tree / "bench")
        shutil.rmtree(scratch)
    python = ensure_venv(tree, base / "venv", bench_requirements(ROOT / "pyproject.toml"))
    return Side("baseline", tree, python, label)


def current_side() -> Side:
    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain")
    return Side("new", ROOT, Path(sys.executable), f"{head}{' + uncommitted edits' if dirty else ''}")


# -- the rounds -------------------------------------------------------------------------------------------


def side_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in LEAKY_ENV}


def bench_script(raw: str) -> Path:
    """The bench's path relative to the repository root (it must be a script in bench/)."""
    path = Path(raw)
    path = (path if path.is_absolute() else Path.cwd() / path).resolve()
    try:
        rel = path.relative_to(ROOT)
    except ValueError as exc:
        raise BenchError(f"{raw} is not in this checkout ({ROOT})") from exc
    if rel.parent != Path("bench") or rel.suffix != ".py" or not path.exists():
        raise BenchError(f"{raw} is not a bench script of this checkout (bench/<name>.py)")
    return rel


def run_once(side: Side, script: Path, args: Sequence[str], out_dir: Path, tag: str) -> dict[str, float | None]:
    """One run of the bench on ``side``; its figures. Its output goes to ``<out_dir>/<tag>.log``."""
    figures_path = out_dir / f"{tag}.json"
    log_path = out_dir / f"{tag}.log"
    command = [str(side.python), str(side.root / script), *args, "--json", str(figures_path)]
    started = time.monotonic()
    with log_path.open("w") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        code = subprocess.run(command, cwd=side.root, env=side_env(), stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0 or not figures_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise BenchError(f"{tag}: the bench exited with {code}; {log_path} ends:\n{tail}")
    print(f"  {tag}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return read_figures(figures_path.read_text())


def run_rounds(
    baseline: Side, new: Side, script: Path, args: Sequence[str], rounds: int, out_dir: Path
) -> list[RoundFigures]:
    """``rounds`` rounds of the bench, each the baseline then the new tree."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[RoundFigures] = []
    for i in range(1, rounds + 1):
        results.append(
            {side.name: run_once(side, script, args, out_dir, f"round-{i}-{side.name}") for side in (baseline, new)}
        )
    return results


def summarize(rounds: Sequence[Mapping[str, Mapping[str, float | None]]]) -> list[Row]:
    """Per figure either side reported: each side's median over the rounds, and new/baseline per round
    (a round where either value is missing, or the baseline's is 0, gives no ratio)."""
    names = sorted({name for r in rounds for side in SIDES for name in r[side]})
    rows = []
    for name in names:
        pairs = [(r["baseline"].get(name), r["new"].get(name)) for r in rounds]
        base = [b for b, _ in pairs if b is not None]
        new = [n for _, n in pairs if n is not None]
        ratios = [n / b for b, n in pairs if b is not None and n is not None and b != 0]
        rows.append(
            Row(
                name,
                statistics.median(base) if base else float("nan"),
                statistics.median(new) if new else float("nan"),
                ratios,
            )
        )
    return rows


def print_summary(rows: Sequence[Row], baseline: Side, new: Side, rounds: int, bench: str) -> None:
    print(
        f"\n{bench}: {rounds} alternating rounds, baseline {baseline.label} then new {new.label}."
        "\nnew/baseline per figure: the median of the rounds' ratios, and their min and max"
        "\n(a rate above 1 is faster; a latency, CPU or memory figure below 1 is cheaper).\n"
    )
    print_table(
        ["figure", "baseline", "new", "new/baseline", "min", "max", "rounds"],
        [
            [row.figure, *(f"{v:.4g}" for v in (row.baseline, row.new, row.median, row.low, row.high)), len(row.ratios)]
            for row in rows
        ],
    )


def record(
    path: Path, baseline: Side, new: Side, bench: Sequence[str], rounds: Sequence[RoundFigures], rows: Sequence[Row]
) -> None:
    """Every round's figures of both sides and the summary, as JSON."""
    data = {
        "baseline": baseline.label,
        "new": new.label,
        "bench": list(bench),
        "rounds": list(rounds),
        "summary": [
            {**asdict(row), "ratio_median": row.median, "ratio_min": row.low, "ratio_max": row.high} for row in rows
        ],
    }
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--baseline-ref", required=True, help="the commit to compare against (e.g. main, a sha)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument(
        "--bench-code",
        choices=("current", "own"),
        default="current",
        help="run this checkout's bench/ on both trees (default), or each tree's own",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every round's figures and the summary to PATH")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- bench/<name>.py [its arguments]")
    opts = parser.parse_args()
    command = opts.bench[1:] if opts.bench[:1] == ["--"] else opts.bench
    try:
        if not command:
            raise BenchError("name the bench after --, e.g. -- bench/runs.py --runs 100")
        if opts.rounds < 1:
            raise BenchError("--rounds must be at least 1")
        if "--json" in command:
            raise BenchError("leave --json out of the bench's arguments: compare.py adds its own")
        script = bench_script(command[0])
        sha = resolve_ref(opts.baseline_ref)
        cache = bench_cache_dir()
        with locked(cache / f"{sha}.lock"):
            baseline = prepare_baseline(sha, f"{opts.baseline_ref} ({sha[:10]})", cache, opts.bench_code)
            new = current_side()
            out_dir = cache / "compare" / f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{script.stem}"
            print(f"comparing {script} over {opts.rounds} rounds; output in {out_dir}", file=sys.stderr, flush=True)
            rounds = run_rounds(baseline, new, script, command[1:], opts.rounds, out_dir)
        rows = summarize(rounds)
        print_summary(rows, baseline, new, opts.rounds, " ".join(command))
        record(out_dir / "compare.json", baseline, new, command, rounds, rows)
        if opts.json:
            shutil.copyfile(out_dir / "compare.json", opts.json)
        print(f"\nevery round's figures and output: {out_dir}")
    except BenchError as exc:
        print(f"compare failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
