// The one layer that sends Gateway calls: the RPC table typed from the generated service, the
// channel and its headers (API key, trace context), and the retry loop.
import { Code, createClient, type CallOptions, type Client as ConnectClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { GatewayService } from "./gen/quayutec/v1/gateway_pb.js";
import { setMaxListeners } from "node:events";
import { errorFor, RateLimited, Unavailable, type QuayutecError } from "./errors.js";
import { REFUSED_BEFORE_ACTING, RETRYABLE, waitBeforeMs, type RetryPolicy } from "./retry.js";

type Otel = typeof import("@opentelemetry/api");
// Trace context follows the caller's active span when @opentelemetry/api is installed; nothing when not.
const otel: Otel | undefined = await import("@opentelemetry/api").catch(() => undefined);

/** The generated service's methods, by their TypeScript names (whoAmI, postMessage, ...). */
export type GatewayMethods = typeof GatewayService.method;
export type RpcKey = keyof GatewayMethods;
type Raw = ConnectClient<typeof GatewayService>;
export type UnaryKey = { [K in RpcKey]: GatewayMethods[K]["methodKind"] extends "unary" ? K : never }[RpcKey];
type StreamKey = { [K in RpcKey]: GatewayMethods[K]["methodKind"] extends "server_streaming" ? K : never }[RpcKey];
export type RequestOf<K extends RpcKey> = Parameters<Raw[K]>[0];
export type ResponseOf<K extends UnaryKey> = Awaited<ReturnType<Raw[K]>>;

/** What sending a call again may do, which decides the codes it is retried on. */
export enum Safety {
  Read = "read",
  /** Carries an idempotency key, the same on every attempt: the Gateway does it once. */
  KeyedWrite = "keyed write",
  /** The Gateway answers a repeat as it answered the first (accepting, deciding, setting again). */
  IdempotentWrite = "idempotent write",
  /** Takes no key and a repeat would act again: retried only when refused before acting, or never sent. */
  UnkeyedWrite = "unkeyed write",
}

/** Every Gateway RPC's safety; the compiler refuses this table while an RPC is missing from it. */
export const SAFETY: { readonly [K in RpcKey]: Safety } = {
  whoAmI: Safety.Read,
  createRoom: Safety.UnkeyedWrite,
  listRooms: Safety.Read,
  inviteCompany: Safety.UnkeyedWrite,
  listInvitations: Safety.Read,
  acceptInvitation: Safety.IdempotentWrite,
  declineInvitation: Safety.IdempotentWrite,
  leaveRoom: Safety.UnkeyedWrite,
  removeMember: Safety.UnkeyedWrite,
  listMembers: Safety.Read,
  registerAgent: Safety.UnkeyedWrite,
  listAgents: Safety.Read,
  postMessage: Safety.KeyedWrite,
  listMessages: Safety.Read,
  sendTask: Safety.KeyedWrite,
  updateTask: Safety.KeyedWrite,
  listTasks: Safety.Read,
  getTask: Safety.Read,
  listMemory: Safety.Read,
  uploadFile: Safety.UnkeyedWrite,
  listFiles: Safety.Read,
  searchPassages: Safety.Read,
  listRuns: Safety.Read,
  getRun: Safety.Read,
  setAgentRights: Safety.IdempotentWrite,
  getAgentRights: Safety.Read,
  listApprovals: Safety.Read,
  decideApproval: Safety.IdempotentWrite,
  watchRoom: Safety.Read,
  watchRooms: Safety.Read,
  // A repeat would make a second key.
  createSessionKey: Safety.UnkeyedWrite,
  // Ending an ended session leaves it ended (a repeat answers UNAUTHENTICATED: the client counts it done).
  endSession: Safety.IdempotentWrite,
  getMessage: Safety.Read,
  // A repeat would make a second key.
  createApiKey: Safety.UnkeyedWrite,
  listApiKeys: Safety.Read,
  // Revoking a revoked key leaves it revoked.
  revokeApiKey: Safety.IdempotentWrite,
  // Setting the same provider again leaves it set; removing a removed one leaves it removed.
  setSignInProvider: Safety.IdempotentWrite,
  getSignInProvider: Safety.Read,
  removeSignInProvider: Safety.IdempotentWrite,
};

/** TLS to the Gateway: `ca` (PEM) to trust instead of Node's roots; `serverName` when the
 * certificate names the Gateway otherwise than the address does. */
export interface TlsOptions {
  ca?: string | Buffer;
  serverName?: string;
}

/** A thrown error that shows the call never left this process (the connection was refused). */
export function neverSent(reason: unknown): boolean {
  for (let cause: unknown = reason, depth = 0; cause instanceof Error && depth < 8; cause = cause.cause, depth++) {
    if ((cause as NodeJS.ErrnoException).code === "ECONNREFUSED") {
      return true;
    }
  }
  return false;
}

/**
 * The typed error of a failed call. connect-node reports a connection that dropped under a call (the
 * Gateway killed, a network cut) as CANCELED; gRPC calls that UNAVAILABLE, and so does this client
 * unless the call was cancelled here (`cancelledHere`).
 */
export function callError(reason: unknown, method: string, attempts: number, cancelledHere: boolean): QuayutecError {
  const error = errorFor(reason, method, attempts);
  if (error.code === Code.Canceled && !cancelledHere) {
    return new Unavailable(Code.Unavailable, `the connection to the Gateway was lost (${error.rawMessage})`, method, attempts, { cause: reason });
  }
  return error;
}

export function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    const stop = () => {
      clearTimeout(timer);
      reject(signal.reason);
    };
    const timer = setTimeout(() => {
      signal.removeEventListener("abort", stop);
      resolve();
    }, ms);
    signal.addEventListener("abort", stop, { once: true });
  });
}

