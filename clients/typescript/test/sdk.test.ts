// @quayutec/client against a real Gateway process, Room, Claims, Runtime and model stand-in on
// loopback: the README flow, a write retried across a Gateway killed mid-call posts once, a watch
// across two Gateway kills and a RESOURCE_EXHAUSTED cut yields every event once and in order, paging,
// every typed error, TLS, the API key kept out of sight, and trace context.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { inspect } from "node:util";
import { context, propagation, trace, TraceFlags } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { W3CTraceContextPropagator } from "@opentelemetry/core";
import {
  AlreadyExists,
  Client,
  connect,
  CursorExpired,
  DeadlineExceeded,
  ActionRight,
  FailedPrecondition,
  InvalidArgument,
  InvitationStatus,
  NO_RETRY,
  NotFound,
  PermissionDenied,
  RateLimited,
  RoomEventKind,
  RunStatus,
  RunStep,
  setRetryListener,
  TaskStatus,
  Unauthenticated,
  Unavailable,
  type RetryNotice,
  type RetryPolicy,
  type RoomEvent,
  type RoomWatch,
} from "../src/index.js";
import { startStack, type Company, type Stack } from "./stack.js";

let stack: Stack;
const clients: Client[] = [];
const retries: RetryNotice[] = [];
// Patient enough for a Gateway process to start again.
const PATIENT: Partial<RetryPolicy> = { maxAttempts: 40, initialBackoffMs: 50, maxBackoffMs: 500, totalTimeoutMs: 90_000, attemptTimeoutMs: 10_000 };

before(async () => {
  stack = await startStack();
  setRetryListener((notice) => retries.push(notice));
});

after(async () => {
  for (const client of clients) {
    client.close();
  }
  await stack?.close();
});

function client(company: Company, options: { address?: string; retry?: Partial<RetryPolicy> } = {}): Client {
  const made = connect({ address: options.address ?? stack.extra.gateway, apiKey: company.api_key, plaintext: true, retry: options.retry ?? PATIENT });
  clients.push(made);
  return made;
}

async function collect<T>(items: AsyncIterable<T>): Promise<T[]> {
  const all: T[] = [];
  for await (const item of items) {
    all.push(item);
  }
  return all;
}

const bodyOf = (event: RoomEvent): string | undefined => (event.detail.case === "message" ? event.detail.value.body : undefined);

async function readUntil(watch: RoomWatch, into: RoomEvent[], done: (event: RoomEvent) => boolean): Promise<void> {
  const read = async () => {
    for await (const event of watch) {
      into.push(event);
      if (done(event)) {
        return;
      }
    }
    throw new Error("the watch ended");
  };
  // A failsafe: a missed event would be waited for forever.
  let timer: NodeJS.Timeout | undefined;
  const failsafe = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`the awaited event never came; got ${into.map(bodyOf).join(", ")}`)), 120_000);
  });
  try {
    await Promise.race([read(), failsafe]);
  } finally {
    clearTimeout(timer);
  }
}


