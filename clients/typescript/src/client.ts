// The client: `connect({ address, apiKey })` and one method per Gateway RPC.
//
// Adding an RPC: `npm run generate`, a line in transport.ts's SAFETY and in WRAPS below (the compiler
// asks for both), and a method here that builds the request and calls `this.unary` (or `this.paged`
// for a list). The tests fail while a method is missing.
import { randomUUID } from "node:crypto";
import { inspect } from "node:util";
import {
  ActionRight,
  InvitationStatus,
  Provider,
  RunStatus,
  TaskStatus,
  WaitpointStatus,
  type Agent,
  type AgentRights,
  type Company,
  type File,
  type Invitation,
  type MemoryLine,
  type Message,
  type Passage,
  type Room,
  type RoomMember,
  type Run,
  type Task,
  type Waitpoint,
} from "./gen/quayutec/v1/common_pb.js";
import { timestampFromDate } from "@bufbuild/protobuf/wkt";
import type {
  AcceptInvitationResponse,
  ApiKey,
  CreateApiKeyResponse,
  CreateSessionKeyResponse,
  DecideApprovalResponse,
  GetAgentRightsResponse,
  PostMessageResponse,
  SendTaskResponse,
  SignInProvider,
} from "./gen/quayutec/v1/gateway_pb.js";
import { checkRequest, invalid, isUuid } from "./checks.js";
import { Unauthenticated } from "./errors.js";
import { retryPolicy, type RetryPolicy } from "./retry.js";
import { Transport, type PerCall, type RequestOf, type ResponseOf, type RpcKey, type TlsOptions, type UnaryKey } from "./transport.js";
import { RoomsWatch, RoomWatch, type RoomCursors } from "./watch.js";
import { WatchRoomRequestSchema } from "./gen/quayutec/v1/gateway_pb.js";

/** An enum value, or its short name in lower case ("anthropic" for Provider.ANTHROPIC). */
export type EnumInput<E extends Record<string, string | number>> = E[keyof E] | Lowercase<Extract<keyof E, string>>;

function enumValue<E extends Record<string, string | number>>(e: E, value: EnumInput<E> | undefined): number {
  if (value === undefined) {
    return 0;
  }
  if (typeof value === "number") {
    return value;
  }
  const found = e[String(value).toUpperCase() as keyof E];
  if (typeof found !== "number") {
    const names = Object.keys(e).filter((k) => Number.isNaN(Number(k)) && k !== "UNSPECIFIED").map((k) => k.toLowerCase());
    throw new RangeError(`${JSON.stringify(value)} is not one of ${names.join(", ")}`);
  }
  return found;
}

/** A fresh key for one logical write (sent unchanged on each of its retries). */
export function newIdempotencyKey(): string {
  return randomUUID();
}

export interface ConnectOptions {
  /** The Gateway, "host:port" (default: the QUAYUTEC_GATEWAY environment variable, else QUAYUTEC_GATEWAY_ADDR). */
  address?: string;
  /** Your company's API key, qyk_... (default: the QUAYUTEC_API_KEY environment variable). */
  apiKey?: string;
  /** TLS is on by default, with Node's roots; name others here. */
  tls?: TlsOptions;
  /** Turn TLS off (a Gateway on your own machine). */
  plaintext?: boolean;
  /** How calls are retried (the defaults of DEFAULT_RETRY for what is not given). */
  retry?: Partial<RetryPolicy>;
}

/** Where connect() looks when it is not given the address or the key. */
export const GATEWAY_ENV = "QUAYUTEC_GATEWAY";
export const API_KEY_ENV = "QUAYUTEC_API_KEY";

