// A room's events as an async iterable that resumes by itself: after a dropped stream, a Gateway
// restart or RESOURCE_EXHAUSTED it watches again after the last cursor it saw, so no event is missed
// and none is repeated. `cursor` is the position to persist.
import { create } from "@bufbuild/protobuf";
import type { RoomEvent } from "./gen/quayutec/v1/common_pb.js";
import { WatchRoomRequestSchema, type WatchRoomResponse } from "./gen/quayutec/v1/gateway_pb.js";
import { Unavailable, type QuayutecError } from "./errors.js";
import { callError, Code, sleep, type Transport } from "./transport.js";
import type { RetryPolicy } from "./retry.js";

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
 * CursorExpired when `after` is older than the events kept).
 */
export class RoomWatch implements AsyncIterable<RoomEvent> {
  cursor: bigint | undefined;
  reconnects = 0;
  private readonly pending: RoomEvent[] = [];
  private stream: AsyncIterator<WatchRoomResponse> | undefined;
  private abort: AbortController | undefined;
  private closed = false;

  constructor(
    private readonly transport: Transport,
    private readonly policy: RetryPolicy,
    readonly roomId: string,
    after: bigint | number | string | undefined,
    private readonly idleTimeoutMs: number,
  ) {
    if (!(idleTimeoutMs > 0)) {
      throw new RangeError("idleTimeoutMs must be positive");
    }
    this.cursor = after === undefined ? undefined : BigInt(after);
  }

  /** Leaving a `for await` loop (break, return) keeps the stream: iterate again to carry on, and
   * call close() when done. */
  async *[Symbol.asyncIterator](): AsyncGenerator<RoomEvent, void, undefined> {
    for (;;) {
      while (this.pending.length === 0) {
        if (this.closed) {
          return;
        }
        await this.receive();
      }
      const event = this.pending.shift() as RoomEvent;
      this.cursor = event.cursor;
      yield event;
    }
  }

  /** Open the stream and wait for its first answer. */
  async ready(): Promise<this> {
    if (this.stream === undefined && this.pending.length === 0) {
      await this.receive();
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

  private open(): AsyncIterator<WatchRoomResponse> {
    this.abort = new AbortController();
    const request = create(WatchRoomRequestSchema, { roomId: this.roomId, after: this.cursor });
    return this.transport.stream("watchRoom", request, this.abort.signal)[Symbol.asyncIterator]();
  }

  /** Read the next answer into the pending events, reconnecting as the policy allows. */
  private async receive(): Promise<void> {
    const started = performance.now();
    for (let failures = 1; !this.closed; failures++) {
      this.stream ??= this.open();
      let error: QuayutecError;
      let timer: NodeJS.Timeout | undefined;
      try {
        const idle = new Promise<"idle">((resolve) => {
          timer = setTimeout(() => resolve("idle"), this.idleTimeoutMs);
        });
        const next = await Promise.race([this.stream.next(), idle]);
        if (next === "idle") {
          this.drop();
          error = new Unavailable(Code.Unavailable, `nothing, not even a heartbeat, for ${this.idleTimeoutMs} ms`, "WatchRoom", failures);
        } else if (next.done) {
          this.stream = undefined; // ended without an error: the Gateway went away
          error = new Unavailable(Code.Unavailable, "the stream ended", "WatchRoom", failures);
        } else {
          this.take(next.value);
          return;
        }
      } catch (reason) {
        this.drop();
        if (this.closed) {
          return;
        }
        error = callError(reason, "WatchRoom", failures, false);
      } finally {
        clearTimeout(timer);
      }
      const wait = this.transport.retryWaitMs(this.policy, error, failures, started);
      if (wait === undefined) {
        throw error;
      }
      this.reconnects++;
      await sleep(wait, this.transport.signal);
    }
  }

  private take(response: WatchRoomResponse): void {
    let last = this.pending.at(-1)?.cursor ?? this.cursor ?? -1n;
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
