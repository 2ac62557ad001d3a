// Room events as async iterables that resume by themselves: after a dropped stream, a Gateway restart
// or RESOURCE_EXHAUSTED they watch again after the last cursors they received, so no event is missed
// and none is repeated. RoomWatch follows one room (WatchRoom) and its `cursor` is the position to
// persist; RoomsWatch follows every room of your company (WatchRooms) and its `cursors` (room id to
// cursor) are.
import { create } from "@bufbuild/protobuf";
import type { RoomEvent } from "./gen/quayutec/v1/common_pb.js";
import {
  WatchRoomRequestSchema,
  WatchRoomsRequestSchema,
  type WatchRoomResponse,
  type WatchRoomsHeartbeat,
  type WatchRoomsResponse,
} from "./gen/quayutec/v1/gateway_pb.js";
import { Unavailable, type QuayutecError } from "./errors.js";
import { randomUUID } from "node:crypto";
import { Code, identified, type Transport } from "./transport.js";
import { RETRYABLE, type RetryPolicy } from "./retry.js";

/**
 * One server stream opened again, as the policy allows, whenever it fails with UNAVAILABLE,
 * DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED, ends, or stays silent for `idleTimeoutMs`; each answer goes
 * to `take`, and `open` says where to resume.
 */
abstract class ResumingStream<Response> {
  reconnects = 0;
  /** Sent as x-request-id on every stream of this watch, and in its errors. */
  readonly requestId = randomUUID().replaceAll("-", "");
  /** Received, not yet handed out. */
  protected readonly pending: (RoomEvent | WatchRoomsHeartbeat)[] = [];
  private stream: AsyncIterator<Response> | undefined;
  private abort: AbortController | undefined;
  protected closed = false;

  constructor(
    protected readonly transport: Transport,
    private readonly policy: RetryPolicy,
    private readonly idleTimeoutMs: number,
    private readonly method: string,
  ) {
    if (!(idleTimeoutMs > 0)) {
      throw new RangeError("idleTimeoutMs must be positive");
    }
  }

  protected abstract open(signal: AbortSignal): AsyncIterable<Response>;
  protected abstract take(response: Response): void;

  /** The next item received (reading, and reconnecting, while there is none); undefined once closed. */
  protected async nextItem(): Promise<RoomEvent | WatchRoomsHeartbeat | undefined> {
    while (this.pending.length === 0) {
      if (this.closed) {
        return undefined;
      }
      await this.identifiedReceive();
    }
    return this.pending.shift();
  }

  private async identifiedReceive(): Promise<void> {
    try {
      await this.receive();
    } catch (error) {
      throw identified(error, this.requestId, this.transport.headers());
    }
  }

  /** Open the stream and wait for its first answer. */
  async ready(): Promise<this> {
    if (this.stream === undefined && this.pending.length === 0) {
      await this.identifiedReceive();
    }
    return this;
  }

  /** Stop watching; the iteration ends. */
  close(): void {
    this.closed = true;
    this.drop();
  }

  private drop(): void {
    this.abort?.abort(new Error("watch closed"));
    this.abort = undefined;
    this.stream = undefined;
  }

  /** Read the next answer into the pending items, reconnecting as the policy allows; Closed when the
   * client is closed under it. */
  protected async receive(): Promise<void> {
    const started = performance.now();
    let failures = 0;
    let closedEarly = 0;
    for (let tries = 1; !this.closed; tries++) {
      const stop = this.transport.stopped(this.method, tries - 1);
      if (stop) {
        throw stop;
      }
      if (this.stream === undefined) {
        await this.transport.ready;
        this.abort = new AbortController();
        this.stream = this.open(this.abort.signal)[Symbol.asyncIterator]();
      }
      let error: QuayutecError;
      let sent = true;
      let timer: NodeJS.Timeout | undefined;
      try {
        const idle = new Promise<"idle">((resolve) => {
          timer = setTimeout(() => resolve("idle"), this.idleTimeoutMs);
        });
        const next = await Promise.race([this.stream.next(), idle]);
        if (next === "idle") {
          this.drop();
          error = new Unavailable(Code.Unavailable, `nothing, not even a heartbeat, for ${this.idleTimeoutMs} ms`, this.method, tries);
        } else if (next.done) {
          this.stream = undefined; // ended without an error: the Gateway went away
          error = new Unavailable(Code.Unavailable, "the stream ended", this.method, tries);
        } else {
          this.transport.markAnswered();
          this.take(next.value);
          return;
        }
      } catch (reason) {
        this.drop();
        if (this.closed) {
          return;
        }
        const stop = this.transport.stopped(this.method, tries);
        if (stop) {
          throw stop;
        }
        const failed = this.transport.failure(reason, this.method, tries, closedEarly);
        ({ error, sent, closedEarly } = failed);
      } finally {
        clearTimeout(timer);
      }
      failures += sent ? 1 : 0;
      const wait = this.transport.retryWaitMs(this.policy, error, sent ? failures : 0, started, RETRYABLE.has(error.code), tries);
      if (wait === undefined) {
        throw error;
      }
      this.reconnects++;
      await this.transport.pause(wait, this.method, tries);
    }
  }
}

