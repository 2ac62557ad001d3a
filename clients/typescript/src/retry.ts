// When a call is sent again: one frozen policy, bounded in attempts and in total time, with
// exponential backoff and jitter, honouring the wait the Gateway advises.
import { Code } from "@connectrpc/connect";

/**
 * How one logical call is retried. `maxAttempts` counts the first one; `totalTimeoutMs` bounds every
 * attempt and wait of the call (and a watch's reconnects between two answers); `attemptTimeoutMs` is
 * each attempt's deadline. Retry n waits a random time between half and all of
 * `min(maxBackoffMs, initialBackoffMs * multiplier ** (n - 1))`, or the Gateway's advised wait
 * (`retry-after-ms`) plus up to a fifth of it when that is longer. An advised wait over
 * `maxAdvisedWaitMs`, or over the time left, is not waited for: the call fails with RateLimited.
 */
export interface RetryPolicy {
  readonly maxAttempts: number;
  readonly initialBackoffMs: number;
  readonly maxBackoffMs: number;
  readonly multiplier: number;
  readonly totalTimeoutMs: number;
  readonly attemptTimeoutMs: number;
  readonly maxAdvisedWaitMs: number;
}

export const DEFAULT_RETRY: RetryPolicy = Object.freeze({
  maxAttempts: 6,
  initialBackoffMs: 200,
  maxBackoffMs: 5000,
  multiplier: 2,
  totalTimeoutMs: 60_000,
  attemptTimeoutMs: 15_000,
  maxAdvisedWaitMs: 30_000,
});

/** No retry at all: each call is sent once. */
export const NO_RETRY: RetryPolicy = Object.freeze({ ...DEFAULT_RETRY, maxAttempts: 1 });

/** A complete, checked policy from the defaults and `overrides`. */
export function retryPolicy(overrides: Partial<RetryPolicy> = {}): RetryPolicy {
  const policy = { ...DEFAULT_RETRY, ...overrides };
  if (!Number.isInteger(policy.maxAttempts) || policy.maxAttempts < 1) {
    throw new RangeError("maxAttempts must be a whole number of at least 1 (1: no retry)");
  }
  for (const name of ["initialBackoffMs", "maxBackoffMs", "totalTimeoutMs", "attemptTimeoutMs", "maxAdvisedWaitMs"] as const) {
    if (!(policy[name] > 0)) {
      throw new RangeError(`${name} must be positive`);
    }
  }
  if (policy.multiplier < 1) {
    throw new RangeError("multiplier must be at least 1");
  }
  if (policy.initialBackoffMs > policy.maxBackoffMs) {
    throw new RangeError("initialBackoffMs must not exceed maxBackoffMs");
  }
  return Object.freeze(policy);
}

/** Milliseconds to wait before retry number `retry` (1 for the first retry). */
export function waitBeforeMs(policy: RetryPolicy, retry: number, advisedMs: number | undefined, random: () => number = Math.random): number {
  const ceiling = Math.min(policy.maxBackoffMs, policy.initialBackoffMs * policy.multiplier ** (retry - 1));
  let wait = ceiling / 2 + random() * (ceiling / 2);
  if (advisedMs !== undefined && advisedMs > wait) {
    wait = advisedMs * (1 + random() * 0.2);
  }
  return wait;
}

/** The codes after which sending the same call again can succeed. */
export const RETRYABLE: ReadonlySet<Code> = new Set([Code.Unavailable, Code.DeadlineExceeded, Code.ResourceExhausted]);
/** What a write without an idempotency key may retry: the Gateway answers RESOURCE_EXHAUSTED before it acts. */
export const REFUSED_BEFORE_ACTING: ReadonlySet<Code> = new Set([Code.ResourceExhausted]);