test("the README flow end to end", async () => {
  const [acme, bolt] = [await stack.company("Acme"), await stack.company("Bolt")];
  const a = client(acme);
  const b = client(bolt);
  assert.equal((await a.whoAmI()).name, "Acme");
  const room = await a.createRoom("launch");
  const invitation = await a.inviteCompany(room.roomId, bolt.company_id);
  assert.deepEqual((await collect(b.invitations())).map((i) => i.invitationId), [invitation.invitationId]);
  assert.equal((await b.acceptInvitation(invitation.invitationId)).member?.companyId, bolt.company_id);
  assert.deepEqual(new Set((await collect(a.members(room.roomId))).map((m) => m.companyId)), new Set([acme.company_id, bolt.company_id]));
  const writer = await b.registerAgent({ name: "writer", provider: "anthropic", model: "claude-sdk", providerKey: "sk-sdk-test" });
  assert.deepEqual((await collect(b.agents())).map((x) => x.agentId), [writer.agentId]);

  const events = await a.watch(room.roomId).ready();
  const posted = await a.postMessage(room.roomId, "@writer draft the launch note", { person: "ana", mentions: [writer.agentId] });
  assert.equal(posted.wakeIds.length, 1);
  const seen: RoomEvent[] = [];
  await readUntil(events, seen, (e) => e.detail.case === "message" && e.detail.value.author?.agentId === writer.agentId);
  events.close();
  const messages = seen.flatMap((e) => (e.detail.case === "message" ? [e.detail.value] : []));
  assert.equal(messages[0]?.messageId, posted.message?.messageId);
  const reply = messages.at(-1)!;
  assert.ok(reply.runId && reply.body);

  const sent = await a.sendTask(room.roomId, { toAgentId: writer.agentId, title: "Write the note", person: "ana" });
  assert.equal(sent.wakeIds.length, 1);
  const closed = await a.updateTask(room.roomId, sent.task!.taskId, { person: "ana", note: "thanks", status: "done" });
  assert.equal(closed.status, TaskStatus.DONE);

  let run = await b.getRun(reply.runId);
  for (let i = 0; i < 600 && run.step !== RunStep.ENDED; i++) {
    await new Promise((resolve) => setTimeout(resolve, 50));
    run = await b.getRun(reply.runId);
  }
  assert.equal(run.status, RunStatus.SUCCEEDED);
  assert.equal(run.postedMessageId, reply.messageId);
  assert.ok((await collect(b.runs({ agentId: writer.agentId }))).some((r) => r.runId === reply.runId));
  await assert.rejects(a.getRun(reply.runId), NotFound);
});

test("a write retried after the Gateway is killed mid-call posts once", async () => {
  const acme = await stack.company();
  const c = client(acme);
  const room = await c.createRoom("kill mid call");
  const { kills } = await stack.post<{ kills: number }>("/gateway");
  retries.length = 0;
  // The Room stores the message and answers; the answer is held, the Gateway killed with the call
  // under way and started again on the same port; the client sends the call again with the same key.
  await stack.post("/gateway/kill-once-posted", { room_id: room.roomId, body: "exactly once" });
  const posted = await c.postMessage(room.roomId, "exactly once", { person: "ana" });
  assert.equal((await stack.post<{ kills: number }>("/gateway/kill-once-posted/done")).kills, kills + 1);
  assert.ok(retries.some((r) => r.method === "PostMessage" && r.attempt === 1), JSON.stringify(retries));
  assert.deepEqual((await stack.post<{ bodies: string[] }>("/messages", { room_id: room.roomId })).bodies, ["exactly once"]);
  assert.deepEqual((await collect(c.messages(room.roomId))).map((m) => m.messageId), [posted.message?.messageId]);
});

test("a write without an idempotency key is not sent again after an unknown outcome", async () => {
  const acme = await stack.company();
  const c = client(acme, { retry: { ...PATIENT, attemptTimeoutMs: 1000, totalTimeoutMs: 20_000 } });
  const room = await c.createRoom("held");
  await stack.post("/room/hold-replies");
  try {
    const held = await c.createRoom("made once").then(() => undefined, (e: unknown) => e);
    assert.ok(held instanceof DeadlineExceeded, String(held));
    assert.equal(held.attempts, 1);
  } finally {
    await stack.post("/room/release-replies");
  }
  assert.equal((await collect(c.rooms())).filter((r) => r.name === "made once").length, 1);

  await stack.post("/room/hold-replies");
  const release = setTimeout(() => void stack.post("/room/release-replies"), 2500);
  try {
    const posted = await c.postMessage(room.roomId, "retried", { person: "ana" });
    assert.deepEqual((await collect(c.messages(room.roomId))).map((m) => m.messageId), [posted.message?.messageId]);
  } finally {
    clearTimeout(release);
    await stack.post("/room/release-replies");
  }
});

