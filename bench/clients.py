"""What a typical call costs through the client SDKs over raw gRPC, and how many lines the quickstart
flow takes with and without the Python SDK.

One run: Room, Claims, Runtime and Gateway as processes on an embedded (or DATABASE_URL) PostgreSQL,
the stand-in as model provider. For each of three calls (PostMessage, the first page of
ListMessages, WhoAmI), ``--calls`` sequential calls through the raw stub and through the SDK, in
``--rounds`` alternating rounds, from this process (Python) and from one Node process (TypeScript, raw
Connect client against @quayutec/client): mean wall time and the caller's own CPU per call, and their
ratio. Both sides of a ratio are measured in the same run against the same Gateway. Then it runs the
SDK quickstart (docs/examples/python_sdk/quickstart.py) and its raw-gRPC twin
(bench/flows/quickstart_raw.py), checks that they print the same, and counts their lines of code.

    python bench/clients.py [--calls 200] [--rounds 5]
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


async def measure(ops: dict[str, tuple[Op, Op]], calls: int, rounds: int) -> dict[str, dict[str, list[float]]]:
    """Per call: [wall ms, own CPU ms] of the raw side and the SDK side, summed over the rounds."""
    result = {}
    for name, (raw, sdk) in ops.items():
        await raw()
        await sdk()
        total = {"raw": [0.0, 0.0], "sdk": [0.0, 0.0]}
        for r in range(rounds):
            for side in ("sdk", "raw") if r % 2 else ("raw", "sdk"):
                op = raw if side == "raw" else sdk
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(calls):
                    await op()
                total[side][0] += (time.perf_counter() - wall) * 1000
                total[side][1] += (time.process_time() - cpu) * 1000
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
            "ListMessages, one page of 50": (
                lambda: stub.ListMessages(
                    gateway_pb2.ListMessagesRequest(room_id=room_id, page_size=50), metadata=metadata, timeout=15
                ),
                first_page,
            ),
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
                print("measuring Python…", file=sys.stderr)
                python = await python_ops(addr, key, room_id, opts.calls, opts.rounds)
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
    )
    rows = []
    for language, result in (("Python", python), ("TypeScript", typescript)):
        for name, sides in result.items():
            raw_ms, raw_cpu = (v / n for v in sides["raw"])
            sdk_ms, sdk_cpu = (v / n for v in sides["sdk"])
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
                ]
            )
    print_table(["client", "call", "raw ms", "SDK ms", "SDK/raw", "raw CPU µs", "SDK CPU µs", "SDK/raw CPU"], rows)
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
    return run_main(amain, parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
