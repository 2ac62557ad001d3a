// What a typical call costs through @quayutec/client over Connect's raw gRPC client, both measured in
// this one process against one Gateway: run by bench/clients.py (`node dist/bench/calls.js ADDR KEY
// ROOM CALLS ROUNDS`), which prints the table. Prints one JSON line.
import { createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { randomUUID } from "node:crypto";
import { connect } from "../src/index.js";
import { GatewayService } from "../src/gen/quayutec/v1/gateway_pb.js";

const [address, apiKey, roomId, callsText, roundsText] = process.argv.slice(2) as [string, string, string, string, string];
const calls = Number(callsText);
const rounds = Number(roundsText);
const raw = createClient(GatewayService, createGrpcTransport({ baseUrl: `http://${address}` }));
const headers = { authorization: `Bearer ${apiKey}` };
const sdk = connect({ address, apiKey, plaintext: true });

type Op = () => Promise<unknown>;
const ops: Record<string, { raw: Op; sdk: Op }> = {
  "PostMessage (a write)": {
    raw: () => raw.postMessage({ roomId, person: "ana", body: "bench", idempotencyKey: randomUUID() }, { headers, timeoutMs: 15_000 }),
    sdk: () => sdk.postMessage(roomId, "bench", { person: "ana" }),
  },
  "ListMessages, one page of 50": {
    raw: () => raw.listMessages({ roomId, pageSize: 50 }, { headers, timeoutMs: 15_000 }),
    sdk: async () => {
      let n = 0;
      for await (const _ of sdk.messages(roomId, { pageSize: 50 })) {
        if (++n === 50) break;
      }
    },
  },
  WhoAmI: {
    raw: () => raw.whoAmI({}, { headers, timeoutMs: 15_000 }),
    sdk: () => sdk.whoAmI(),
  },
};

async function batch(op: Op): Promise<[number, number]> {
  const cpu = process.cpuUsage();
  const start = performance.now();
  for (let i = 0; i < calls; i++) {
    await op();
  }
  const used = process.cpuUsage(cpu);
  return [performance.now() - start, (used.user + used.system) / 1000];
}

const result: Record<string, Record<"raw" | "sdk", { ms: number; cpuMs: number }>> = {};
for (const [name, op] of Object.entries(ops)) {
  await op.raw();
  await op.sdk(); // warm both
  const total = { raw: { ms: 0, cpuMs: 0 }, sdk: { ms: 0, cpuMs: 0 } };
  for (let r = 0; r < rounds; r++) {
    for (const side of r % 2 ? (["sdk", "raw"] as const) : (["raw", "sdk"] as const)) {
      const [ms, cpuMs] = await batch(op[side]);
      total[side].ms += ms;
      total[side].cpuMs += cpuMs;
    }
  }
  result[name] = total;
}
sdk.close();
console.log(JSON.stringify({ calls: calls * rounds, result }));