/**
 * Iterate with `for await (const event of watch)`; each RoomEvent comes once, in room order.
 *
 * `cursor` is the cursor of the last event handed to you (or of a heartbeat after it): store it once
 * you have handled an event (`String(cursor)`), and pass it back as `after` to carry on after a
 * restart of your own. Before the first answer of a watch from now it is undefined. `await
 * watch.ready()` opens the stream and waits for its first answer (so "from now" is then); otherwise it
 * opens at the first iteration.
 *
 * A stream that fails with UNAVAILABLE, DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED, ends, or stays silent
 * for `idleTimeoutMs` (the Gateway sends heartbeats when idle) is opened again after `cursor`, with
 * the policy's backoff; its attempts and total time bound the reconnects between two answers. Other
 * errors end the iteration as typed errors (NotFound when the company is no longer a member,
 * Unauthenticated when the key was revoked, CursorOutOfRange when `after` is older than the events
 * kept or past the room's newest event).
 */
export class RoomWatch extends ResumingStream<WatchRoomResponse> implements AsyncIterable<RoomEvent> {
  cursor: bigint | undefined;

  constructor(transport: Transport, policy: RetryPolicy, readonly roomId: string, after: bigint | number | string | undefined, idleTimeoutMs: number) {
    super(transport, policy, idleTimeoutMs, "WatchRoom");
    this.cursor = after === undefined ? undefined : BigInt(after);
  }

  /** Leaving a `for await` loop (break, return) keeps the stream: iterate again to carry on, and
   * call close() when done. */
  async *[Symbol.asyncIterator](): AsyncGenerator<RoomEvent, void, undefined> {
    let event: RoomEvent | undefined;
    while ((event = (await this.nextItem()) as RoomEvent | undefined)) {
      this.cursor = event.cursor;
      yield event;
    }
  }

  protected open(signal: AbortSignal): AsyncIterable<WatchRoomResponse> {
    return this.transport.stream("watchRoom", create(WatchRoomRequestSchema, { roomId: this.roomId, after: this.cursor }), signal, this.requestId);
  }

  protected take(response: WatchRoomResponse): void {
    let last = (this.pending.at(-1) as RoomEvent | undefined)?.cursor ?? this.cursor ?? -1n;
    for (const event of response.events) {
      if (event.cursor > last) {
        // never twice, even if a stream repeated itself
        this.pending.push(event);
        last = event.cursor;
      }
    }
    if (response.heartbeat && this.pending.length === 0) {
      const beat = response.heartbeat.cursor;
      this.cursor = this.cursor === undefined || beat > this.cursor ? beat : this.cursor;
    }
  }
}

/** Cursors by room, as a caller keeps them: bigints, or the strings and numbers they were stored as. */
export type RoomCursors = ReadonlyMap<string, bigint | number | string> | Readonly<Record<string, bigint | number | string>>;

/** The rooms a heartbeat lists, at its cursors (never behind `cursors`): rooms it no longer lists were
 * left, rooms new to it were joined. */
function moved(cursors: ReadonlyMap<string, bigint>, heartbeat: WatchRoomsHeartbeat): Map<string, bigint> {
  return new Map(
    heartbeat.rooms.map((r) => {
      const had = cursors.get(r.roomId);
      return [r.roomId, had !== undefined && had > r.cursor ? had : r.cursor];
    }),
  );
}

