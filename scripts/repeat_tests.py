"""The flake check behind `make test-repeat`: the console, delivery and held-action tests, N rounds in
a row, while one busy-loop process per core keeps the CPU saturated. Prints each round's outcome and
the pass count (each test's, and the rounds'); exits non-zero unless every round passed.

Each hog is bounded: it spins only while this script lives (it checks its parent) and never longer
than ``--hog-max-seconds``, so none outlives an interrupted run. A failed round's pytest output is
kept in the log folder (its pytest-randomly seed is at the top).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = (
    "tests/console/test_console.py",
    "tests/gateway/test_delivery.py",
    "tests/runtime/test_held.py",
)
# Spins until its parent (this script) is gone or its time is up, checking both every ~0.1 s.
_HOG = """
import os, sys, time
parent, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while os.getppid() == parent and time.monotonic() < end:
    stop = time.monotonic() + 0.1
    while time.monotonic() < stop:
        pass
"""


@contextmanager
def cpu_hogs(count: int, max_seconds: float) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` busy-loop processes, stopped on exit (and by themselves, see ``_HOG``)."""
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG, str(os.getpid()), str(max_seconds)]) for _ in range(count)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.wait(timeout=30)


def outcomes_from(junit: Path) -> dict[str, bool]:
    """Each test's outcome (passed or not) from a pytest JUnit report; empty when pytest wrote none.
    A skipped test is no outcome (the repeated tests have no skips; one would show as missing)."""
    if not junit.exists():
        return {}
    outcomes: dict[str, bool] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        failed = case.find("failure") is not None or case.find("error") is not None
        # A test that passed but failed at teardown appears twice: it counts as failed.
        outcomes[name] = outcomes.get(name, True) and not failed
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="how many times to run the tests (default 20)")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy-loop processes (default: cores)")
    parser.add_argument("--hog-max-seconds", type=float, default=6 * 3600.0, help="longest a hog spins")
    parser.add_argument("--logs", type=Path, default=None, help="folder for each round's output (default: temp)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --")
    opts = parser.parse_args(argv)
    if opts.rounds < 1 or opts.hogs < 0:
        parser.error("--rounds must be at least 1 and --hogs not negative")
    logs: Path = opts.logs or Path(tempfile.mkdtemp(prefix="quayutec-test-repeat-"))
    logs.mkdir(parents=True, exist_ok=True)
    pytest = [sys.executable, "-m", "pytest", "-q", *TESTS, *opts.pytest_args]
    print(f"test-repeat: {opts.rounds} rounds of {', '.join(TESTS)} under {opts.hogs} CPU hogs; logs in {logs}")
    rounds_passed = tests_passed = tests_run = 0
    per_test: dict[str, list[int]] = {}  # test → [rounds passed, rounds run]
    started = time.monotonic()
    n = 0
    with cpu_hogs(opts.hogs, opts.hog_max_seconds), contextlib.suppress(KeyboardInterrupt):
        for n in range(1, opts.rounds + 1):
            junit, log = logs / f"round-{n}.xml", logs / f"round-{n}.log"
            began = time.monotonic()
            with log.open("wb") as out:
                code = subprocess.call([*pytest, f"--junitxml={junit}"], cwd=REPO, stdout=out, stderr=out)
            outcomes = outcomes_from(junit)
            for name, ok in outcomes.items():
                tally = per_test.setdefault(name, [0, 0])
                tally[0] += ok
                tally[1] += 1
            passed, run = sum(outcomes.values()), len(outcomes)
            tests_passed, tests_run = tests_passed + passed, tests_run + run
            if code == 0:
                rounds_passed += 1
                log.unlink()
            outcome = "passed" if code == 0 else f"FAILED (pytest exit {code}; output in {log})"
            print(f"round {n}/{opts.rounds}: {outcome}, {passed}/{run} tests, {time.monotonic() - began:.0f} s")
            sys.stdout.flush()
        n += 1  # every round ran
    minutes = (time.monotonic() - started) / 60
    stopped = "" if n > opts.rounds else f" (interrupted in round {n})"
    for name, (passes, runs) in sorted(per_test.items()):
        print(f"  {passes}/{runs} {name}")
    print(
        f"test-repeat: {rounds_passed}/{opts.rounds} rounds passed{stopped}, {tests_passed}/{tests_run} tests "
        f"passed, under {opts.hogs} CPU hogs, in {minutes:.1f} min"
    )
    return 0 if rounds_passed == opts.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
