// What the Gateway checks of a request that the client can check before sending it, refused with the
// Gateway's own messages (InvalidArgument, attempts 0): required ids and text, sizes, page sizes,
// idempotency keys, mentions, watch cursors; and the JavaScript types of every field, from the
// service's schema (a number where a string is expected is a TypeError, not a silent conversion).
import { ScalarType, type DescField, type DescMessage } from "@bufbuild/protobuf";
import { Code } from "@connectrpc/connect";
import { InvalidArgument } from "./errors.js";

// The Gateway's limits (services/gateway/servicer.py).
const MAX_NAME_BYTES = 200;
const MAX_BODY_BYTES = 64 * 1024;
const MAX_TITLE_BYTES = 500;
const MAX_FILE_NAME_BYTES = 255;
const MAX_QUERY_BYTES = 1000;
const MAX_IDEMPOTENCY_KEY_BYTES = 200;
const MAX_MENTIONS = 50;
const MAX_PAGE_SIZE = 500;

type Rule = readonly [field: string, snake: string, kind: "id" | "text" | "optional", limit: number];
const id = (field: string, snake: string): Rule => [field, snake, "id", 0];

/** Per RPC (its gRPC name), in the Gateway's order; the same table as the Python client's. */
const FIELDS: Readonly<Record<string, readonly Rule[]>> = {
  CreateRoom: [["name", "name", "text", MAX_NAME_BYTES]],
  RenameRoom: [["name", "name", "text", MAX_NAME_BYTES], id("roomId", "room_id")],
  ArchiveRoom: [id("roomId", "room_id")],
  RenameAgent: [id("agentId", "agent_id"), ["name", "name", "text", MAX_NAME_BYTES]],
  RetireAgent: [id("agentId", "agent_id")],
  InviteCompany: [id("companyId", "company_id"), id("roomId", "room_id")],
  AcceptInvitation: [id("invitationId", "invitation_id")],
  DeclineInvitation: [id("invitationId", "invitation_id")],
  LeaveRoom: [id("roomId", "room_id")],
  RemoveMember: [id("companyId", "company_id"), id("roomId", "room_id")],
  ListMembers: [id("roomId", "room_id")],
  RegisterAgent: [["name", "name", "text", MAX_NAME_BYTES], ["model", "model", "text", MAX_NAME_BYTES]],
  PostMessage: [["person", "person", "text", MAX_NAME_BYTES], ["body", "body", "text", MAX_BODY_BYTES], id("roomId", "room_id")],
  ListMessages: [id("roomId", "room_id")],
  GetMessage: [id("messageId", "message_id"), id("roomId", "room_id")],
  SendTask: [
    ["person", "person", "text", MAX_NAME_BYTES],
    id("toAgentId", "to_agent_id"),
    ["title", "title", "text", MAX_TITLE_BYTES],
    ["body", "body", "optional", MAX_BODY_BYTES],
    id("roomId", "room_id"),
  ],
  UpdateTask: [id("taskId", "task_id"), ["person", "person", "text", MAX_NAME_BYTES], ["note", "note", "optional", MAX_BODY_BYTES], id("roomId", "room_id")],
  ListTasks: [id("roomId", "room_id")],
  GetTask: [id("taskId", "task_id"), id("roomId", "room_id")],
  ListMemory: [["query", "query", "optional", MAX_QUERY_BYTES], id("roomId", "room_id")],
  UploadFile: [["person", "person", "text", MAX_NAME_BYTES], ["name", "name", "text", MAX_FILE_NAME_BYTES], id("roomId", "room_id")],
  ListFiles: [id("roomId", "room_id")],
  SearchPassages: [["query", "query", "text", MAX_QUERY_BYTES], id("roomId", "room_id")],
  GetRun: [id("runId", "run_id")],
  RevokeApiKey: [id("keyId", "key_id")],
  WatchRoom: [id("roomId", "room_id")],
};

const MAX_FILE_BYTES = 10 * 1024 * 1024;
const SESSION_TTL_SECONDS = [60, 7 * 86_400] as const;

/** The offset of the first byte of `data` that is not well-formed UTF-8 (as Python's decoder reports
 * it, which the Gateway's message names), or -1 when it all is. */
function firstInvalidUtf8(data: Uint8Array): number {
  try {
    new TextDecoder("utf-8", { fatal: true }).decode(data);
    return -1;
  } catch {
    for (let i = 0; i < data.length; ) {
      const b = data[i] as number;
      const need = b < 0x80 ? 0 : b >= 0xc2 && b <= 0xdf ? 1 : b >= 0xe0 && b <= 0xef ? 2 : b >= 0xf0 && b <= 0xf4 ? 3 : -1;
      if (need < 0) return i;
      for (let k = 1; k <= need; k++) {
        const c = data[i + k];
        const lo = k === 1 && b === 0xe0 ? 0xa0 : k === 1 && b === 0xf0 ? 0x90 : 0x80;
        const hi = k === 1 && b === 0xed ? 0x9f : k === 1 && b === 0xf4 ? 0x8f : 0xbf;
        if (c === undefined || c < lo || c > hi) return i;
      }
      i += need + 1;
    }
    return 0;
  }
}

/** Whether `value` is an id as the Gateway reads one: a uuid in its canonical text (any case). */
export function isUuid(value: string): boolean {
  return /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i.test(value);
}