test("a watch across two Gateway kills and a RESOURCE_EXHAUSTED cut yields every event once, in order", async () => {
  const acme = await stack.company();
  const writer = client(acme);
  const other = client(acme, { address: stack.extra.other_gateway });
  const watcher = client(acme);
  const room = await writer.createRoom("watched");
  const posted: string[] = [];
  const post = async (c: Client, bodies: string[]) => {
    for (const body of bodies) {
      await c.postMessage(room.roomId, body, { person: "ana" });
      posted.push(body);
    }
  };
  const received: RoomEvent[] = [];
  const watch = watcher.watch(room.roomId, { after: 0, idleTimeoutMs: 30_000 });
  const until = (body: string) => readUntil(watch, received, (e) => bodyOf(e) === body);
  retries.length = 0;

  await post(writer, ["a0", "a1", "a2", "a3", "a4"]);
  await until("a4");
  // Kill one: the stream drops; what is posted meanwhile (through another Gateway) is replayed.
  await stack.post("/gateway/kill");
  await post(other, ["b0", "b1", "b2", "b3", "b4"]);
  await stack.post("/gateway/start");
  await until("b4");
  // Kill two, in the middle of a batch the watcher is still reading.
  await post(writer, Array.from({ length: 10 }, (_, i) => `c${i}`));
  await until("c2");
  await stack.post("/gateway/kill");
  await post(other, ["d0", "d1", "d2", "d3", "d4"]);
  await stack.post("/gateway/start");
  await until("d4");
  const reconnectsBeforeCut = watch.reconnects;

  // The cut: the watcher reads nothing while large messages arrive; the Gateway ends the stream with
  // RESOURCE_EXHAUSTED once its buffer for it is full; the watch resumes by itself.
  await post(writer, Array.from({ length: 40 }, (_, i) => `e${String(i).padStart(2, "0")} ${"x".repeat(60_000)}`));
  await until(posted.at(-1)!);
  watch.close();

  assert.ok(retries.some((r) => r.method === "WatchRoom" && r.codeName === "RESOURCE_EXHAUSTED"), JSON.stringify(retries));
  assert.ok(watch.reconnects >= reconnectsBeforeCut + 1 && reconnectsBeforeCut >= 2, `${reconnectsBeforeCut} ${watch.reconnects}`);
  assert.deepEqual(received.filter((e) => e.kind === RoomEventKind.MESSAGE_POSTED).map(bodyOf), posted);
  const log = await stack.post<{ events: { cursor: number; kind: number }[] }>("/events", { room_id: room.roomId, company_id: acme.company_id });
  assert.deepEqual(received.map((e) => [Number(e.cursor), e.kind]), log.events.map((e) => [e.cursor, e.kind]));
  assert.equal(watch.cursor, received.at(-1)!.cursor);
});

test("a watch resumes from a persisted cursor", async () => {
  const c = client(await stack.company());
  const room = await c.createRoom("persisted");
  for (const body of ["one", "two", "three"]) {
    await c.postMessage(room.roomId, body, { person: "ana" });
  }
  const first = c.watch(room.roomId, { after: 0 });
  await readUntil(first, [], (e) => bodyOf(e) === "two");
  first.close();
  const kept = String(first.cursor); // what a caller stores
  const second = await c.watch(room.roomId, { after: kept }).ready();
  await c.postMessage(room.roomId, "four", { person: "ana" });
  const rest: RoomEvent[] = [];
  await readUntil(second, rest, (e) => bodyOf(e) === "four");
  second.close();
  assert.deepEqual(rest.map(bodyOf), ["three", "four"]);
});

test("paging over a thousand messages", async () => {
  const c = client(await stack.company());
  const room = await c.createRoom("long");
  const bodies = Array.from({ length: 1003 }, (_, i) => `m${String(i).padStart(4, "0")}`);
  for (let start = 0; start < bodies.length; start += 25) {
    await Promise.all(bodies.slice(start, start + 25).map((b) => c.postMessage(room.roomId, b, { person: "ana" })));
  }
  const listed = await collect(c.messages(room.roomId, { pageSize: 7 }));
  assert.deepEqual(listed.map((m) => m.body).sort(), bodies);
  assert.equal(new Set(listed.map((m) => m.messageId)).size, bodies.length);
  const seqs = listed.map((m) => m.seq);
  assert.deepEqual(seqs, [...seqs].sort((x, y) => (x < y ? -1 : 1)));
  const newest = (await collect(c.messages(room.roomId, { newestFirst: true }))).map((m) => m.seq);
  assert.deepEqual(newest, [...seqs].reverse());
});

