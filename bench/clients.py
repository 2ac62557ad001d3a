"""What a typical call costs through the client SDKs over raw gRPC, and how many lines the quickstart
flow takes with and without the Python SDK.

One run: Room, Claims, Runtime and Gateway as processes on an embedded (or DATABASE_URL) PostgreSQL,
the stand-in as model provider. For each of three calls (PostMessage, the first page of
ListMessages, WhoAmI), ``--calls`` sequential calls through the raw stub and through the SDK, in
``--rounds`` rounds in which the two sides take turns every ten calls, from this process (Python) and
from one Node process (TypeScript, raw Connect client against @quayutec/client): mean wall time and
the caller's own CPU per call, and their ratio (and, for Python, the lowest and highest of the rounds'
CPU ratios, to show how steady it is). The raw side of ListMessages reads the page's 50 messages, as
the SDK side does. Both sides of a ratio are measured in the same run against the same Gateway. Then it runs the
SDK quickstart (docs/examples/python_sdk/quickstart.py) and its raw-gRPC twin
(bench/flows/quickstart_raw.py), checks that they print the same, and counts their lines of code.

    python bench/clients.py [--calls 200] [--rounds 5] [--python-only]

With PYTHONPATH naming another copy of the Python SDK (an older commit's clients/python/src), that
copy is the one measured; the table names the one it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tokenize
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a checkout

import grpc

import quayutec_client
from bench.common import (
    ROOT,
    BenchError,
    base_env,
    create_migrated_database,
    drop_database,
    postgres_server,
    print_table,
    run_main,
    running_stack,
    scratch_dir,
    standin_process,
    wait_for_room,
)
from quayutec.db import create_pool
from quayutec.tls import ADMIN
from quayutec.v1 import gateway_pb2, gateway_pb2_grpc, room_pb2, room_pb2_grpc
from services.gateway.auth import create_api_key

TS_PACKAGE = ROOT / "clients" / "typescript"
FLOWS = {
    "SDK (docs/examples/python_sdk/quickstart.py)": ROOT / "docs" / "examples" / "python_sdk" / "quickstart.py",
    "raw gRPC (bench/flows/quickstart_raw.py)": ROOT / "bench" / "flows" / "quickstart_raw.py",
}
Op = Callable[[], Awaitable[object]]


def code_lines(path: Path) -> int:
    """Lines holding code: no blank lines, comments, or the module's docstring."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
    lines: set[int] = set()
    docstring = True
    for token in tokenize.tokenize(io.BytesIO(path.read_bytes()).readline):
        if token.type in skip or token.type == tokenize.ENDMARKER:
            continue
        if docstring and token.type == tokenize.STRING:
            docstring = False
            continue
        docstring = False
        lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines)


# Calls a side before measuring, and calls in a block: in each round the two sides take turns block by
# block (raw, SDK, then SDK, raw, ...), so that the load of whatever else runs on the machine falls on
# both alike (in rounds of a few hundred calls a side, it did not: one round's ratio could be 20% off
# the next one's).
WARM_UP = 20
BLOCK = 10