/** A channel to one Gateway, the headers every call carries, and the retry loop. The API key lives
 * only in the closure of `headers`: no property of this object holds it. */
export class Transport {
  readonly raw: Raw;
  readonly headers: () => Record<string, string>;
  /** The key's id (qyk_<key id>_<secret>; not secret: `quayutec keys list` shows it); "" when not shaped so. */
  readonly keyId: string;
  private readonly closing = new AbortController();

  constructor(readonly address: string, apiKey: string, plaintext: boolean, tls: TlsOptions, readonly random: () => number = Math.random) {
    if (!apiKey || !/^[\x21-\x7e]+$/.test(apiKey)) {
      throw new TypeError("apiKey must be a non-empty API key of printable ASCII without spaces (qyk_...)");
    }
    this.keyId = /^qyk_([^_]+)_./.exec(apiKey)?.[1] ?? "";
    const bearer = `Bearer ${apiKey}`;
    this.headers = () => {
      const headers: Record<string, string> = { authorization: bearer };
      otel?.propagation.inject(otel.context.active(), headers);
      return headers;
    };
    const transport = createGrpcTransport({
      baseUrl: `${plaintext ? "http" : "https"}://${address}`,
      nodeOptions: plaintext ? {} : { ...(tls.ca ? { ca: tls.ca } : {}), ...(tls.serverName ? { servername: tls.serverName } : {}) },
      // Ping an idle connection, so a Gateway that vanished without closing it is noticed.
      pingIntervalMs: 15_000,
    });
    this.raw = createClient(GatewayService, transport);
    // Every call under way listens for the client's close: as many listeners as calls, by design.
    setMaxListeners(0, this.closing.signal);
  }

  get signal(): AbortSignal {
    return this.closing.signal;
  }

  close(): void {
    this.closing.abort(new Error("the client was closed"));
  }

  /** Send `request` to RPC `key`, retried as its safety and `policy` allow. */
  async unary<K extends UnaryKey>(key: K, request: RequestOf<K>, policy: RetryPolicy): Promise<ResponseOf<K>> {
    const method = GatewayService.method[key].name;
    const call = this.raw[key] as unknown as (request: unknown, options: CallOptions) => Promise<ResponseOf<K>>;
    const codes = SAFETY[key] === Safety.UnkeyedWrite ? REFUSED_BEFORE_ACTING : RETRYABLE;
    const started = performance.now();
    for (let attempt = 1; ; attempt++) {
      const left = policy.totalTimeoutMs - (performance.now() - started);
      try {
        return await call(request, {
          timeoutMs: Math.max(1, Math.min(policy.attemptTimeoutMs, left)),
          headers: this.headers(),
          signal: this.closing.signal,
        });
      } catch (reason) {
        const error = callError(reason, method, attempt, this.closing.signal.aborted);
        const retryable = codes.has(error.code) || (codes === REFUSED_BEFORE_ACTING && neverSent(reason));
        const wait = this.retryWaitMs(policy, error, attempt, started, retryable);
        if (wait === undefined) {
          throw error;
        }
        await sleep(wait, this.closing.signal);
      }
    }
  }

  /** Open server stream `key` (no deadline). */
  stream<K extends StreamKey>(key: K, request: RequestOf<K>, signal: AbortSignal): ReturnType<Raw[K]> {
    const call = this.raw[key] as unknown as (request: unknown, options: CallOptions) => ReturnType<Raw[K]>;
    return call(request, { headers: this.headers(), signal });
  }

  /** How long to wait before attempt `attempt + 1` after `error`; undefined to give up. */
  retryWaitMs(policy: RetryPolicy, error: QuayutecError, attempt: number, started: number, retryable = RETRYABLE.has(error.code)): number | undefined {
    if (!retryable || attempt >= policy.maxAttempts || this.closing.signal.aborted) {
      return undefined;
    }
    const advised = error instanceof RateLimited ? error.retryAfterMs : undefined;
    if (advised !== undefined && advised > policy.maxAdvisedWaitMs) {
      return undefined;
    }
    const wait = waitBeforeMs(policy, attempt, advised, this.random);
    if (performance.now() - started + wait >= policy.totalTimeoutMs) {
      return undefined;
    }
    onRetry?.({ method: error.method, codeName: error.codeName, attempt, waitMs: wait, advisedMs: advised });
    return wait;
  }
}

/** What the client reports before each retry (never the key): set with `onRetry(listener)`. */
export interface RetryNotice {
  method: string;
  codeName: string;
  attempt: number;
  waitMs: number;
  advisedMs: number | undefined;
}
let onRetry: ((notice: RetryNotice) => void) | undefined;

/** Be told of each retry (for your logs or metrics); `undefined` stops it. */
export function setRetryListener(listener: ((notice: RetryNotice) => void) | undefined): void {
  onRetry = listener;
}

export { Code };
