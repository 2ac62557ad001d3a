// What needs no Gateway: every RPC has a method, the retry waits, the error classes.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import * as path from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { Client, Code, codeName, DEFAULT_RETRY, errorFor, GatewayService, RateLimited, retryPolicy, SAFETY, waitBeforeMs, WRAPS } from "../src/index.js";
import { ConnectError } from "@connectrpc/connect";
import { Aborted, Unavailable } from "../src/errors.js";
import { callError, neverSent } from "../src/transport.js";

test("every Gateway RPC has a client method and a retry class", () => {
  const rpcs = GatewayService.methods.map((m) => m.localName).sort();
  assert.deepEqual(Object.keys(WRAPS).sort(), rpcs);
  assert.deepEqual(Object.keys(SAFETY).sort(), rpcs);
  for (const method of Object.values(WRAPS)) {
    assert.equal(typeof Client.prototype[method], "function", String(method));
  }
});

test("retry waits grow with jitter, are capped, and honour the advised wait", () => {
  const policy = retryPolicy({ initialBackoffMs: 100, maxBackoffMs: 1000, multiplier: 2 });
  for (const [retry, ceiling] of [[1, 100], [2, 200], [3, 400], [4, 800], [5, 1000], [9, 1000]] as const) {
    const waits = Array.from({ length: 200 }, () => waitBeforeMs(policy, retry, undefined));
    assert.ok(waits.every((w) => w >= ceiling / 2 && w <= ceiling), `retry ${retry}`);
    assert.ok(new Set(waits).size > 100, "jittered");
  }
  const advised = Array.from({ length: 200 }, () => waitBeforeMs(policy, 1, 3000));
  assert.ok(advised.every((w) => w >= 3000 && w <= 3600));
  assert.throws(() => retryPolicy({ maxAttempts: 0 }), RangeError);
  assert.throws(() => retryPolicy({ totalTimeoutMs: 0 }), RangeError);
  assert.throws(() => retryPolicy({ initialBackoffMs: 2000, maxBackoffMs: 1000 }), RangeError);
  assert.equal(DEFAULT_RETRY.maxAttempts, 6);
});

test("errors keep the gRPC code, its name, the message and the advised wait", () => {
  const limited = errorFor(new ConnectError("rate limit", Code.ResourceExhausted, { "retry-after-ms": "250" }), "PostMessage", 2);
  assert.ok(limited instanceof RateLimited);
  assert.equal(limited.retryAfterMs, 250);
  assert.equal(limited.codeName, "RESOURCE_EXHAUSTED");
  assert.equal(limited.rawMessage, "rate limit");
  assert.equal(limited.attempts, 2);
  assert.equal(codeName(Code.InvalidArgument), "INVALID_ARGUMENT");
  assert.equal(codeName(Code.Canceled), "CANCELLED");
});

test("the generated code is current (else: npm run generate)", () => {
  const pkg = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..");
  const scratch = mkdtempSync(path.join(tmpdir(), "qy-gen-"));
  try {
    const bin = path.join(pkg, "node_modules", ".bin");
    execFileSync(path.join(bin, "buf"), ["generate", "-o", scratch], { cwd: pkg, env: { ...process.env, PATH: `${bin}${path.delimiter}${process.env.PATH}` } });
    const folder = path.join("src", "gen", "quayutec", "v1");
    const fresh = readdirSync(path.join(scratch, folder)).sort();
    assert.deepEqual(readdirSync(path.join(pkg, folder)).sort(), fresh);
    for (const name of fresh) {
      assert.equal(readFileSync(path.join(pkg, folder, name), "utf8"), readFileSync(path.join(scratch, folder, name), "utf8"), `${name} is stale`);
    }
  } finally {
    rmSync(scratch, { recursive: true, force: true });
  }
});

test("a reset connection is UNAVAILABLE (retried as the retry table says); the Gateway's own ABORTED is not", () => {
  const reset = Object.assign(new Error("read ECONNRESET"), { code: "ECONNRESET" });
  const lost = callError(new ConnectError("read ECONNRESET", Code.Aborted, undefined, undefined, reset), "PostMessage", 1, false);
  assert.ok(lost instanceof Unavailable && lost.code === Code.Unavailable, String(lost));
  assert.match(lost.message, /connection to the Gateway was lost/);
  const conflict = callError(new ConnectError("a concurrent change", Code.Aborted), "UpdateTask", 1, false);
  assert.ok(conflict instanceof Aborted, String(conflict));
  const refused = Object.assign(new Error("connect ECONNREFUSED"), { code: "ECONNREFUSED" });
  assert.ok(neverSent(new ConnectError("connect ECONNREFUSED", Code.Unavailable, undefined, undefined, refused)));
  assert.ok(!neverSent(new ConnectError("read ECONNRESET", Code.Aborted, undefined, undefined, reset)));
});

test("the package loads with require() (CommonJS) and with import (ESM), by its name", () => {
  const pkg = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..");
  const check = "typeof q.connect === 'function' && typeof q.Closed === 'function' && q.DEFAULT_RETRY.maxAttempts === 6";
  const cjs = execFileSync(process.execPath, ["-e", `const q = require("@quayutec/client"); console.log(${check})`], { cwd: pkg, encoding: "utf8" });
  assert.equal(cjs.trim(), "true");
  const esm = execFileSync(process.execPath, ["--input-type=module", "-e", `import * as q from "@quayutec/client"; console.log(${check})`], { cwd: pkg, encoding: "utf8" });
  assert.equal(esm.trim(), "true");
});