/**
 * Iterate with `for await (const event of watch)`: the events of every room of your company, each once
 * and in its room's order (rooms interleave; `event.roomId` says which).
 *
 * `cursors` maps each room followed to the cursor of its last event handed to you (or of a heartbeat
 * after it): store it once you have handled an event, and pass it back as `after` to carry on after a
 * restart of your own. A room your company joins while watching is followed from its joining (its
 * MEMBER_JOINED event of your company comes first) and enters `cursors` then; a room it leaves ends
 * with its MEMBER_LEFT event and leaves `cursors` at the next heartbeat.
 *
 * Without `after` the watch starts from now (after `await watch.ready()`, then) and `cursors` fills at
 * the Gateway's first heartbeat. With `after`, the rooms it names resume after their cursors and every
 * other room of your company starts from its joining, so nothing of a room joined while you were away
 * is missed; a named room your company has left is dropped. (The Gateway looks for the joining among a
 * room's newest 500 events; a room joined longer ago starts at the oldest of those.)
 *
 * It reconnects as RoomWatch does (after the last cursors received; rooms joined while the stream was
 * down are followed from their joining too). Other errors end the iteration as typed errors:
 * Unauthenticated when the key was revoked or expired, RateLimited when more rooms than one stream
 * follows, CursorOutOfRange (with its `roomId`) when a cursor is older than the events kept or past its
 * room's newest event, InvalidArgument when `after` is malformed.
 */
export class RoomsWatch extends ResumingStream<WatchRoomsResponse> implements AsyncIterable<RoomEvent> {
  /** What was handed out (the caller's position). */
  private handed: Map<string, bigint>;
  /** What was received (where a stream resumes). */
  private received: Map<string, bigint>;
  /** From the first heartbeat on (or with the caller's cursors), a room not named was joined since. */
  private fromJoining: boolean;

  constructor(transport: Transport, policy: RetryPolicy, after: RoomCursors | undefined, idleTimeoutMs: number) {
    super(transport, policy, idleTimeoutMs, "WatchRooms");
    const entries = after === undefined ? [] : after instanceof Map ? [...after] : Object.entries(after);
    this.handed = new Map(entries.map(([room, cursor]) => [room, BigInt(cursor)]));
    this.received = new Map(this.handed);
    this.fromJoining = after !== undefined;
  }

  /** Room id -> the cursor to resume that room after (a copy). */
  get cursors(): Map<string, bigint> {
    return new Map(this.handed);
  }

  /** Leaving a `for await` loop (break, return) keeps the stream: iterate again to carry on, and
   * call close() when done. */
  async *[Symbol.asyncIterator](): AsyncGenerator<RoomEvent, void, undefined> {
    let item: RoomEvent | WatchRoomsHeartbeat | undefined;
    while ((item = await this.nextItem())) {
      if (item.$typeName === "quayutec.v1.WatchRoomsHeartbeat") {
        this.handed = moved(this.handed, item);
      } else {
        this.handed.set(item.roomId, item.cursor);
        yield item;
      }
    }
  }

  protected open(signal: AbortSignal): AsyncIterable<WatchRoomsResponse> {
    const request = create(WatchRoomsRequestSchema, {
      after: [...this.received].map(([roomId, cursor]) => ({ roomId, cursor })),
      unnamedFromJoining: this.fromJoining,
    });
    return this.transport.stream("watchRooms", request, signal, this.requestId);
  }

  protected take(response: WatchRoomsResponse): void {
    for (const event of response.events) {
      if (event.cursor > (this.received.get(event.roomId) ?? -1n)) {
        // never twice, even if a stream repeated itself
        this.received.set(event.roomId, event.cursor);
        this.pending.push(event);
      }
    }
    if (response.heartbeat) {
      this.received = moved(this.received, response.heartbeat);
      this.fromJoining = true;
      if (this.pending.length > 0) {
        this.pending.push(response.heartbeat); // it applies once the events before it are handed out
      } else {
        this.handed = moved(this.handed, response.heartbeat);
      }
    }
  }
}
