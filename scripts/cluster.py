"""The multi-host test bed (tests/cluster/bed.py) from one command, always in namespaces of its own.

    python -m scripts.cluster up [--root DIR]      start the bed in the background; prints how to use it
    python -m scripts.cluster --ha up              the same with a highly available database (Patroni)
    python -m scripts.cluster exec -- CMD ...      run CMD inside the bed's network (e.g. `quayutec`, bash)
    python -m scripts.cluster fault partition a db | heal | delay 5 | counters
    python -m scripts.cluster status
    python -m scripts.cluster down                 stop it: nothing is left (processes, namespaces, devices)
    python -m scripts.cluster test [PYTEST ARGS]   run tests/cluster in a fresh bed (what `make test-cluster` does),
                                                   then the HA bed's tests (test_failover.py) in another

Everything runs under ``unshare --net --mount --pid --fork --mount-proc``: a network namespace with
loopback only, which the bed fills with its own devices and addresses; a PID namespace, so that
when its first process ends, the kernel ends every other one; a mount namespace, so that nothing
mounted (its /proc) is seen outside. The machine's own network is never touched. Needs root and
util-linux and iproute2 (the commands say what is missing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROOT = Path("/tmp/qy-bed-cli")
NAMESPACES = ["unshare", "--net", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private"]
STATE = "bed.json"
READY = "ready.json"
UP_LIMIT_SECONDS = 180.0
DOWN_LIMIT_SECONDS = 60.0


def _need_tools() -> None:
    missing = [t for t in ("unshare", "nsenter", "ip") if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: apt-get install util-linux iproute2")
    if os.geteuid() != 0:
        raise SystemExit("the bed makes network namespaces and devices: run it as root")


def _state(root: Path) -> dict[str, object]:
    try:
        loaded: dict[str, object] = json.loads((root / STATE).read_text())
        return loaded
    except (OSError, ValueError):
        raise SystemExit(f"no bed is up in {root} (start one with `python -m scripts.cluster up`)") from None


def _is_bed(pid: int, root: Path) -> bool:
    """Whether ``pid`` is the first process of the bed of ``root`` (never signal anything else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(bytes(1))
    except OSError:
        return False
    return b"scripts.cluster" in cmdline and str(root).encode() in cmdline and b"serve" in cmdline


def _inner_pid(root: Path) -> int:
    """The pid (as seen from here) of the bed's first process, inside its namespaces."""
    pid = int(str(_state(root)["pid"]))
    if not _is_bed(pid, root):
        raise SystemExit(f"the bed of {root} is gone (pid {pid}); `scripts.cluster --root {root} down` cleans up")
    return pid


def cmd_up(opts: argparse.Namespace) -> int:
    _need_tools()
    root: Path = opts.root
    if (root / STATE).exists():
        raise SystemExit(f"a bed is already up in {root}; `python -m scripts.cluster down` first")
    root.mkdir(parents=True, exist_ok=True)
    log = (root / "up.log").open("ab")
    ha = ["--ha"] if opts.ha else []
    outer = subprocess.Popen(
        [*NAMESPACES, "--kill-child", "--", sys.executable, "-m", "scripts.cluster", "--root", str(root), *ha, "serve"],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    deadline = time.monotonic() + UP_LIMIT_SECONDS
    while not (root / READY).exists():
        if outer.poll() is not None:
            raise SystemExit(f"the bed did not start (exit {outer.returncode}); see {root / 'up.log'}")
        if time.monotonic() > deadline:
            outer.send_signal(signal.SIGTERM)
            raise SystemExit(f"the bed did not start in {UP_LIMIT_SECONDS:g} s; see {root / 'up.log'}")
        time.sleep(0.5)
    # The bed's first process, as this PID namespace sees it: the child of the `unshare --fork`.
    children = Path(f"/proc/{outer.pid}/task/{outer.pid}/children").read_text().split()
    state = {"pid": int(children[0]), **json.loads((root / READY).read_text())}
    (root / STATE).write_text(json.dumps(state))
    print(f"bed up in {root} (logs in {root}/bed/logs)")
    for key, value in state.items():
        if key != "pid":
            print(f"  {key}: {value}")
    print("use it:  python -m scripts.cluster exec -- .venv/bin/quayutec ...   (or -- bash)")
    print("stop it: python -m scripts.cluster down")
    return 0


def cmd_serve(opts: argparse.Namespace) -> int:
    """Inside the namespaces: start the bed, say where it is, hold it until SIGTERM, stop it."""
    from tests.cluster.bed import CLIENT_IP, DB_IP, SERVICE_HOSTS, Bed, netem_available

    root: Path = opts.root
    bed = Bed(root / "bed", ha=opts.ha)
    stop = asyncio.Event()

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await bed.start()
            state = {
                "gateways": [bed.gateway_addr(h) for h in SERVICE_HOSTS],
                "database": bed.database_url,
                "client address": CLIENT_IP,
                "database host": DB_IP if not opts.ha else "pg1, pg2, pg3 (10.77.1.11-13)",
                "tc netem in this kernel": netem_available(),
            }
            tmp = root / f"{READY}.tmp"
            tmp.write_text(json.dumps(state))
            tmp.replace(root / READY)
            await stop.wait()
        finally:
            bed.stop()
            bed.remove_files()

    asyncio.run(serve())
    return 0


def _enter(root: Path) -> list[str]:
    return ["nsenter", "-t", str(_inner_pid(root)), "--net", "--mount", "--pid", "--wd=" + str(Path.cwd()), "--"]


def cmd_exec(opts: argparse.Namespace) -> int:
    state = _state(opts.root)
    gateways = state["gateways"]
    assert isinstance(gateways, list)
    env = {**os.environ, "QUAYUTEC_GATEWAY_ADDR": str(gateways[0])}
    argv = opts.argv[1:] if opts.argv[:1] == ["--"] else opts.argv
    return subprocess.call([*_enter(opts.root), *(argv or ["bash"])], env=env)


def cmd_fault(opts: argparse.Namespace) -> int:
    """Ask the bed's wire (through its control socket, a file in the bed's folder) for a fault."""
    from tests.cluster.bed import BedError, network_fault

    _state(opts.root)
    try:
        print(network_fault(opts.root / "bed", opts.words))
    except BedError as exc:
        raise SystemExit(str(exc)) from None
    return 0


def cmd_status(opts: argparse.Namespace) -> int:
    state = _state(opts.root)
    pid = int(str(state["pid"]))
    print(f"bed in {opts.root}: {'up' if _is_bed(pid, opts.root) else 'gone'} (pid {pid})")
    for key, value in state.items():
        if key != "pid":
            print(f"  {key}: {value}")
    return 0


def leftovers(root: Path) -> list[str]:
    """Processes still running whose command line names the bed's folder."""
    found = []
    marker = str(root).encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker in cmdline:
                words = cmdline.replace(bytes(1), b" ").decode(errors="replace").strip()
                found.append(f"{entry.name}: {words}")
    return found


def cmd_down(opts: argparse.Namespace) -> int:
    root: Path = opts.root
    try:
        state = _state(root)
    except SystemExit:
        state = {}
    pid = int(str(state.get("pid", 0)))
    if pid and _is_bed(pid, root):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + DOWN_LIMIT_SECONDS
        while _is_bed(pid, root) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _is_bed(pid, root):
            os.kill(pid, signal.SIGKILL)  # the PID namespace's first process: the kernel ends the rest
    deadline = time.monotonic() + 10
    while leftovers(root) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = leftovers(root)
    shutil.rmtree(root, ignore_errors=True)
    if left:
        print("still running:\n  " + "\n  ".join(left), file=sys.stderr)
        return 1
    print(f"bed of {root} stopped; nothing left")
    return 0


# Tests on the bed with a highly available database (Patroni): a pytest session of their own, in
# namespaces of their own (the two beds own the same addresses).
HA_TESTS = "tests/cluster/test_failover.py"
NO_TESTS = 5  # pytest's exit code when it collected nothing


def cmd_test(opts: argparse.Namespace) -> int:
    _need_tools()
    args = list(opts.pytest_args)
    base = [*NAMESPACES, "--kill-child", "--", sys.executable, "-m", "pytest", "-p", "no:randomly"]
    if any(a.startswith("tests/cluster") for a in args):
        return subprocess.call([*base, *args], cwd=REPO)
    single = subprocess.call([*base, "tests/cluster", "--ignore", HA_TESTS, *args], cwd=REPO)
    ha = subprocess.call([*base, HA_TESTS, *args], cwd=REPO)
    if {single, ha} == {NO_TESTS, 0}:
        return 0  # a -k or -m that picks tests of one session only
    return single or ha


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help=f"the bed's folder (default {DEFAULT_ROOT})")
    parser.add_argument("--ha", action="store_true", help="three database hosts under Patroni (tests/cluster/ha.py)")
    sub = parser.add_subparsers(required=True)
    sub.add_parser("up", help="start the bed in the background").set_defaults(handler=cmd_up)
    sub.add_parser("serve", help="(inside the namespaces) hold the bed until SIGTERM").set_defaults(handler=cmd_serve)
    ex = sub.add_parser("exec", help="run a command inside the bed's network")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    ex.set_defaults(handler=cmd_exec)
    fault = sub.add_parser("fault", help="partition HOST HOST | heal | delay MS [every-hop] | counters")
    fault.add_argument("words", nargs="+")
    fault.set_defaults(handler=cmd_fault)
    sub.add_parser("status", help="is the bed up, and where").set_defaults(handler=cmd_status)
    sub.add_parser("down", help="stop the bed; nothing is left").set_defaults(handler=cmd_down)
    test = sub.add_parser("test", help="run tests/cluster in a fresh bed, in namespaces of its own")
    test.add_argument("pytest_args", nargs=argparse.REMAINDER)
    test.set_defaults(handler=cmd_test)
    opts, rest = parser.parse_known_args(argv)
    if rest and getattr(opts, "handler", None) is not cmd_test:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if opts.handler is cmd_test:
        opts.pytest_args = [a for a in [*opts.pytest_args, *rest] if a != "--"]
    opts.root = opts.root.absolute()
    handler = opts.handler
    result: int = handler(opts)
    return result


if __name__ == "__main__":
    sys.exit(main())