test("every typed error", async () => {
  const [acme, bolt] = [await stack.company(), await stack.company()];
  const a = client(acme, { retry: NO_RETRY });
  const b = client(bolt, { retry: NO_RETRY });
  const room = await a.createRoom("errors");
  await b.acceptInvitation((await a.inviteCompany(room.roomId, bolt.company_id)).invitationId);
  const expect = async (call: Promise<unknown>, cls: Function, codeName: string, says = "") => {
    const error = await call.then(() => undefined, (e: unknown) => e);
    assert.ok(error instanceof cls, `${cls.name} expected, got ${String(error)}`);
    assert.equal((error as InvalidArgument).codeName, codeName);
    assert.ok((error as InvalidArgument).rawMessage.includes(says), (error as Error).message);
    return error as InvalidArgument;
  };
  const unknown = crypto.randomUUID();
  await expect(a.postMessage(room.roomId, "", { person: "ana" }), InvalidArgument, "INVALID_ARGUMENT", "body");
  await expect(a.getTask(unknown, unknown), NotFound, "NOT_FOUND");
  await expect(a.inviteCompany(room.roomId, bolt.company_id), AlreadyExists, "ALREADY_EXISTS", "member");
  await expect(b.removeMember(room.roomId, acme.company_id), PermissionDenied, "PERMISSION_DENIED", "creat");
  await expect(a.leaveRoom(room.roomId), FailedPrecondition, "FAILED_PRECONDITION", "creator");
  const stranger = client({ company_id: "", name: "", api_key: `qyk_${crypto.randomUUID()}_nope` });
  await expect(stranger.whoAmI(), Unauthenticated, "UNAUTHENTICATED", "unknown API key");

  // OUT_OF_RANGE: the events after cursor 1 are no longer kept.
  const forgotten = (await a.postMessage(room.roomId, "soon forgotten", { person: "ana" })).message!;
  const replay = a.watch(room.roomId, { after: 0 });
  await readUntil(replay, [], (e) => e.detail.case === "message" && e.detail.value.messageId === forgotten.messageId);
  replay.close();
  await stack.post("/events/expire", { room_id: room.roomId, through_cursor: Number(replay.cursor) });
  await expect(a.watch(room.roomId, { after: 1 })[Symbol.asyncIterator]().next(), CursorExpired, "OUT_OF_RANGE");

  // RESOURCE_EXHAUSTED with the advised wait, not waited for beyond maxAdvisedWaitMs, honoured otherwise.
  const limited = client(acme, { address: stack.extra.limited_gateway, retry: NO_RETRY });
  const limitedRoom = await limited.createRoom("limited");
  await limited.postMessage(limitedRoom.roomId, "first", { person: "ana" });
  const limit = await expect(limited.postMessage(limitedRoom.roomId, "second", { person: "ana" }), RateLimited, "RESOURCE_EXHAUSTED", "rate limit");
  const advised = (limit as unknown as RateLimited).retryAfterMs;
  assert.ok(advised !== undefined && advised > 0 && advised <= 1000, String(advised));
  const impatient = await limited.withRetry({ maxAttempts: 6, maxAdvisedWaitMs: 1 }).postMessage(limitedRoom.roomId, "x", { person: "ana" }).catch((e: unknown) => e);
  assert.ok(impatient instanceof RateLimited && impatient.attempts === 1, String(impatient));
  retries.length = 0;
  const patient = limited.withRetry({ maxAttempts: 6, initialBackoffMs: 10, maxBackoffMs: 20 });
  for (const body of ["third", "fourth"]) {
    await patient.postMessage(limitedRoom.roomId, body, { person: "ana" });
  }
  assert.ok(retries.some((r) => r.codeName === "RESOURCE_EXHAUSTED" && r.advisedMs !== undefined), JSON.stringify(retries));
  assert.deepEqual((await collect(a.messages(limitedRoom.roomId))).map((m) => m.body), ["first", "third", "fourth"]);

  // DEADLINE_EXCEEDED (the Room's answers held) and UNAVAILABLE (nothing listens) after the policy's attempts.
  const quick = { maxAttempts: 3, initialBackoffMs: 10, maxBackoffMs: 20, attemptTimeoutMs: 300, totalTimeoutMs: 5000 };
  await stack.post("/room/hold-replies");
  try {
    const late = await expect(client(acme, { retry: quick }).getTask(room.roomId, unknown), DeadlineExceeded, "DEADLINE_EXCEEDED");
    assert.equal(late.attempts, 3);
  } finally {
    await stack.post("/room/release-replies");
  }
  const down = await expect(client(acme, { address: "127.0.0.1:9", retry: quick }).whoAmI(), Unavailable, "UNAVAILABLE");
  assert.equal(down.attempts, 3);
});