export function invalid(method: string, message: string): InvalidArgument {
  return new InvalidArgument(Code.InvalidArgument, message, method, 0);
}

const bytes = (value: string) => Buffer.byteLength(value, "utf8");
const INT64 = new Set([ScalarType.INT64, ScalarType.UINT64, ScalarType.SINT64, ScalarType.FIXED64, ScalarType.SFIXED64]);

function describe(value: unknown): string {
  return value === null ? "null" : Array.isArray(value) ? "an array" : typeof value === "string" ? `the string ${JSON.stringify(value)}` : `${typeof value} ${String(value)}`;
}

function checkScalar(scalar: ScalarType, value: unknown, name: string): void {
  const wrong = (what: string) => new TypeError(`${name} must be ${what}, not ${describe(value)}`);
  if (scalar === ScalarType.STRING) {
    if (typeof value !== "string") throw wrong("a string");
  } else if (scalar === ScalarType.BOOL) {
    if (typeof value !== "boolean") throw wrong("a boolean");
  } else if (scalar === ScalarType.BYTES) {
    if (!(value instanceof Uint8Array)) throw wrong("a Uint8Array");
  } else if (INT64.has(scalar)) {
    if (typeof value !== "bigint" && !Number.isSafeInteger(value)) throw wrong("a whole number (bigint or number)");
  } else if (scalar === ScalarType.DOUBLE || scalar === ScalarType.FLOAT) {
    if (typeof value !== "number") throw wrong("a number");
  } else if (!Number.isInteger(value)) {
    throw wrong("a whole number");
  }
}

/** TypeError when a field of `request` is not of its schema's JavaScript type. */
export function checkTypes(schema: DescMessage, request: Record<string, unknown>): void {
  for (const field of schema.fields as readonly DescField[]) {
    const value = request[field.localName];
    if (value === undefined) {
      continue;
    }
    const name = field.localName;
    switch (field.fieldKind) {
      case "scalar":
        checkScalar(field.scalar, value, name);
        break;
      case "enum":
        if (!Number.isInteger(value)) {
          throw new TypeError(`${name} must be one of ${field.enum.typeName}'s values (a number), not ${describe(value)}`);
        }
        break;
      case "list":
        if (!Array.isArray(value)) {
          throw new TypeError(`${name} must be an array, not ${describe(value)}`);
        }
        if (field.listKind === "scalar") {
          value.forEach((item: unknown, i: number) => checkScalar(field.scalar, item, `${name}[${i}]`));
        }
        break;
      case "message":
        if (typeof value !== "object" || value === null) {
          throw new TypeError(`${name} must be an object, not ${describe(value)}`);
        }
        break;
      default:
        break;
    }
  }
}

/** InvalidArgument (never sent) when `request` breaks a rule the Gateway would refuse it for. */
export function checkRequest(method: string, schema: DescMessage, request: Record<string, unknown>): void {
  checkTypes(schema, request);
  for (const [field, snake, kind, limit] of FIELDS[method] ?? []) {
    const value = (request[field] as string | undefined) ?? "";
    if ((kind === "id" && !value) || (kind === "text" && !value.trim())) {
      throw invalid(method, `${snake} is required`);
    }
    if (kind !== "id" && bytes(value) > limit) {
      throw invalid(method, `${snake} must be at most ${limit} bytes${method === "PostMessage" && field === "body" ? " (64 KiB)" : ""}`);
    }
  }
  if (method === "CreateSessionKey") {
    const [low, high] = SESSION_TTL_SECONDS;
    const ttl = BigInt(request.ttlSeconds as bigint | number);
    if (ttl < BigInt(low) || ttl > BigInt(high)) {
      throw invalid(method, `ttl_seconds must be between ${low} and ${high} (7 days), got ${ttl}`);
    }
  } else if (method === "UploadFile") {
    const content = request.content as Uint8Array;
    if (content.length > MAX_FILE_BYTES) {
      throw invalid(method, `content must be at most ${MAX_FILE_BYTES} bytes (10 MiB), got ${content.length}`);
    }
    const bad = firstInvalidUtf8(content);
    if (bad >= 0) {
      throw invalid(method, `content must be UTF-8 text (invalid byte at offset ${bad})`);
    }
  }
  const pageSize = request.pageSize as number | undefined;
  if (pageSize !== undefined && pageSize !== 0 && !(pageSize >= 1 && pageSize <= MAX_PAGE_SIZE)) {
    throw invalid(method, `page_size must be between 1 and ${MAX_PAGE_SIZE} (0 for the default 50), got ${pageSize}`);
  }
  const key = request.idempotencyKey as string | undefined;
  if (key !== undefined && bytes(key) > MAX_IDEMPOTENCY_KEY_BYTES) {
    throw invalid(method, `idempotency_key must be at most ${MAX_IDEMPOTENCY_KEY_BYTES} bytes`);
  }
  const mentions = request.mentionAgentIds as string[] | undefined;
  if (mentions !== undefined) {
    if (mentions.length > MAX_MENTIONS) {
      throw invalid(method, `mention_agent_ids may name at most ${MAX_MENTIONS} agents`);
    }
    if (mentions.some((m) => !m)) {
      throw invalid(method, "mention_agent_ids is required");
    }
  }
}