async def measure(ops: dict[str, tuple[Op, Op]], calls: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per call: [wall ms, own CPU ms] of the raw side and the SDK side, summed over the rounds, and
    each round's SDK/raw CPU ratio ("rounds")."""
    result = {}
    for name, (raw, sdk) in ops.items():
        for _ in range(WARM_UP):
            await raw()
            await sdk()
        total = {"raw": [0.0, 0.0], "sdk": [0.0, 0.0], "rounds": []}
        for r in range(rounds):
            this = {"raw": [0.0, 0.0], "sdk": [0.0, 0.0]}
            for b, start in enumerate(range(0, calls, BLOCK)):
                n = min(BLOCK, calls - start)
                for side in ("sdk", "raw") if (r + b) % 2 else ("raw", "sdk"):
                    op = raw if side == "raw" else sdk
                    cpu, wall = time.process_time(), time.perf_counter()
                    for _ in range(n):
                        await op()
                    this[side][0] += (time.perf_counter() - wall) * 1000
                    this[side][1] += (time.process_time() - cpu) * 1000
            for side in ("raw", "sdk"):
                total[side] = [a + b for a, b in zip(total[side], this[side], strict=True)]
            total["rounds"].append(this["sdk"][1] / this["raw"][1])
        result[name] = total
    return result


async def python_ops(addr: str, key: str, room_id: str, calls: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    metadata = (("authorization", f"Bearer {key}"),)
    async with (
        grpc.aio.insecure_channel(addr) as channel,
        quayutec_client.connect(addr, key, plaintext=True) as client,
    ):
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def first_page() -> None:
            seen = 0
            async for _ in client.messages(room_id, page_size=50):
                seen += 1
                if seen == 50:
                    break

        async def raw_first_page() -> None:
            page = await stub.ListMessages(
                gateway_pb2.ListMessagesRequest(room_id=room_id, page_size=50), metadata=metadata, timeout=15
            )
            for _ in page.messages:  # read as the SDK side reads them
                pass

        ops: dict[str, tuple[Op, Op]] = {
            "PostMessage (a write)": (
                lambda: stub.PostMessage(
                    gateway_pb2.PostMessageRequest(
                        room_id=room_id, person="ana", body="bench", idempotency_key=str(uuid.uuid4())
                    ),
                    metadata=metadata,
                    timeout=15,
                ),
                lambda: client.post_message(room_id, "bench", person="ana"),
            ),
            "ListMessages, one page of 50": (raw_first_page, first_page),
            "WhoAmI": (
                lambda: stub.WhoAmI(gateway_pb2.WhoAmIRequest(), metadata=metadata, timeout=15),
                client.who_am_i,
            ),
        }
        return await measure(ops, calls, rounds)


async def typescript_ops(
    addr: str, key: str, room_id: str, calls: int, rounds: int
) -> dict[str, dict[str, list[float]]]:
    node = shutil.which("node")
    script = TS_PACKAGE / "dist" / "bench" / "calls.js"
    if node is None or not (TS_PACKAGE / "node_modules").exists():
        raise BenchError("the TypeScript half needs node and `npm ci` in clients/typescript")
    await asyncio.to_thread(subprocess.run, ["npx", "tsc", "-p", "."], cwd=TS_PACKAGE, check=True)
    done = await asyncio.to_thread(
        subprocess.run,
        [node, str(script), addr, key, room_id, str(calls), str(rounds)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise BenchError(f"the Node half failed: {done.stderr[-2000:]}")
    answer = json.loads(done.stdout.strip().splitlines()[-1])["result"]
    return {name: {side: [v["ms"], v["cpuMs"]] for side, v in sides.items()} for name, sides in answer.items()}


async def run_flow(path: Path, env: dict[str, str]) -> list[str]:
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise BenchError(f"{path.name} failed: {done.stderr[-2000:]}")
    # Run ids differ between two runs; the rest must match.
    return [re.sub(r"\(run \S+\)", "(run …)", line) for line in done.stdout.splitlines()]


async def amain(opts: argparse.Namespace) -> None:
    started = time.monotonic()
    names = ("room", "claims", "runtime", "gateway")
    with scratch_dir("qy-bench-clients-") as data_dir, standin_process() as standin_url, postgres_server() as admin:
        url = await create_migrated_database(admin)
        env = base_env(standin_url, data_dir)
        env |= {"QUAYUTEC_GATEWAY_POST_RATE": "0", "QUAYUTEC_GATEWAY_POLL_INTERVAL_SECONDS": "0.05"}
        pool = await create_pool(url, min_size=1, max_size=2)
        try:
            async with running_stack(url, names, env, data_dir / "logs") as stack:
                await wait_for_room(stack, 60)
                addr = stack.addr("gateway")
                async with stack.channel("room", ADMIN) as room_channel:
                    room_stub = room_pb2_grpc.RoomServiceStub(room_channel)
                    company = (
                        await room_stub.CreateCompany(room_pb2.RoomServiceCreateCompanyRequest(name="bench-clients"))
                    ).company
                _, key = await create_api_key(pool, company.company_id, "bench")
                async with quayutec_client.connect(addr, key, plaintext=True) as client:
                    room_id = (await client.create_room("bench")).room_id
                    for i in range(60):  # a full first page for the list calls
                        await client.post_message(room_id, f"warm {i}", person="ana")
                print(f"measuring Python (the SDK at {Path(quayutec_client.__file__).parent})…", file=sys.stderr)
                python = await python_ops(addr, key, room_id, opts.calls, opts.rounds)
                typescript: dict[str, dict[str, list[float]]] = {}
                if not opts.python_only:
                    print("measuring TypeScript…", file=sys.stderr)
                    typescript = await typescript_ops(addr, key, room_id, opts.calls, opts.rounds)
                flow_env = {
                    **os.environ,
                    "PYTHONPATH": str(ROOT),
                    "QUAYUTEC_GATEWAY_ADDR": addr,
                    "QUAYUTEC_API_KEY": key,
                    "QUAYUTEC_PROVIDER_KEY": "sk-bench",
                    "QUAYUTEC_PLAINTEXT": "1",
                }
                outputs = {name: await run_flow(path, flow_env) for name, path in FLOWS.items()}
        finally:
            await pool.close()
            await drop_database(admin, url)

    n = opts.calls * opts.rounds
    print(
        f"\nThe client SDKs over raw gRPC: {n} sequential calls a side, {opts.rounds} alternating rounds, "
        f"one Gateway and Room on this machine ({datetime.now(UTC):%Y-%m-%d})\n"
        f"Python SDK measured: {Path(quayutec_client.__file__).parent}\n"
    )
    rows = []
    for language, result in (("Python", python), ("TypeScript", typescript)):
        for name, sides in result.items():
            raw_ms, raw_cpu = (v / n for v in sides["raw"])
            sdk_ms, sdk_cpu = (v / n for v in sides["sdk"])
            spread = sides.get("rounds", [])
            rows.append(
                [
                    language,
                    name,
                    f"{raw_ms:.3f}",
                    f"{sdk_ms:.3f}",
                    f"{sdk_ms / raw_ms:.2f}",
                    f"{raw_cpu * 1000:.0f}",
                    f"{sdk_cpu * 1000:.0f}",
                    f"{sdk_cpu / raw_cpu:.2f}",
                    f"{min(spread):.2f}–{max(spread):.2f}" if spread else "",
                ]
            )
    print_table(
        ["client", "call", "raw ms", "SDK ms", "SDK/raw", "raw CPU µs", "SDK CPU µs", "SDK/raw CPU", "by round"],
        rows,
    )
    (sdk_out, raw_out) = outputs.values()
    if sdk_out != raw_out:
        raise BenchError(f"the two quickstarts printed different things:\n{sdk_out}\n{raw_out}")
    print("\nThe quickstart flow (connect, who am I, room, agent, post and wake, follow until the answer, an error):\n")
    print_table(["written with", "lines of code"], [[name, code_lines(path)] for name, path in FLOWS.items()])
    print(f"\nboth printed: {sdk_out}")
    print(f"bench took {time.monotonic() - started:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="sequential calls per round and side (default 200)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--python-only", action="store_true", help="skip the TypeScript half (no node needed)")
    return run_main(amain, parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