test("the API key is never shown", async () => {
  const acme = await stack.company();
  const c = client(acme, { address: "127.0.0.1:9", retry: { maxAttempts: 2, initialBackoffMs: 10, maxBackoffMs: 20 } });
  retries.length = 0;
  const failed = await c.whoAmI().catch((e: unknown) => e as Error);
  const shown = [inspect(c, { depth: 10, showHidden: true }), JSON.stringify(c), String(failed), inspect(failed, { depth: 10 }), JSON.stringify(retries)];
  assert.ok(retries.length > 0);
  for (const text of shown) {
    assert.ok(!text.includes(acme.api_key), text);
  }
  assert.throws(() => connect({ address: stack.extra.gateway, apiKey: "qyk_with a space", plaintext: true }), (e: Error) => !e.message.includes("with a space"));
});

test("TLS is on unless plaintext is asked for", async () => {
  const acme = await stack.company();
  const address = stack.extra.tls_gateway;
  const port = address.split(":").at(-1);
  const quick = { maxAttempts: 1, attemptTimeoutMs: 2000 };
  const trusted = connect({ address, apiKey: acme.api_key, tls: { ca: stack.extra.tls_ca_pem } });
  const named = connect({ address: `localhost:${port}`, apiKey: acme.api_key, tls: { ca: stack.extra.tls_ca_pem } });
  clients.push(trusted, named);
  assert.equal((await trusted.whoAmI()).companyId, acme.company_id);
  assert.equal((await named.whoAmI()).companyId, acme.company_id);
  for (const refused of [
    connect({ address, apiKey: acme.api_key, retry: quick }), // Node's roots do not know it
    connect({ address, apiKey: acme.api_key, tls: { ca: stack.extra.tls_ca_pem, serverName: "other.invalid" }, retry: quick }),
    connect({ address, apiKey: acme.api_key, plaintext: true, retry: quick }),
  ]) {
    clients.push(refused);
    const error = await refused.whoAmI().catch((e: unknown) => e);
    assert.ok(error instanceof Unavailable || error instanceof DeadlineExceeded || (error as { codeName?: string }).codeName === "INTERNAL", String(error));
  }
  assert.throws(() => connect({ address, apiKey: acme.api_key, plaintext: true, tls: { ca: "x" } }), /contradict/);
});

test("the caller's trace context reaches the Gateway", async () => {
  const acme = await stack.company();
  const c = client(acme, { address: stack.extra.other_gateway });
  const before = (await stack.post<{ spans: unknown[] }>("/spans", { rpc: "WhoAmI" })).spans.length;
  await c.whoAmI(); // no context registered yet: nothing is sent
  const manager = new AsyncLocalStorageContextManager().enable();
  context.setGlobalContextManager(manager);
  propagation.setGlobalPropagator(new W3CTraceContextPropagator());
  const traceId = "4bf92f3577b34da6a3ce929d0e0e4736";
  const spanId = "00f067aa0ba902b7";
  try {
    const active = trace.setSpanContext(context.active(), { traceId, spanId, traceFlags: TraceFlags.SAMPLED, isRemote: false });
    await context.with(active, () => c.whoAmI());
  } finally {
    propagation.disable();
    context.disable();
  }
  const spans = (await stack.post<{ spans: { trace_id: string; parent_span_id: string | null }[] }>("/spans", { rpc: "WhoAmI" })).spans.slice(before);
  assert.equal(spans.length, 2, JSON.stringify(spans));
  assert.ok(spans.some((s) => s.parent_span_id === null));
  assert.ok(spans.some((s) => s.trace_id === traceId && s.parent_span_id === spanId), JSON.stringify(spans));
});

