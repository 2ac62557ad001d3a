// The TypeScript client riding out what a real Gateway does to it, with its default retry policy: a
// SIGKILL in the middle of a burst of keyed posts, outages of 8 s and 30 s under a keyed write and a
// watch, its own close() under a watch and a call waiting to retry, a caller's AbortSignal and
// deadline, and connection mistakes (TLS, plaintext, a bad address) reported at once and named.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { setTimeout as delay } from "node:timers/promises";
import {
  Cancelled,
  Client,
  Closed,
  Code,
  ConnectionFailed,
  connect,
  InvalidArgument,
  QuayutecError,
  RoomEventKind,
  setRetryListener,
  Unavailable,
  type RetryNotice,
  type RoomEvent,
} from "../src/index.js";
import { startStack, type Company, type Stack } from "./stack.js";

let stack: Stack;
const clients: Client[] = [];

before(async () => {
  stack = await startStack();
});

after(async () => {
  for (const client of clients) {
    client.close();
  }
  await stack?.close();
});

/** A client with the default retry policy. */
function client(company: Company, options: { address?: string } = {}): Client {
  const made = connect({ address: options.address ?? stack.extra.gateway, apiKey: company.api_key, plaintext: true });
  clients.push(made);
  return made;
}

const bodies = async (roomId: string) => (await stack.post<{ bodies: string[] }>("/messages", { room_id: roomId })).bodies;

async function rejection(promise: Promise<unknown>): Promise<unknown> {
  return promise.then(
    (value) => assert.fail(`resolved: ${String(value)}`),
    (reason: unknown) => reason,
  );
}

test("a Gateway killed 5 ms into a burst of 30 keyed posts: each lands, once", async () => {
  const c = client(await stack.company());
  const room = await c.createRoom("burst");
  const sent = Array.from({ length: 30 }, (_, i) => `burst ${i}`);
  const retried: RetryNotice[] = [];
  setRetryListener((notice) => retried.push(notice));
  const posts = sent.map((body) => c.postMessage(room.roomId, body, { person: "ana" }));
  await delay(5);
  await stack.post("/gateway/restart");
  const posted = await Promise.all(posts).finally(() => setRetryListener(undefined));
  assert.ok(retried.some((r) => r.method === "PostMessage"), "the kill met posts under way");
  assert.deepEqual([...(await bodies(room.roomId))].sort(), [...sent].sort());
  assert.equal(new Set(posted.map((p) => p.message?.messageId)).size, 30);
});

test("a Gateway killed 5 ms into a burst of 30 room creates: each room exists, once", async () => {
  const c = client(await stack.company());
  const names = Array.from({ length: 30 }, (_, i) => `created ${i}`);
  const retried: RetryNotice[] = [];
  setRetryListener((notice) => retried.push(notice));
  const creates = names.map((name) => c.createRoom(name));
  await delay(5);
  await stack.post("/gateway/restart");
  const made = await Promise.all(creates).finally(() => setRetryListener(undefined));
  assert.ok(retried.some((r) => r.method === "CreateRoom"), "the kill met creates under way");
  const rooms = await collect(c.rooms());
  assert.deepEqual(rooms.map((r) => r.name).sort(), [...names].sort());
  assert.deepEqual(rooms.map((r) => r.roomId).sort(), made.map((r) => r.roomId).sort());
});

test("each create repeated with its key answers the first object", async () => {
  const acme = await stack.company();
  const c = client(acme);
  const other = client(await stack.company());
  const idempotencyKey = `mine-${crypto.randomUUID()}`;
  const room = await c.createRoom("keyed", { idempotencyKey });
  assert.equal((await c.createRoom("keyed", { idempotencyKey })).roomId, room.roomId);
  assert.notEqual((await other.createRoom("keyed", { idempotencyKey })).roomId, room.roomId);
  const agent = { name: "keyed", provider: "anthropic", model: "m", providerKey: "sk-test", idempotencyKey } as const;
  const registered = await c.registerAgent(agent);
  assert.equal((await c.registerAgent(agent)).agentId, registered.agentId);
  assert.deepEqual((await collect(c.agents())).map((a) => a.agentId), [registered.agentId]);
  const invited = (await other.whoAmI()).companyId;
  const invitation = await c.inviteCompany(room.roomId, invited, { idempotencyKey });
  assert.equal((await c.inviteCompany(room.roomId, invited, { idempotencyKey })).invitationId, invitation.invitationId);
  const made = await c.createApiKey({ label: "keyed", idempotencyKey });
  const again = await c.createApiKey({ label: "keyed", idempotencyKey });
  assert.deepEqual([again.key?.keyId, again.secret], [made.key?.keyId, made.secret]);
  const session = await c.createSessionKey(600, { idempotencyKey });
  const sessionAgain = await c.createSessionKey(600, { idempotencyKey });
  assert.deepEqual([sessionAgain.keyId, sessionAgain.secret], [session.keyId, session.secret]);
});