/** `address` when it is "host:port" (or "[::1]:port"); else a TypeError saying what is wrong. */
export function checkAddress(address: unknown): string {
  if (typeof address !== "string") {
    throw new TypeError(`address must be a string (host:port), not ${typeof address}`);
  }
  const trimmed = address.trim();
  if (!trimmed) {
    throw new TypeError(`address is empty: pass the Gateway as "host:port" (or set ${GATEWAY_ENV})`);
  }
  const url = /^(https?|grpcs?):\/\/(.*?)\/*$/.exec(trimmed);
  if (url) {
    const hint = url[1] === "http" || url[1] === "grpc" ? "and plaintext: true " : "";
    throw new TypeError(`address ${JSON.stringify(trimmed)} is a URL: pass "host:port" (${JSON.stringify(url[2])}) ${hint}instead`);
  }
  const port = /^(.+):(\d+)$/.exec(trimmed);
  if (!port || !(Number(port[2]) > 0 && Number(port[2]) < 65536)) {
    throw new TypeError(`address ${JSON.stringify(trimmed)} is not "host:port" with a port from 1 to 65535`);
  }
  return trimmed;
}

/** A client of the Gateway at `address`, calling as the company of `apiKey`. Close it with `close()`. */
export function connect(options: ConnectOptions = {}): Client {
  if (options.plaintext && options.tls) {
    throw new TypeError("plaintext: true and tls options contradict each other: choose one");
  }
  // QUAYUTEC_GATEWAY_ADDR is what `quayutec up` exports for the CLI.
  const address = checkAddress(options.address ?? (process.env[GATEWAY_ENV] || process.env.QUAYUTEC_GATEWAY_ADDR || ""));
  const apiKey = options.apiKey ?? process.env[API_KEY_ENV];
  if (apiKey === undefined || apiKey === "") {
    throw new TypeError(`no apiKey given and ${API_KEY_ENV} is not set`);
  }
  const transport = new Transport(address, apiKey, options.plaintext ?? false, options.tls ?? {});
  return new Client(transport, retryPolicy(options.retry));
}

/**
 * The Gateway API as the calling company sees it. Every method retries as its policy allows and
 * throws a QuayutecError subclass when it fails.
 */
export class Client {
  constructor(
    private readonly transport: Transport,
    readonly retryPolicy: RetryPolicy,
  ) {}

  /** The same client (one connection) with another retry policy. */
  withRetry(policy: Partial<RetryPolicy>): Client {
    return new Client(this.transport, retryPolicy({ ...this.retryPolicy, ...policy }));
  }

  /** Close the connection (of this client and those made from it with withRetry): every call and
   * watch under way, or waiting to retry, rejects with Closed, and so does any later one. */
  close(): void {
    this.transport.close();
  }

  [inspect.custom](): string {
    return `Client { address: ${JSON.stringify(this.transport.address)} }`;
  }

  toJSON(): object {
    return { address: this.transport.address, retryPolicy: this.retryPolicy };
  }

  private unary<K extends UnaryKey>(call: PerCall, key: K, request: RequestOf<K>): Promise<ResponseOf<K>> {
    return this.transport.unary(key, request, this.retryPolicy, call);
  }

  /** Every item of every page, each page fetched (and retried, within `call.timeoutMs` each) when the
   * previous one is used up. */
  private async *paged<K extends UnaryKey, T>(
    call: PerCall,
    key: K,
    request: RequestOf<K>,
    items: (page: ResponseOf<K>) => T[],
  ): AsyncGenerator<T, void, undefined> {
    for (;;) {
      const page = await this.unary(call, key, request);
      yield* items(page);
      const token = (page as { nextPageToken?: string }).nextPageToken;
      if (!token) {
        return;
      }
      request = { ...request, pageToken: token };
    }
  }

  // Identity and rooms.

  /** The company the API key names. */
  async whoAmI(call: PerCall = {}): Promise<Company> {
    return required((await this.unary(call, "whoAmI", {})).company);
  }

  /** A new room; your company is its first member. Safe to retry, as postMessage: a repeat of
   * `idempotencyKey` (a fresh one when not given) answers the first room. */
  async createRoom(name: string, options: { idempotencyKey?: string } = {}, call: PerCall = {}): Promise<Room> {
    const request = { name, idempotencyKey: options.idempotencyKey ?? newIdempotencyKey() };
    return required((await this.unary(call, "createRoom", request)).room);
  }

  /** Rename a room your company created (its creator only). Names are unique among the rooms a
   * company creates, trimmed and case ignored: a taken one rejects with AlreadyExists naming the room
   * that has it. Safe to retry: renaming again to the same name changes nothing. */
  async renameRoom(roomId: string, name: string, call: PerCall = {}): Promise<Room> {
    return required((await this.unary(call, "renameRoom", { roomId, name })).room);
  }

  /** Archive a room your company created: read-only from then on (writes reject with
   * FailedPrecondition saying it is archived), its history readable; `archivedAt` is set. Safe to
   * retry: archiving again changes nothing. */
  async archiveRoom(roomId: string, call: PerCall = {}): Promise<Room> {
    return required((await this.unary(call, "archiveRoom", { roomId })).room);
  }

  /** The rooms your company is a member of. */
  rooms(options: { pageSize?: number; pageToken?: string } = {}, call: PerCall = {}): AsyncGenerator<Room, void, undefined> {
    return this.paged(call, "listRooms", { ...options }, (p) => p.rooms);
  }

  /** The member companies of a room. */
  members(roomId: string, options: { pageSize?: number; pageToken?: string } = {}, call: PerCall = {}): AsyncGenerator<RoomMember, void, undefined> {
    return this.paged(call, "listMembers", { roomId, ...options }, (p) => p.members);
  }

  // Invitations and membership.

  /** Invite a company into a room; it becomes a member when it accepts. Safe to retry, as
   * postMessage: a repeat of `idempotencyKey` answers the first invitation. */
  async inviteCompany(
    roomId: string,
    companyId: string,
    options: { idempotencyKey?: string } = {},
    call: PerCall = {},
  ): Promise<Invitation> {
    const request = { roomId, companyId, idempotencyKey: options.idempotencyKey ?? newIdempotencyKey() };
    return required((await this.unary(call, "inviteCompany", request)).invitation);
  }

  /** Invitations to your company, oldest first: pending ones unless `status` says otherwise. */
  invitations(
    options: { status?: EnumInput<typeof InvitationStatus>; sent?: boolean; pageSize?: number; pageToken?: string } = {},
    call: PerCall = {},
  ): AsyncGenerator<Invitation, void, undefined> {
    const request = { status: enumValue(InvitationStatus, options.status), sent: options.sent, pageSize: options.pageSize, pageToken: options.pageToken };
    return this.paged(call, "listInvitations", request, (p) => p.invitations);
  }

  /** Become a member of the invitation's room (accepting again answers the same). */
  async acceptInvitation(invitationId: string, call: PerCall = {}): Promise<AcceptInvitationResponse> {
    return this.unary(call, "acceptInvitation", { invitationId });
  }

  /** Refuse an invitation (declining again changes nothing). */
  async declineInvitation(invitationId: string, call: PerCall = {}): Promise<Invitation> {
    return required((await this.unary(call, "declineInvitation", { invitationId })).invitation);
  }

  /** Every invitation into a room your company created, oldest first: pending ones unless `status` says otherwise. */
  roomInvitations(
    roomId: string,
    options: { status?: EnumInput<typeof InvitationStatus>; pageSize?: number; pageToken?: string } = {},
    call: PerCall = {},
  ): AsyncGenerator<Invitation, void, undefined> {
    return this.paged(call, "listRoomInvitations", { roomId, status: enumValue(InvitationStatus, options.status), pageSize: options.pageSize, pageToken: options.pageToken }, (p) => p.invitations);
  }

  /** Withdraw a pending invitation (the room's creator, or its sender); withdrawing again changes nothing. */
  async withdrawInvitation(invitationId: string, call: PerCall = {}): Promise<Invitation> {
    return required((await this.unary(call, "withdrawInvitation", { invitationId })).invitation);
  }

  /** End your company's membership at once. */
  async leaveRoom(roomId: string, call: PerCall = {}): Promise<void> {
    await this.unary(call, "leaveRoom", { roomId });
  }

  /** End another company's membership (the room's creator only). */
  async removeMember(roomId: string, companyId: string, call: PerCall = {}): Promise<void> {
    await this.unary(call, "removeMember", { roomId, companyId });
  }

  // Agents.

  /** An always-on agent of your company; the provider key is stored encrypted, never returned. Safe
   * to retry, as postMessage: a repeat of `idempotencyKey` answers the first agent. */
  async registerAgent(agent: {
    name: string;
    provider: EnumInput<typeof Provider>;
    model: string;
    providerKey?: string;
    baseUrl?: string;
    systemPrompt?: string;
    idempotencyKey?: string;
  }, call: PerCall = {}): Promise<Agent> {
    const request = {
      ...agent,
      provider: enumValue(Provider, agent.provider),
      idempotencyKey: agent.idempotencyKey ?? newIdempotencyKey(),
    };
    return required((await this.unary(call, "registerAgent", request)).agent);
  }

  /** Rename one of your company's agents. Names are unique within a company, trimmed and case
   * ignored (retired agents' too): a taken one rejects with AlreadyExists naming the agent that has
   * it. Safe to retry: renaming again to the same name changes nothing. */
  async renameAgent(agentId: string, name: string, call: PerCall = {}): Promise<Agent> {
    return required((await this.unary(call, "renameAgent", { agentId, name })).agent);
  }

  /** Retire one of your company's agents: it wakes no more (a mention of it makes no wake); its runs
   * and messages stay, and `retiredAt` is set. Safe to retry: retiring again changes nothing. */
  async retireAgent(agentId: string, call: PerCall = {}): Promise<Agent> {
    return required((await this.unary(call, "retireAgent", { agentId })).agent);
  }

  /** Your company's agents. */
  agents(options: { roomId?: string; pageSize?: number; pageToken?: string } = {}, call: PerCall = {}): AsyncGenerator<Agent, void, undefined> {
    return this.paged(call, "listAgents", { ...options }, (p) => p.agents);
  }

  // Messages and tasks.

  /**
   * Post as `person` of your company, waking each agent in `mentions` (agent ids) once. Safe to
   * retry: the call carries `idempotencyKey` (a fresh one when not given), the same on every retry,
   * so it posts once. Pass your own to make retries of your own (after a crash) safe too.
   */
  async postMessage(
    roomId: string,
    body: string,
    options: { person?: string; mentions?: string[]; idempotencyKey?: string } = {},
    call: PerCall = {},
  ): Promise<PostMessageResponse> {
    if (options === null || typeof options !== "object") {
      throw new TypeError(`postMessage's options must be an object such as { person: "ana" }, not ${typeof options}`);
    }
    if (options.mentions !== undefined && !Array.isArray(options.mentions)) {
      throw new TypeError(`mentions must be an array of agent ids, not ${typeof options.mentions}`);
    }
    return this.unary(call, "postMessage", {
      roomId,
      body,
      person: options.person ?? "",
      mentionAgentIds: options.mentions ?? [],
      idempotencyKey: options.idempotencyKey ?? newIdempotencyKey(),
    });
  }

  /** A room's messages, oldest first unless `newestFirst`. */
  messages(roomId: string, options: { newestFirst?: boolean; pageSize?: number; pageToken?: string } = {}, call: PerCall = {}): AsyncGenerator<Message, void, undefined> {
    return this.paged(call, "listMessages", { roomId, ...options }, (p) => p.messages);
  }

  /** Send a task from `person` to an agent in the room, waking it once (safe to retry, as postMessage). */
  async sendTask(
    roomId: string,
    task: { toAgentId: string; title: string; person: string; body?: string; idempotencyKey?: string },
    call: PerCall = {},
  ): Promise<SendTaskResponse> {
    return this.unary(call, "sendTask", { roomId, ...task, idempotencyKey: task.idempotencyKey ?? newIdempotencyKey() });
  }

  /** Add a note to a task; `status` "done" or "cancelled" closes it (safe to retry). */
  async updateTask(
    roomId: string,
    taskId: string,
    update: { person: string; note?: string; status?: EnumInput<typeof TaskStatus>; idempotencyKey?: string },
    call: PerCall = {},
  ): Promise<Task> {
    const request = {
      roomId,
      taskId,
      person: update.person,
      note: update.note ?? "",
      status: enumValue(TaskStatus, update.status),
      idempotencyKey: update.idempotencyKey ?? newIdempotencyKey(),
    };
    return required((await this.unary(call, "updateTask", request)).task);
  }

  /** A room's tasks, optionally those of one agent or in one status. */
  tasks(
    roomId: string,
    options: { toAgentId?: string; status?: EnumInput<typeof TaskStatus>; pageSize?: number; pageToken?: string } = {},
    call: PerCall = {},
  ): AsyncGenerator<Task, void, undefined> {
    return this.paged(call, "listTasks", { roomId, toAgentId: options.toAgentId, status: enumValue(TaskStatus, options.status), pageSize: options.pageSize, pageToken: options.pageToken }, (p) => p.tasks);
  }

  /** One task with its updates. */
  async getTask(roomId: string, taskId: string, call: PerCall = {}): Promise<Task> {
    return required((await this.unary(call, "getTask", { roomId, taskId })).task);
  }

  // Memory and files.

  /** Memory lines your company may read (room-wide and its own), optionally searched. */
  memory(roomId: string, options: { query?: string; pageSize?: number; pageToken?: string } = {}, call: PerCall = {}): AsyncGenerator<MemoryLine, void, undefined> {
    return this.paged(call, "listMemory", { roomId, ...options }, (p) => p.lines);
  }

  /** Upload UTF-8 text (at most 10 MiB) into a room, searchable by passage. */
  async uploadFile(
    roomId: string,
    name: string,
    content: string | Uint8Array,
    options: { person: string; contentType?: string },
    call: PerCall = {},
  ): Promise<File> {
    const bytes = typeof content === "string" ? new TextEncoder().encode(content) : content;
    const request = { roomId, name, content: bytes, person: options.person, contentType: options.contentType ?? "text/plain" };
    return required((await this.unary(call, "uploadFile", request)).file);
  }

  /** A room's files (without their content). */
  files(roomId: string, options: { pageSize?: number; pageToken?: string } = {}, call: PerCall = {}): AsyncGenerator<File, void, undefined> {
    return this.paged(call, "listFiles", { roomId, ...options }, (p) => p.files);
  }

  /** The passages of a room's files that best match `query`. */
  async searchPassages(roomId: string, query: string, options: { limit?: number } = {}, call: PerCall = {}): Promise<Passage[]> {
    return (await this.unary(call, "searchPassages", { roomId, query, ...options })).passages;
  }

  // Runs, rights and approvals.

  /** Your agents' runs (or one agent's), newest first; optionally in one room, with one status, or
   * started at or after `startedAfter` and before `startedBefore`. */
  runs(
    options: {
      agentId?: string;
      roomId?: string;
      status?: EnumInput<typeof RunStatus>;
      startedAfter?: Date | string;
      startedBefore?: Date | string;
      pageSize?: number;
      pageToken?: string;
    } = {},
    call: PerCall = {},
  ): AsyncGenerator<Run, void, undefined> {
    const { startedAfter, startedBefore, status, ...rest } = options;
    return this.paged(
      call,
      "listRuns",
      {
        ...rest,
        status: enumValue(RunStatus, status),
        startedAfter: startedAfter === undefined ? undefined : timestampFromDate(moment(startedAfter, "startedAfter")),
        startedBefore: startedBefore === undefined ? undefined : timestampFromDate(moment(startedBefore, "startedBefore")),
      },
      (p) => p.runs,
    );
  }

  /** One message of a room (an agent's reply carries the `runId` of the run that posted it). */
  async getMessage(roomId: string, messageId: string, call: PerCall = {}): Promise<Message> {
    return required((await this.unary(call, "getMessage", { roomId, messageId })).message);
  }

  // Your company's API keys.

  /** A new API key of your company (call with a company key: a session key may not). Its `secret`
   * is in this answer (and a repeat's) only; keep it. Safe to retry, as postMessage: a repeat of
   * `idempotencyKey` answers the first key and its secret. */
  async createApiKey(options: { label?: string; idempotencyKey?: string } = {}, call: PerCall = {}): Promise<CreateApiKeyResponse> {
    const request = { label: options.label ?? "", idempotencyKey: options.idempotencyKey ?? newIdempotencyKey() };
    return this.unary(call, "createApiKey", request);
  }

  /** Your company's keys, oldest first (never a secret); its session keys too when asked. */
  apiKeys(options: { includeSessions?: boolean; pageSize?: number; pageToken?: string } = {}, call: PerCall = {}): AsyncGenerator<ApiKey, void, undefined> {
    return this.paged(call, "listApiKeys", { ...options }, (p) => p.keys);
  }

  /** Revoke one of your company's keys at once (its session keys with it). */
  async revokeApiKey(keyId: string, call: PerCall = {}): Promise<ApiKey> {
    return required((await this.unary(call, "revokeApiKey", { keyId })).key);
  }

  /** Register (or replace) the OpenID Connect provider your people sign in to the console with (call
   * with a company key); the secret is stored encrypted and never returned. */
  async setSignInProvider(options: {
    issuer: string;
    clientId: string;
    clientSecret: string;
    emailDomains?: string[];
    allowApiKeySignIn?: boolean;
  }, call: PerCall = {}): Promise<SignInProvider> {
    return required((await this.unary(call, "setSignInProvider", { ...options })).provider);
  }

  /** Your company's sign-in provider (never its secret), or undefined when none is set. */
  async signInProvider(call: PerCall = {}): Promise<SignInProvider | undefined> {
    const got = await this.unary(call, "getSignInProvider", {});
    return got.found ? got.provider : undefined;
  }

  /** Remove your company's sign-in provider (its sign-ins end); false when none was set. */
  async removeSignInProvider(call: PerCall = {}): Promise<boolean> {
    return (await this.unary(call, "removeSignInProvider", {})).removed;
  }

  /** One run's ledger row: what it posted and wrote, each model request, its trace id. */
  async getRun(runId: string, call: PerCall = {}): Promise<Run> {
    return required((await this.unary(call, "getRun", { runId })).run);
  }

  /**
   * Set "auto", "hold" or "deny" per action for one agent, or for all (`agentId` empty). Only the
   * rights you name change; the others keep what is stored ("unspecified" clears one, so it is
   * inherited again). `replace: true` replaces every right, those not named cleared.
   */
  async setAgentRights(
    rights: {
      agentId?: string;
      remember?: EnumInput<typeof ActionRight>;
      createTask?: EnumInput<typeof ActionRight>;
      updateTask?: EnumInput<typeof ActionRight>;
      closeTask?: EnumInput<typeof ActionRight>;
      crossCompanyTask?: EnumInput<typeof ActionRight>;
      replace?: boolean;
    },
    call: PerCall = {},
  ): Promise<AgentRights> {
    const fields = { remember: "remember", createTask: "create_task", updateTask: "update_task", closeTask: "close_task", crossCompanyTask: "cross_company_task" } as const;
    const given = (Object.keys(fields) as (keyof typeof fields)[]).filter((k) => rights[k] !== undefined);
    if (!rights.replace && given.length === 0) {
      throw new RangeError("name at least one right to set (or replace: true to clear them all)");
    }
    const request = {
      agentId: rights.agentId ?? "",
      ...Object.fromEntries(given.map((k) => [k, enumValue(ActionRight, rights[k])])),
      updateMask: rights.replace ? undefined : { paths: given.map((k) => fields[k]) },
    };
    return required((await this.unary(call, "setAgentRights", request)).rights);
  }

  /** Stored and effective rights of your default (`agentId` empty) or of one agent. */
  async getAgentRights(agentId = "", call: PerCall = {}): Promise<GetAgentRightsResponse> {
    return this.unary(call, "getAgentRights", { agentId });
  }

  /** Your parked runs whose held actions await your decision (pending unless `status`). */
  approvals(options: { status?: EnumInput<typeof WaitpointStatus>; pageSize?: number; pageToken?: string } = {}, call: PerCall = {}): AsyncGenerator<Waitpoint, void, undefined> {
    return this.paged(call, "listApprovals", { status: enumValue(WaitpointStatus, options.status), pageSize: options.pageSize, pageToken: options.pageToken }, (p) => p.waitpoints);
  }

  /** Approve or deny one held action; the decision that completes a waitpoint continues its run once. */
  async decideApproval(token: string, index: number, decision: { person: string; approve: boolean }, call: PerCall = {}): Promise<DecideApprovalResponse> {
    return this.unary(call, "decideApproval", { token, index, ...decision });
  }

  // Following a room.

  /**
   * A room's events, replayed after `after` (a cursor you kept; 0: from the oldest kept) and then
   * live; without `after`, from now. See RoomWatch.
   */
  watch(roomId: string, options: { after?: bigint | number | string; idleTimeoutMs?: number } = {}): RoomWatch {
    checkRequest("WatchRoom", WatchRoomRequestSchema, { roomId });
    if (options.after !== undefined && cursorOf(options.after, "after") < 0n) {
      throw invalid("WatchRoom", `after must be a cursor (0 or more) or unset (from now), got ${options.after}`);
    }
    return new RoomWatch(this.transport, this.retryPolicy, roomId, options.after, options.idleTimeoutMs ?? 60_000);
  }

  /**
   * Every room of your company in one stream: the rooms `after` names (room id -> a cursor you kept)
   * resumed after their cursors and the others from their joining; without `after`, from now.
   * `watch.cursors` is the map to keep. See RoomsWatch.
   */
  watchRooms(options: { after?: RoomCursors; idleTimeoutMs?: number } = {}): RoomsWatch {
    const after = options.after;
    if (after !== undefined) {
      if (typeof after !== "object" || after === null || Array.isArray(after)) {
        throw new TypeError("after must be a Map or an object of room id to cursor");
      }
      [...(after instanceof Map ? after : Object.entries(after))].forEach(([roomId, cursor]: [unknown, unknown], index) => {
        if (typeof roomId !== "string" || !isUuid(roomId)) {
          throw invalid("WatchRooms", `after[${index}].room_id must be a room id (uuid), got ${pythonRepr(roomId)}`);
        }
        if (cursorOf(cursor, `after[${index}].cursor`) < 0n) {
          throw invalid("WatchRooms", `after[${index}].cursor must be 0 or more, got ${String(cursor)}`);
        }
      });
    }
    return new RoomsWatch(this.transport, this.retryPolicy, options.after, options.idleTimeoutMs ?? 60_000);
  }

  // Session keys.

  /**
   * A short-lived key of your company (`ttlSeconds`: 60 to 604800) that works like this one until it
   * expires or is ended (endSession called with it); `secret` is in this answer (and a repeat's)
   * only. Call it with a company key. Safe to retry, as postMessage: a repeat of `idempotencyKey`
   * answers the first key and its secret.
   */
  async createSessionKey(
    ttlSeconds: number,
    options: { label?: string; idempotencyKey?: string } = {},
    call: PerCall = {},
  ): Promise<CreateSessionKeyResponse> {
    const request = {
      ttlSeconds: BigInt(ttlSeconds),
      label: options.label ?? "",
      idempotencyKey: options.idempotencyKey ?? newIdempotencyKey(),
    };
    return this.unary(call, "createSessionKey", request);
  }

  /**
   * Revoke the session key this client calls with, at once (its open watches end with
   * Unauthenticated); resolves to its key id. Retried like a read: when a retry is answered
   * UNAUTHENTICATED, an earlier attempt ended the session, and the call resolves as done.
   * FailedPrecondition when this client's key is a company key (revoke those with `quayutec keys revoke`).
   */
  async endSession(call: PerCall = {}): Promise<string> {
    try {
      return (await this.unary(call, "endSession", {})).keyId;
    } catch (error) {
      if (error instanceof Unauthenticated && error.attempts > 1 && this.transport.keyId) {
        return this.transport.keyId; // the session was ended by an attempt whose answer was lost
      }
      throw error;
    }
  }
}

/** A cursor as a bigint (from a bigint, a whole number or a string of digits); TypeError otherwise. */
/** A Date, or an ISO 8601 date or time ("2026-01-01", "2026-01-01T09:00:00Z") as a Date; TypeError naming
 * `name` otherwise. */
function moment(value: unknown, name: string): Date {
  const date = typeof value === "string" && /^\d{4}-\d{2}-\d{2}/.test(value) ? new Date(value) : value;
  if (!(date instanceof Date) || Number.isNaN(date.getTime())) {
    throw new TypeError(`${name} must be a Date or an ISO 8601 date or time such as "2026-01-01", not ${JSON.stringify(value) ?? String(value)}`);
  }
  return date;
}

/** A string as Python's repr shows it (the Gateway's messages quote ids so): 'x'. */
function pythonRepr(value: unknown): string {
  return typeof value === "string" ? `'${value.slice(0, 64).replace(/\\/g, "\\\\").replace(/'/g, "\\'")}'` : JSON.stringify(value) ?? String(value);
}

function cursorOf(value: unknown, name: string): bigint {
  if (typeof value === "bigint") {
    return value;
  }
  if ((typeof value === "number" && Number.isSafeInteger(value)) || (typeof value === "string" && /^-?\d+$/.test(value))) {
    return BigInt(value);
  }
  throw new TypeError(`${name} must be a cursor (a bigint, a whole number or a string of digits), not ${JSON.stringify(String(value))}`);
}

function required<T>(value: T | undefined): T {
  if (value === undefined) {
    throw new TypeError("the Gateway answered without the expected message");
  }
  return value;
}

/** Which Client method wraps each Gateway RPC; the compiler refuses this table while an RPC is missing. */
export const WRAPS: { readonly [K in RpcKey]: keyof Client } = {
  whoAmI: "whoAmI",
  createRoom: "createRoom",
  renameRoom: "renameRoom",
  archiveRoom: "archiveRoom",
  listRooms: "rooms",
  inviteCompany: "inviteCompany",
  listInvitations: "invitations",
  acceptInvitation: "acceptInvitation",
  declineInvitation: "declineInvitation",
  listRoomInvitations: "roomInvitations",
  withdrawInvitation: "withdrawInvitation",
  leaveRoom: "leaveRoom",
  removeMember: "removeMember",
  listMembers: "members",
  registerAgent: "registerAgent",
  renameAgent: "renameAgent",
  retireAgent: "retireAgent",
  listAgents: "agents",
  postMessage: "postMessage",
  listMessages: "messages",
  sendTask: "sendTask",
  updateTask: "updateTask",
  listTasks: "tasks",
  getTask: "getTask",
  listMemory: "memory",
  uploadFile: "uploadFile",
  listFiles: "files",
  searchPassages: "searchPassages",
  listRuns: "runs",
  getRun: "getRun",
  getMessage: "getMessage",
  createApiKey: "createApiKey",
  listApiKeys: "apiKeys",
  revokeApiKey: "revokeApiKey",
  setAgentRights: "setAgentRights",
  getAgentRights: "getAgentRights",
  listApprovals: "approvals",
  decideApproval: "decideApproval",
  watchRoom: "watch",
  watchRooms: "watchRooms",
  createSessionKey: "createSessionKey",
  endSession: "endSession",
  setSignInProvider: "setSignInProvider",
  getSignInProvider: "signInProvider",
  removeSignInProvider: "removeSignInProvider",
};
