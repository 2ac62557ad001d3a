// What needs no Gateway: every RPC has a method, the retry waits, the error classes.
import assert from "node:assert/strict";
import { test } from "node:test";
import { Client, Code, codeName, DEFAULT_RETRY, errorFor, GatewayService, RateLimited, retryPolicy, SAFETY, waitBeforeMs, WRAPS } from "../src/index.js";
import { ConnectError } from "@connectrpc/connect";

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