async function outage(c: Client, roomId: string, seconds: number, body: string): Promise<void> {
  const watch = await c.watch(roomId).ready();
  try {
    await stack.post("/gateway/kill");
    const post = c.postMessage(roomId, body, { person: "ana" });
    let settled = false;
    void post.then(
      () => (settled = true),
      () => (settled = true),
    );
    await delay(seconds * 1000);
    assert.equal(settled, false, "the post waits while the Gateway is down");
    await stack.post("/gateway/start");
    const posted = await post;
    let event: RoomEvent | undefined;
    const failsafe = setTimeout(() => watch.close(), 60_000); // a lost event would be waited for forever
    for await (const e of watch) {
      if (e.kind === RoomEventKind.MESSAGE_POSTED) {
        event = e;
        break;
      }
    }
    clearTimeout(failsafe);
    assert.equal(event?.detail.case === "message" && event.detail.value.messageId, posted.message?.messageId);
    assert.equal((await bodies(roomId)).filter((b) => b === body).length, 1);
  } finally {
    watch.close();
  }
}

test("the default policy rides out 8 s and 30 s of Gateway downtime under a keyed write and a watch", { timeout: 240_000 }, async () => {
  const c = client(await stack.company());
  const room = await c.createRoom("outages");
  await outage(c, room.roomId, 8, "after 8 s");
  await outage(c, room.roomId, 30, "after 30 s");
});

test("close() ends a watch and a call waiting to retry with Closed; a signal and a deadline end a call", async () => {
  const acme = await stack.company();
  const c = client(acme);
  const room = await c.createRoom("closing");
  const watch = await c.watch(room.roomId).ready();
  const reading = rejection(watch[Symbol.asyncIterator]().next());
  const other = connect({ address: "127.0.0.1:9", apiKey: acme.api_key, plaintext: true });
  const waiting = rejection(other.postMessage(room.roomId, "never", { person: "ana" }));
  const aborter = new AbortController();
  const aborted = rejection(other.whoAmI({ signal: aborter.signal }));
  const deadline = rejection(other.whoAmI({ timeoutMs: 300 }));
  await delay(500); // refused: each waits to try again
  aborter.abort(new Error("the caller gave up"));
  const cancelled = await aborted;
  assert.ok(cancelled instanceof Cancelled && !(cancelled instanceof Closed), String(cancelled));
  assert.match(cancelled.message, /the caller gave up/);
  const late = await deadline;
  assert.ok(late instanceof Unavailable && /ECONNREFUSED/.test(late.message), String(late));

  c.close();
  other.close();
  for (const pending of [reading, waiting]) {
    const closed = await pending;
    assert.ok(closed instanceof Closed, String(closed));
    assert.equal(closed.code, Code.Canceled);
    assert.match(closed.requestId, /^[0-9a-f]{32}$/, "the call's (or the watch's) x-request-id");
  }
  assert.ok((await rejection(c.whoAmI())) instanceof Closed);
});

test("TLS and protocol mismatches are reported at once, naming TLS", async () => {
  const acme = await stack.company();
  const mistakes = {
    "TLS to a plaintext port": connect({ address: stack.extra.gateway, apiKey: acme.api_key, tls: { ca: stack.extra.tls_ca_pem } }),
    "an untrusted certificate": connect({ address: stack.extra.tls_gateway, apiKey: acme.api_key }),
    "a wrong server name": connect({ address: stack.extra.tls_gateway, apiKey: acme.api_key, tls: { ca: stack.extra.tls_ca_pem, serverName: "other.invalid" } }),
    "plaintext to TLS": connect({ address: stack.extra.tls_gateway, apiKey: acme.api_key, plaintext: true }),
  };
  for (const [what, c] of Object.entries(mistakes)) {
    clients.push(c);
    const started = performance.now();
    const failed = await rejection(c.whoAmI());
    const took = performance.now() - started;
    assert.ok(failed instanceof ConnectionFailed, `${what}: ${String(failed)}`);
    assert.ok(failed instanceof Unavailable);
    assert.match(failed.requestId, /^[0-9a-f]{32}$/);
    assert.match(failed.message, /TLS/, what);
    assert.ok(took <= 5000, `${what}: reported after ${took} ms`);
    const watched = await rejection(c.watch(acme.company_id).ready());
    assert.ok(watched instanceof ConnectionFailed, `${what} (watch): ${String(watched)}`);
  }
});

