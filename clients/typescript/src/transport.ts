// The one layer that sends Gateway calls: the RPC table typed from the generated service, the
// channel and its headers (API key, trace context), and the retry loop.
import { Code, createClient, type CallOptions, type Client as ConnectClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import { checkRequest } from "./checks.js";
import { GatewayService } from "./gen/quayutec/v1/gateway_pb.js";
import { setMaxListeners } from "node:events";
import { randomUUID } from "node:crypto";
import { Cancelled, Closed, ConnectionFailed, errorFor, QuayutecError, RateLimited, Unavailable } from "./errors.js";
import { REFUSED_BEFORE_ACTING, RETRYABLE, waitBeforeMs, type RetryPolicy } from "./retry.js";

// Trace context follows the caller's active span when @opentelemetry/api is installed; nothing when
// not. Loaded without a top-level await (so the package also builds as CommonJS); every call waits for
// the load once (`otelLoaded`).
const otelImport = import("@opentelemetry/api");
let otel: Awaited<typeof otelImport> | undefined;
const otelLoaded: Promise<void> = otelImport.then(
  (api) => {
    otel = api;
  },
  () => undefined,
);

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
  createRoom: Safety.KeyedWrite,
  // Renaming to the same name, archiving or retiring again, leaves it as it is.
  renameRoom: Safety.IdempotentWrite,
  archiveRoom: Safety.IdempotentWrite,
  listRooms: Safety.Read,
  inviteCompany: Safety.KeyedWrite,
  listInvitations: Safety.Read,
  acceptInvitation: Safety.IdempotentWrite,
  declineInvitation: Safety.IdempotentWrite,
  listRoomInvitations: Safety.Read,
  withdrawInvitation: Safety.IdempotentWrite,
  leaveRoom: Safety.UnkeyedWrite,
  removeMember: Safety.UnkeyedWrite,
  listMembers: Safety.Read,
  registerAgent: Safety.KeyedWrite,
  renameAgent: Safety.IdempotentWrite,
  retireAgent: Safety.IdempotentWrite,
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
  createSessionKey: Safety.KeyedWrite,
  // Ending an ended session leaves it ended (a repeat answers UNAUTHENTICATED: the client counts it done).
  endSession: Safety.IdempotentWrite,
  getMessage: Safety.Read,
  createApiKey: Safety.KeyedWrite,
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

/** Per-call options, the last argument of every method: `signal` cancels the call (it rejects with
 * Cancelled); `timeoutMs` bounds the whole call, retries included, instead of the policy's total time. */
export interface PerCall {
  signal?: AbortSignal;
  timeoutMs?: number;
}

/** `error`, when a QuayutecError, with the request id and the trace id (of the `traceparent` sent) of
 * its call. */
export function identified(error: unknown, requestId: string, headers: Record<string, string>): unknown {
  if (error instanceof QuayutecError) {
    error.requestId = requestId;
    const parts = (headers.traceparent ?? "").split("-");
    error.traceId = parts.length === 4 ? (parts[1] ?? "") : "";
  }
  return error;
}

/** Node's error codes of a thrown error and of its causes. */
function causeCodes(reason: unknown): string[] {
  const codes: string[] = [];
  for (let cause: unknown = reason, depth = 0; cause instanceof Error && depth < 8; cause = cause.cause, depth++) {
    const code = (cause as NodeJS.ErrnoException).code;
    if (typeof code === "string") {
      codes.push(code);
    }
  }
  return codes;
}

// No connection was made, so the call never left this process.
const UNREACHED = new Set(["ECONNREFUSED", "EHOSTUNREACH", "ENETUNREACH", "EADDRNOTAVAIL"]);
// The connection broke under the call (the Gateway killed, a network cut): it may have been acted on.
const RESET = new Set(["ECONNRESET", "EPIPE", "ECONNABORTED"]);
const TLS_CODE = /^(ERR_SSL_|ERR_TLS_|ERR_OSSL_)|CERT|SELF_SIGNED|UNABLE_TO_(GET|VERIFY)/;
/** A plaintext connection the Gateway drops this many times in a row before ever answering is taken
 * to be to a Gateway that speaks TLS. */
export const CLOSED_EARLY_LIMIT = 4;

/** A thrown error that shows the call never left this process (no connection could be made). */
export function neverSent(reason: unknown): boolean {
  return causeCodes(reason).some((code) => UNREACHED.has(code));
}

/**
 * The typed error of a failed call. connect-node reports a connection that dropped under a call (the
 * Gateway killed, a network cut) as CANCELED, or as ABORTED when the socket was reset; gRPC calls
 * both UNAVAILABLE, and so does this client unless the call was cancelled here (`cancelledHere`).
 */
export function callError(reason: unknown, method: string, attempts: number, cancelledHere: boolean): QuayutecError {
  const error = errorFor(reason, method, attempts);
  if (connectionLost(error, reason, cancelledHere)) {
    return new Unavailable(Code.Unavailable, `the connection to the Gateway was lost (${error.rawMessage})`, method, attempts, { cause: reason });
  }
  return error;
}

function connectionLost(error: QuayutecError, reason: unknown, cancelledHere: boolean): boolean {
  if (cancelledHere || error instanceof Unavailable) {
    return false;
  }
  return error.code === Code.Canceled || (error.code === Code.Aborted && causeCodes(reason).some((code) => RESET.has(code)));
}

export function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) {
      reject(signal.reason);
      return;
    }
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
  readonly headers: (requestId?: string) => Record<string, string>;
  /** The key's id (qyk_<key id>_<secret>; not secret: `quayutec keys list` shows it); "" when not shaped so. */
  readonly keyId: string;
  private readonly closing = new AbortController();
  /** Whether the Gateway ever answered a call of this client. */
  private answered = false;

  constructor(readonly address: string, apiKey: string, readonly plaintext: boolean, tls: TlsOptions, readonly random: () => number = Math.random) {
    if (!apiKey || !/^[\x21-\x7e]+$/.test(apiKey)) {
      throw new TypeError("apiKey must be a non-empty API key of printable ASCII without spaces (qyk_...)");
    }
    this.keyId = /^qyk_([^_]+)_./.exec(apiKey)?.[1] ?? "";
    const bearer = `Bearer ${apiKey}`;
    this.headers = (requestId) => {
      const headers: Record<string, string> = { authorization: bearer, ...(requestId ? { "x-request-id": requestId } : {}) };
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

  get closed(): boolean {
    return this.closing.signal.aborted;
  }

  close(): void {
    this.closing.abort(new Closed(Code.Canceled, "the client was closed", "", 0));
  }

  /** Resolves once the optional @opentelemetry/api was looked for (before a stream's first open). */
  get ready(): Promise<void> {
    return otelLoaded;
  }

  /** A stream answered: the Gateway speaks gRPC on this connection. */
  markAnswered(): void {
    this.answered = true;
  }

  /** Closed when the client was closed, Cancelled when the caller's `signal` aborted; else nothing. */
  stopped(method: string, attempts: number, signal?: AbortSignal): QuayutecError | undefined {
    if (this.closing.signal.aborted) {
      return new Closed(Code.Canceled, "the client was closed", method, attempts);
    }
    if (signal?.aborted) {
      return new Cancelled(Code.Canceled, `the call was aborted (${String(signal.reason)})`, method, attempts, { cause: signal.reason });
    }
    return undefined;
  }

  /** The typed error of a failed attempt, and whether it was sent (a call that found no connection
   * was not). A failed TLS handshake, or a plaintext connection dropped CLOSED_EARLY_LIMIT times in a
   * row before any answer, throws ConnectionFailed: retrying cannot mend either. */
  failure(reason: unknown, method: string, tries: number, closedEarly: number): { error: QuayutecError; sent: boolean; closedEarly: number } {
    const codes = causeCodes(reason);
    const error = callError(reason, method, tries, false);
    if (codes.some((code) => TLS_CODE.test(code))) {
      throw new ConnectionFailed(
        Code.Unavailable,
        `the TLS handshake with the Gateway at ${this.address} failed (${error.rawMessage}): check that the Gateway serves TLS, ` +
          "that its certificate is trusted (tls.ca) and names this address (tls.serverName); a Gateway without TLS needs plaintext: true",
        method,
        tries,
        { cause: reason },
      );
    }
    const early = this.plaintext && !this.answered && error.code === Code.Unavailable && !neverSent(reason) ? closedEarly + 1 : 0;
    if (early >= CLOSED_EARLY_LIMIT) {
      throw new ConnectionFailed(
        Code.Unavailable,
        `the Gateway at ${this.address} dropped the connection before answering, ${early} times in a row: if it serves TLS, connect without plaintext: true`,
        method,
        tries,
        { cause: reason },
      );
    }
    return { error, sent: !codes.some((code) => UNREACHED.has(code)), closedEarly: early };
  }

  /** Wait `ms` before a retry; Closed or Cancelled at once if the client is closed or `signal` aborts. */
  async pause(ms: number, method: string, attempts: number, signal?: AbortSignal): Promise<void> {
    try {
      await sleep(ms, signal ? AbortSignal.any([this.closing.signal, signal]) : this.closing.signal);
    } catch (reason) {
      throw this.stopped(method, attempts, signal) ?? reason;
    }
  }

  /** Send `request` to RPC `key`, retried as its safety and `policy` allow. */
  async unary<K extends UnaryKey>(key: K, request: RequestOf<K>, policy: RetryPolicy, options: PerCall = {}): Promise<ResponseOf<K>> {
    const method = GatewayService.method[key].name;
    checkRequest(method, GatewayService.method[key].input, request as Record<string, unknown>);
    const call = this.raw[key] as unknown as (request: unknown, options: CallOptions) => Promise<ResponseOf<K>>;
    if (options.timeoutMs !== undefined) {
      if (!(options.timeoutMs > 0)) {
        throw new RangeError("timeoutMs must be positive (milliseconds)");
      }
      policy = { ...policy, totalTimeoutMs: options.timeoutMs, attemptTimeoutMs: Math.min(policy.attemptTimeoutMs, options.timeoutMs) };
    }
    const codes = SAFETY[key] === Safety.UnkeyedWrite ? REFUSED_BEFORE_ACTING : RETRYABLE;
    await otelLoaded;
    const requestId = randomUUID().replaceAll("-", "");
    const headers = this.headers(requestId);
    try {
      return await this.send(method, call, request, policy, codes, options, headers);
    } catch (error) {
      throw identified(error, requestId, headers);
    }
  }

  private async send<R>(
    method: string,
    call: (request: unknown, options: CallOptions) => Promise<R>,
    request: unknown,
    policy: RetryPolicy,
    codes: ReadonlySet<Code>,
    options: PerCall,
    headers: Record<string, string>,
  ): Promise<R> {
    const signal = options.signal ? AbortSignal.any([this.closing.signal, options.signal]) : this.closing.signal;
    const started = performance.now();
    let sent = 0;
    let closedEarly = 0;
    for (let tries = 1; ; tries++) {
      const stop = this.stopped(method, tries - 1, options.signal);
      if (stop) {
        throw stop;
      }
      const left = policy.totalTimeoutMs - (performance.now() - started);
      try {
        const answer = await call(request, {
          timeoutMs: Math.max(1, Math.min(policy.attemptTimeoutMs, left)),
          headers,
          signal,
        });
        this.answered = true;
        return answer;
      } catch (reason) {
        const stop = this.stopped(method, tries, options.signal);
        if (stop) {
          throw stop;
        }
        const failed = this.failure(reason, method, tries, closedEarly);
        closedEarly = failed.closedEarly;
        sent += failed.sent ? 1 : 0;
        const retryable = failed.sent ? codes.has(failed.error.code) : true;
        const wait = this.retryWaitMs(policy, failed.error, failed.sent ? sent : 0, started, retryable, tries);
        if (wait === undefined) {
          throw failed.error;
        }
        await this.pause(wait, method, tries, options.signal);
      }
    }
  }

  /** Open server stream `key` (no deadline); it ends when `signal` aborts or the client is closed. */
  stream<K extends StreamKey>(key: K, request: RequestOf<K>, signal: AbortSignal, requestId = ""): ReturnType<Raw[K]> {
    const call = this.raw[key] as unknown as (request: unknown, options: CallOptions) => ReturnType<Raw[K]>;
    return call(request, { headers: this.headers(requestId), signal: AbortSignal.any([signal, this.closing.signal]) });
  }

  /**
   * How long to wait before trying again after `error`, the `attempt`-th attempt that reached the
   * Gateway (0: none did, so the policy's attempts are not used up, only its total time, unless it
   * allows one attempt only); `retry` counts every try, for the backoff. Undefined to give up.
   */
  retryWaitMs(
    policy: RetryPolicy,
    error: QuayutecError,
    attempt: number,
    started: number,
    retryable = RETRYABLE.has(error.code),
    retry = attempt,
  ): number | undefined {
    if (!retryable || attempt >= policy.maxAttempts || policy.maxAttempts === 1 || this.closing.signal.aborted) {
      return undefined;
    }
    const advised = error instanceof RateLimited ? error.retryAfterMs : undefined;
    if (advised !== undefined && advised > policy.maxAdvisedWaitMs) {
      return undefined;
    }
    const wait = waitBeforeMs(policy, Math.max(1, retry), advised, this.random);
    if (performance.now() - started + wait >= policy.totalTimeoutMs) {
      return undefined;
    }
    onRetry?.({ method: error.method, codeName: error.codeName, attempt: retry, sent: attempt > 0, waitMs: wait, advisedMs: advised });
    return wait;
  }
}

/** What the client reports before each retry (never the key): set with `onRetry(listener)`. */
export interface RetryNotice {
  method: string;
  codeName: string;
  attempt: number;
  /** False when the attempt found no connection (it was never sent). */
  sent: boolean;
  waitMs: number;
  advisedMs: number | undefined;
}
let onRetry: ((notice: RetryNotice) => void) | undefined;

/** Be told of each retry (for your logs or metrics); `undefined` stops it. */
export function setRetryListener(listener: ((notice: RetryNotice) => void) | undefined): void {
  onRetry = listener;
}

export { Code };
