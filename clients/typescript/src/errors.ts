// Errors of Gateway calls: one class per status code the Gateway answers, each keeping the gRPC code
// and the Gateway's message (which says what to fix).
import { Code, ConnectError } from "@connectrpc/connect";

/** The trailing metadata in which the Gateway advises how long to wait before trying again. */
export const RETRY_AFTER_MS = "retry-after-ms";
/** The trailing metadata of an OUT_OF_RANGE cursor: its room, and that room's newest cursor. */
export const ROOM_ID = "quayutec-room-id";
export const NEWEST_CURSOR = "quayutec-newest-cursor";

/** gRPC's name of a status code: NOT_FOUND, RESOURCE_EXHAUSTED, ... */
export function codeName(code: Code): string {
  return (Code[code] ?? "UNKNOWN").replace(/([a-z])([A-Z])/g, "$1_$2").toUpperCase().replace("CANCELED", "CANCELLED");
}

/**
 * A Gateway call that failed: `code` is the gRPC status code (Connect's `Code`, the same numbers),
 * `codeName` its gRPC name, `rawMessage` the Gateway's text, `method` the RPC, `attempts` how many
 * times it was sent (retries included).
 */
export class QuayutecError extends Error {
  override name = "QuayutecError";
  readonly codeName: string;
  /** The id the client sent as `x-request-id` on every attempt of the call (or every stream of the
   * watch), and the trace id of the `traceparent` it sent ("" when none): quote them when you ask
   * about a call. */
  requestId = "";
  traceId = "";
  constructor(
    readonly code: Code,
    readonly rawMessage: string,
    readonly method: string,
    readonly attempts: number,
    options?: { cause?: unknown },
  ) {
    super(`${method ? `${method}: ` : ""}${codeName(code)}: ${rawMessage}`, options);
    this.codeName = codeName(code);
  }
}

/** A field is missing, malformed or too large: fix the request (the message names the field). */
export class InvalidArgument extends QuayutecError {
  override name = "InvalidArgument";
}
/** It does not exist, or your company may not see it (a room you are not a member of). */
export class NotFound extends QuayutecError {
  override name = "NotFound";
}
/** The state you asked for is already there (e.g. the company is already invited). */
export class AlreadyExists extends QuayutecError {
  override name = "AlreadyExists";
}
/** You can see it but may not do this. */
export class PermissionDenied extends QuayutecError {
  override name = "PermissionDenied";
}
/** The state does not allow it (a closed task, a declined invitation); read it again. */
export class FailedPrecondition extends QuayutecError {
  override name = "FailedPrecondition";
}
/** No key, or a malformed, unknown or revoked one. */
export class Unauthenticated extends QuayutecError {
  override name = "Unauthenticated";
}
/** RESOURCE_EXHAUSTED: a limit of your company was reached; `retryAfterMs` is the wait the Gateway advised. */
export class RateLimited extends QuayutecError {
  override name = "RateLimited";
  constructor(
    code: Code,
    rawMessage: string,
    method: string,
    attempts: number,
    readonly retryAfterMs: number | undefined,
    options?: { cause?: unknown },
  ) {
    super(code, rawMessage, method, attempts, options);
  }
}
/**
 * OUT_OF_RANGE: a watch's cursor is older than the events kept (reload with the lists and watch from
 * now), or past the room's newest event (resume after a cursor you received). `roomId` is the room it
 * is of and `newestCursor` that room's newest cursor (past the end), when the Gateway says (its
 * `quayutec-room-id` and `quayutec-newest-cursor` trailers).
 */
export class CursorOutOfRange extends QuayutecError {
  override name = "CursorOutOfRange";
  constructor(
    code: Code,
    rawMessage: string,
    method: string,
    attempts: number,
    readonly roomId: string | undefined,
    readonly newestCursor: bigint | undefined,
    options?: { cause?: unknown },
  ) {
    super(code, rawMessage, method, attempts, options);
  }
}
/** The name of CursorOutOfRange in the first releases of this client. */
export const CursorExpired = CursorOutOfRange;
export type CursorExpired = CursorOutOfRange;
/** A concurrent change rolled the call back; nothing was written. */
export class Aborted extends QuayutecError {
  override name = "Aborted";
}
/** The Gateway, or a service behind it, could not be reached (after the retries the policy allows). */
export class Unavailable extends QuayutecError {
  override name = "Unavailable";
}
/** No answer in time (after the retries the policy allows). */
export class DeadlineExceeded extends QuayutecError {
  override name = "DeadlineExceeded";
}
/** The call was cancelled (its `signal` aborted). */
export class Cancelled extends QuayutecError {
  override name = "Cancelled";
}
/** The client was closed (`client.close()`) while the call or watch was under way, or before it began. */
export class Closed extends Cancelled {
  override name = "Closed";
}
/**
 * The Gateway was reached but no gRPC connection could be made with it, so retrying cannot help: a TLS
 * handshake that failed (TLS to a plaintext port, an untrusted certificate, a certificate that does not
 * name the address), or a Gateway that drops every connection before answering (often plaintext to a
 * TLS port). The message says which and what to check.
 */
export class ConnectionFailed extends Unavailable {
  override name = "ConnectionFailed";
}
/** The Gateway failed; the message says no more, by design. */
export class Internal extends QuayutecError {
  override name = "Internal";
}
/** The Gateway does not serve this RPC (it is older than this client). */
export class Unimplemented extends QuayutecError {
  override name = "Unimplemented";
}

type ErrorClass = new (code: Code, rawMessage: string, method: string, attempts: number, options?: { cause?: unknown }) => QuayutecError;

const BY_CODE = new Map<Code, ErrorClass>([
  [Code.InvalidArgument, InvalidArgument],
  [Code.NotFound, NotFound],
  [Code.AlreadyExists, AlreadyExists],
  [Code.PermissionDenied, PermissionDenied],
  [Code.FailedPrecondition, FailedPrecondition],
  [Code.Unauthenticated, Unauthenticated],
  [Code.Aborted, Aborted],
  [Code.Unavailable, Unavailable],
  [Code.DeadlineExceeded, DeadlineExceeded],
  [Code.Canceled, Cancelled],
  [Code.Internal, Internal],
  [Code.Unimplemented, Unimplemented],
]);

function wholeNumber(metadata: Headers, name: string): string | undefined {
  const value = metadata.get(name)?.trim();
  return value && /^\d+$/.test(value) ? value : undefined;
}

/** The wait, in milliseconds, of a `retry-after-ms` trailer; undefined when there is none. */
export function advisedWaitMs(metadata: Headers): number | undefined {
  const value = wholeNumber(metadata, RETRY_AFTER_MS);
  return value === undefined ? undefined : Number(value);
}

/** The typed error of a failed call (anything thrown by the transport). */
export function errorFor(reason: unknown, method: string, attempts: number): QuayutecError {
  if (reason instanceof QuayutecError) {
    return reason;
  }
  const err = ConnectError.from(reason);
  if (err.code === Code.ResourceExhausted) {
    return new RateLimited(err.code, err.rawMessage, method, attempts, advisedWaitMs(err.metadata), { cause: err });
  }
  if (err.code === Code.OutOfRange) {
    const newest = wholeNumber(err.metadata, NEWEST_CURSOR);
    const roomId = err.metadata.get(ROOM_ID)?.trim() || undefined;
    return new CursorOutOfRange(err.code, err.rawMessage, method, attempts, roomId, newest === undefined ? undefined : BigInt(newest), { cause: err });
  }
  const cls = BY_CODE.get(err.code) ?? QuayutecError;
  return new cls(err.code, err.rawMessage, method, attempts, { cause: err });
}