test("a bad address is refused at connect; the address and key come from the environment", async () => {
  const cases: [string, RegExp][] = [
    ["", /empty/],
    ["   ", /empty/],
    ["http://127.0.0.1:50051", /"127\.0\.0\.1:50051"\) and plaintext: true/],
    ["https://gateway.example:443/", /is a URL/],
    ["127.0.0.1", /host:port/],
    ["127.0.0.1:0", /port from 1/],
  ];
  for (const [address, says] of cases) {
    assert.throws(() => connect({ address, apiKey: "qyk_a_b", plaintext: true }), says, address);
  }
  const acme = await stack.company();
  const names = ["QUAYUTEC_GATEWAY", "QUAYUTEC_GATEWAY_ADDR", "QUAYUTEC_API_KEY"] as const;
  const saved = names.map((name) => [name, process.env[name]] as const);
  try {
    delete process.env.QUAYUTEC_GATEWAY;
    delete process.env.QUAYUTEC_GATEWAY_ADDR;
    delete process.env.QUAYUTEC_API_KEY;
    assert.throws(() => connect({ apiKey: "qyk_a_b" }), /QUAYUTEC_GATEWAY/);
    assert.throws(() => connect({ address: "127.0.0.1:50051" }), /QUAYUTEC_API_KEY/);
    process.env.QUAYUTEC_GATEWAY = stack.extra.gateway;
    process.env.QUAYUTEC_API_KEY = acme.api_key;
    const c = connect({ plaintext: true });
    clients.push(c);
    assert.equal((await c.whoAmI()).companyId, acme.company_id);
  } finally {
    for (const [name, value] of saved) {
      if (value === undefined) {
        delete process.env[name];
      } else {
        process.env[name] = value;
      }
    }
  }
});

test("mistakes are refused before the wire with the Gateway's messages; wrong types are TypeErrors", async () => {
  const c = client(await stack.company());
  const room = await c.createRoom("checks");
  const r = room.roomId;
  const refusals: [Promise<unknown>, string][] = [
    [c.postMessage(r, "", { person: "ana" }), "body is required"],
    [c.postMessage("", "hi", { person: "ana" }), "room_id is required"],
    [c.postMessage(r, "x".repeat(70_000), { person: "ana" }), "body must be at most 65536 bytes (64 KiB)"],
    [c.postMessage(r, "hi", { person: "ana", idempotencyKey: "k".repeat(300) }), "idempotency_key must be at most 200 bytes"],
    [c.messages(r, { pageSize: 501 }).next(), "page_size must be between 1 and 500 (0 for the default 50), got 501"],
    [c.rooms({ pageSize: -1 }).next(), "page_size must be between 1 and 500 (0 for the default 50), got -1"],
    [c.getTask(r, ""), "task_id is required"],
    [c.createRoom(""), "name is required"],
  ];
  for (const [call, says] of refusals) {
    const refused = await rejection(call);
    assert.ok(refused instanceof InvalidArgument, String(refused));
    assert.equal(refused.rawMessage, says);
    assert.equal(refused.attempts, 0);
  }
  const missing = await rejection(c.getTask(r, "00000000-0000-4000-8000-000000000000"));
  assert.ok(missing instanceof QuayutecError && missing.code === Code.NotFound, String(missing));
  assert.match(missing.requestId, /^[0-9a-f]{32}$/);
  assert.throws(() => c.watch(r, { after: -1 }), /after must be a cursor \(0 or more\)/);
  assert.throws(() => c.watchRooms({ after: { [r]: -5 } }), /after\[0\]\.cursor must be 0 or more, got -5/);
  const types: (() => Promise<unknown>)[] = [
    () => c.postMessage(r, 123 as unknown as string, { person: "ana" }),
    () => c.postMessage(r, "hi", { person: "ana", mentions: "id" as unknown as string[] }),
    () => c.rooms({ pageSize: 1.5 }).next(),
    () => c.runs({ status: "sideways" as "failed" }).next(),
  ];
  for (const call of types) {
    const error = await rejection(Promise.resolve().then(call));
    assert.ok(error instanceof TypeError || error instanceof RangeError, String(error));
  }
  // What the issue found sent wrong now means what it says.
  assert.deepEqual(await collect(c.runs({ status: "failed" })), []);
  assert.deepEqual(await collect(c.invitations({ sent: true })), []);
  assert.deepEqual(await collect(c.agents({ roomId: r })), []);
});

async function collect<T>(items: AsyncIterable<T>): Promise<T[]> {
  const all: T[] = [];
  for await (const item of items) {
    all.push(item);
  }
  return all;
}