test("the rest of the surface against the real Gateway", async () => {
  const [acme, bolt] = [await stack.company(), await stack.company()];
  const a = client(acme);
  const b = client(bolt);
  const room = await a.createRoom("surface");
  const declined = await b.declineInvitation((await a.inviteCompany(room.roomId, bolt.company_id)).invitationId);
  assert.equal(declined.status, InvitationStatus.DECLINED);
  assert.deepEqual((await collect(b.invitations({ status: "declined" }))).map((i) => i.invitationId), [declined.invitationId]);
  assert.ok((await collect(a.rooms())).some((r) => r.roomId === room.roomId));

  const uploaded = await a.uploadFile(room.roomId, "notes.txt", "the launch is on Tuesday\n", { person: "ana" });
  assert.deepEqual((await collect(a.files(room.roomId))).map((f) => f.fileId), [uploaded.fileId]);
  assert.ok((await a.searchPassages(room.roomId, "launch")).some((p) => p.text.includes("Tuesday")));
  assert.deepEqual(await collect(a.memory(room.roomId)), []);

  const agent = await a.registerAgent({ name: "helper", provider: "openai", model: "gpt-test", providerKey: "sk-test" });
  const rights = await a.setAgentRights({ agentId: agent.agentId, remember: "hold", closeTask: "deny" });
  assert.equal(rights.remember, ActionRight.HOLD);
  assert.equal((await a.getAgentRights(agent.agentId)).effective?.closeTask, ActionRight.DENY);
  // Only the rights named change (the request's field mask).
  const again = await a.setAgentRights({ agentId: agent.agentId, createTask: "hold" });
  assert.deepEqual([again.remember, again.createTask], [ActionRight.HOLD, ActionRight.HOLD]);
  const cleared = await a.setAgentRights({ agentId: agent.agentId, closeTask: "deny", replace: true });
  assert.equal(cleared.remember, ActionRight.UNSPECIFIED);
  await assert.rejects(a.setAgentRights({ agentId: agent.agentId }), /at least one right/);
  assert.deepEqual(await collect(a.approvals()), []);
  await assert.rejects(a.decideApproval(crypto.randomUUID(), 0, { person: "ana", approve: true }), NotFound);

  const sent = await a.sendTask(room.roomId, { toAgentId: agent.agentId, title: "check", person: "ana" });
  assert.deepEqual((await collect(a.tasks(room.roomId, { toAgentId: agent.agentId }))).map((t) => t.taskId), [sent.task?.taskId]);
  assert.equal((await a.getTask(room.roomId, sent.task!.taskId)).title, "check");

  const other = await a.createRoom("left");
  await b.acceptInvitation((await a.inviteCompany(other.roomId, bolt.company_id)).invitationId);
  await b.leaveRoom(other.roomId);
  await assert.rejects(b.getTask(other.roomId, sent.task!.taskId), NotFound);
  const third = await a.createRoom("removed");
  await b.acceptInvitation((await a.inviteCompany(third.roomId, bolt.company_id)).invitationId);
  await a.removeMember(third.roomId, bolt.company_id);
  assert.deepEqual((await collect(a.members(third.roomId))).map((m) => m.companyId), [acme.company_id]);
  // @ts-expect-error: not a provider (the compiler says so too)
  await assert.rejects(a.registerAgent({ name: "x", provider: "nonsense", model: "m" }), /not one of/);
});
