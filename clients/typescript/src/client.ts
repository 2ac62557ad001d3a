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
import { Unauthenticated } from "./errors.js";
import { retryPolicy, type RetryPolicy } from "./retry.js";
import { Transport, type RequestOf, type ResponseOf, type RpcKey, type TlsOptions, type UnaryKey } from "./transport.js";
import { RoomsWatch, RoomWatch, type RoomCursors } from "./watch.js";

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
  /** The Gateway, "host:port". */
  address: string;
  /** Your company's API key (qyk_...). */
  apiKey: string;
  /** TLS is on by default, with Node's roots; name others here. */
  tls?: TlsOptions;
  /** Turn TLS off (a Gateway on your own machine). */
  plaintext?: boolean;
  /** How calls are retried (the defaults of DEFAULT_RETRY for what is not given). */
  retry?: Partial<RetryPolicy>;
}

/** A client of the Gateway at `address`, calling as the company of `apiKey`. Close it with `close()`. */
export function connect(options: ConnectOptions): Client {
  if (options.plaintext && options.tls) {
    throw new TypeError("plaintext: true and tls options contradict each other: choose one");
  }
  const transport = new Transport(options.address, options.apiKey, options.plaintext ?? false, options.tls ?? {});
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

  /** Close the connection (of this client and those made from it with withRetry). */
  close(): void {
    this.transport.close();
  }

  [inspect.custom](): string {
    return `Client { address: ${JSON.stringify(this.transport.address)} }`;
  }

  toJSON(): object {
    return { address: this.transport.address, retryPolicy: this.retryPolicy };
  }

  private unary<K extends UnaryKey>(key: K, request: RequestOf<K>): Promise<ResponseOf<K>> {
    return this.transport.unary(key, request, this.retryPolicy);
  }

  private async *paged<K extends UnaryKey, T>(
    key: K,
    request: RequestOf<K>,
    items: (page: ResponseOf<K>) => T[],
  ): AsyncGenerator<T, void, undefined> {
    for (;;) {
      const page = await this.unary(key, request);
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
  async whoAmI(): Promise<Company> {
    return required((await this.unary("whoAmI", {})).company);
  }

  /** A new room; your company is its first member. */
  async createRoom(name: string): Promise<Room> {
    return required((await this.unary("createRoom", { name })).room);
  }

  /** The rooms your company is a member of. */
  rooms(options: { pageSize?: number } = {}): AsyncGenerator<Room, void, undefined> {
    return this.paged("listRooms", { ...options }, (p) => p.rooms);
  }

  /** The member companies of a room. */
  members(roomId: string, options: { pageSize?: number } = {}): AsyncGenerator<RoomMember, void, undefined> {
    return this.paged("listMembers", { roomId, ...options }, (p) => p.members);
  }

  // Invitations and membership.

  /** Invite a company into a room; it becomes a member when it accepts. */
  async inviteCompany(roomId: string, companyId: string): Promise<Invitation> {
    return required((await this.unary("inviteCompany", { roomId, companyId })).invitation);
  }

  /** Invitations to your company, oldest first: pending ones unless `status` says otherwise. */
  invitations(options: { status?: EnumInput<typeof InvitationStatus>; pageSize?: number } = {}): AsyncGenerator<Invitation, void, undefined> {
    return this.paged("listInvitations", { status: enumValue(InvitationStatus, options.status), pageSize: options.pageSize }, (p) => p.invitations);
  }

  /** Become a member of the invitation's room (accepting again answers the same). */
  async acceptInvitation(invitationId: string): Promise<AcceptInvitationResponse> {
    return this.unary("acceptInvitation", { invitationId });
  }

  /** Refuse an invitation (declining again changes nothing). */
  async declineInvitation(invitationId: string): Promise<Invitation> {
    return required((await this.unary("declineInvitation", { invitationId })).invitation);
  }

  /** End your company's membership at once. */
  async leaveRoom(roomId: string): Promise<void> {
    await this.unary("leaveRoom", { roomId });
  }

  /** End another company's membership (the room's creator only). */
  async removeMember(roomId: string, companyId: string): Promise<void> {
    await this.unary("removeMember", { roomId, companyId });
  }

  // Agents.

  /** An always-on agent of your company; the provider key is stored encrypted, never returned. */
  async registerAgent(agent: {
    name: string;
    provider: EnumInput<typeof Provider>;
    model: string;
    providerKey?: string;
    baseUrl?: string;
    systemPrompt?: string;
  }): Promise<Agent> {
    const request = { ...agent, provider: enumValue(Provider, agent.provider) };
    return required((await this.unary("registerAgent", request)).agent);
  }

  /** Your company's agents. */
  agents(options: { pageSize?: number } = {}): AsyncGenerator<Agent, void, undefined> {
    return this.paged("listAgents", { ...options }, (p) => p.agents);
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
    options: { person: string; mentions?: string[]; idempotencyKey?: string },
  ): Promise<PostMessageResponse> {
    return this.unary("postMessage", {
      roomId,
      body,
      person: options.person,
      mentionAgentIds: options.mentions ?? [],
      idempotencyKey: options.idempotencyKey ?? newIdempotencyKey(),
    });
  }

  /** A room's messages, oldest first unless `newestFirst`. */
  messages(roomId: string, options: { newestFirst?: boolean; pageSize?: number } = {}): AsyncGenerator<Message, void, undefined> {
    return this.paged("listMessages", { roomId, ...options }, (p) => p.messages);
  }

  /** Send a task from `person` to an agent in the room, waking it once (safe to retry, as postMessage). */
  async sendTask(
    roomId: string,
    task: { toAgentId: string; title: string; person: string; body?: string; idempotencyKey?: string },
  ): Promise<SendTaskResponse> {
    return this.unary("sendTask", { roomId, ...task, idempotencyKey: task.idempotencyKey ?? newIdempotencyKey() });
  }

  /** Add a note to a task; `status` "done" or "cancelled" closes it (safe to retry). */
  async updateTask(
    roomId: string,
    taskId: string,
    update: { person: string; note?: string; status?: EnumInput<typeof TaskStatus>; idempotencyKey?: string },
  ): Promise<Task> {
    const request = {
      roomId,
      taskId,
      person: update.person,
      note: update.note ?? "",
      status: enumValue(TaskStatus, update.status),
      idempotencyKey: update.idempotencyKey ?? newIdempotencyKey(),
    };
    return required((await this.unary("updateTask", request)).task);
  }

  /** A room's tasks, optionally those of one agent or in one status. */
  tasks(
    roomId: string,
    options: { toAgentId?: string; status?: EnumInput<typeof TaskStatus>; pageSize?: number } = {},
  ): AsyncGenerator<Task, void, undefined> {
    return this.paged("listTasks", { roomId, toAgentId: options.toAgentId, status: enumValue(TaskStatus, options.status), pageSize: options.pageSize }, (p) => p.tasks);
  }

  /** One task with its updates. */
  async getTask(roomId: string, taskId: string): Promise<Task> {
    return required((await this.unary("getTask", { roomId, taskId })).task);
  }

  // Memory and files.

  /** Memory lines your company may read (room-wide and its own), optionally searched. */
  memory(roomId: string, options: { query?: string; pageSize?: number } = {}): AsyncGenerator<MemoryLine, void, undefined> {
    return this.paged("listMemory", { roomId, ...options }, (p) => p.lines);
  }

  /** Upload UTF-8 text (at most 10 MiB) into a room, searchable by passage. */
  async uploadFile(
    roomId: string,
    name: string,
    content: string | Uint8Array,
    options: { person: string; contentType?: string },
  ): Promise<File> {
    const bytes = typeof content === "string" ? new TextEncoder().encode(content) : content;
    const request = { roomId, name, content: bytes, person: options.person, contentType: options.contentType ?? "text/plain" };
    return required((await this.unary("uploadFile", request)).file);
  }

  /** A room's files (without their content). */
  files(roomId: string, options: { pageSize?: number } = {}): AsyncGenerator<File, void, undefined> {
    return this.paged("listFiles", { roomId, ...options }, (p) => p.files);
  }

  /** The passages of a room's files that best match `query`. */
  async searchPassages(roomId: string, query: string, options: { limit?: number } = {}): Promise<Passage[]> {
    return (await this.unary("searchPassages", { roomId, query, ...options })).passages;
  }

  // Runs, rights and approvals.

  /** Your agents' runs (or one agent's), newest first; optionally in one room, with one status, or
   * started at or after `startedAfter` and before `startedBefore`. */
  runs(
    options: {
      agentId?: string;
      roomId?: string;
      status?: RunStatus;
      startedAfter?: Date;
      startedBefore?: Date;
      pageSize?: number;
    } = {},
  ): AsyncGenerator<Run, void, undefined> {
    const { startedAfter, startedBefore, ...rest } = options;
    return this.paged(
      "listRuns",
      {
        ...rest,
        startedAfter: startedAfter === undefined ? undefined : timestampFromDate(startedAfter),
        startedBefore: startedBefore === undefined ? undefined : timestampFromDate(startedBefore),
      },
      (p) => p.runs,
    );
  }

  /** One message of a room (an agent's reply carries the `runId` of the run that posted it). */
  async getMessage(roomId: string, messageId: string): Promise<Message> {
    return required((await this.unary("getMessage", { roomId, messageId })).message);
  }

  // Your company's API keys.

  /** A new API key of your company (call with a company key: a session key may not). Its `secret`
   * is in this answer only; keep it. */
  async createApiKey(options: { label?: string } = {}): Promise<CreateApiKeyResponse> {
    return this.unary("createApiKey", { label: options.label ?? "" });
  }

  /** Your company's keys, oldest first (never a secret); its session keys too when asked. */
  apiKeys(options: { includeSessions?: boolean; pageSize?: number } = {}): AsyncGenerator<ApiKey, void, undefined> {
    return this.paged("listApiKeys", { ...options }, (p) => p.keys);
  }

  /** Revoke one of your company's keys at once (its session keys with it). */
  async revokeApiKey(keyId: string): Promise<ApiKey> {
    return required((await this.unary("revokeApiKey", { keyId })).key);
  }

  /** Register (or replace) the OpenID Connect provider your people sign in to the console with (call
   * with a company key); the secret is stored encrypted and never returned. */
  async setSignInProvider(options: {
    issuer: string;
    clientId: string;
    clientSecret: string;
    emailDomains?: string[];
    allowApiKeySignIn?: boolean;
  }): Promise<SignInProvider> {
    return required((await this.unary("setSignInProvider", { ...options })).provider);
  }

  /** Your company's sign-in provider (never its secret), or undefined when none is set. */
  async signInProvider(): Promise<SignInProvider | undefined> {
    const got = await this.unary("getSignInProvider", {});
    return got.found ? got.provider : undefined;
  }

  /** Remove your company's sign-in provider (its sign-ins end); false when none was set. */
  async removeSignInProvider(): Promise<boolean> {
    return (await this.unary("removeSignInProvider", {})).removed;
  }

  /** One run's ledger row: what it posted and wrote, each model request, its trace id. */
  async getRun(runId: string): Promise<Run> {
    return required((await this.unary("getRun", { runId })).run);
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
    return required((await this.unary("setAgentRights", request)).rights);
  }

  /** Stored and effective rights of your default (`agentId` empty) or of one agent. */
  async getAgentRights(agentId = ""): Promise<GetAgentRightsResponse> {
    return this.unary("getAgentRights", { agentId });
  }

  /** Your parked runs whose held actions await your decision (pending unless `status`). */
  approvals(options: { status?: EnumInput<typeof WaitpointStatus>; pageSize?: number } = {}): AsyncGenerator<Waitpoint, void, undefined> {
    return this.paged("listApprovals", { status: enumValue(WaitpointStatus, options.status), pageSize: options.pageSize }, (p) => p.waitpoints);
  }

  /** Approve or deny one held action; the decision that completes a waitpoint continues its run once. */
  async decideApproval(token: string, index: number, decision: { person: string; approve: boolean }): Promise<DecideApprovalResponse> {
    return this.unary("decideApproval", { token, index, ...decision });
  }

  // Following a room.

  /**
   * A room's events, replayed after `after` (a cursor you kept; 0: from the oldest kept) and then
   * live; without `after`, from now. See RoomWatch.
   */
  watch(roomId: string, options: { after?: bigint | number | string; idleTimeoutMs?: number } = {}): RoomWatch {
    return new RoomWatch(this.transport, this.retryPolicy, roomId, options.after, options.idleTimeoutMs ?? 60_000);
  }

  /**
   * Every room of your company in one stream: the rooms `after` names (room id -> a cursor you kept)
   * resumed after their cursors and the others from their joining; without `after`, from now.
   * `watch.cursors` is the map to keep. See RoomsWatch.
   */
  watchRooms(options: { after?: RoomCursors; idleTimeoutMs?: number } = {}): RoomsWatch {
    return new RoomsWatch(this.transport, this.retryPolicy, options.after, options.idleTimeoutMs ?? 60_000);
  }

  // Session keys.

  /**
   * A short-lived key of your company (`ttlSeconds`: 60 to 604800) that works like this one until it
   * expires or is ended (endSession called with it); `secret` is shown once. Call it with a company
   * key. A repeat would make a second key, so after UNAVAILABLE or a deadline it is not sent again
   * (only when refused before acting, or never sent).
   */
  async createSessionKey(ttlSeconds: number, options: { label?: string } = {}): Promise<CreateSessionKeyResponse> {
    return this.unary("createSessionKey", { ttlSeconds: BigInt(ttlSeconds), label: options.label ?? "" });
  }

  /**
   * Revoke the session key this client calls with, at once (its open watches end with
   * Unauthenticated); resolves to its key id. Retried like a read: when a retry is answered
   * UNAUTHENTICATED, an earlier attempt ended the session, and the call resolves as done.
   * FailedPrecondition when this client's key is a company key (revoke those with `quayutec keys revoke`).
   */
  async endSession(): Promise<string> {
    try {
      return (await this.unary("endSession", {})).keyId;
    } catch (error) {
      if (error instanceof Unauthenticated && error.attempts > 1 && this.transport.keyId) {
        return this.transport.keyId; // the session was ended by an attempt whose answer was lost
      }
      throw error;
    }
  }
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
  listRooms: "rooms",
  inviteCompany: "inviteCompany",
  listInvitations: "invitations",
  acceptInvitation: "acceptInvitation",
  declineInvitation: "declineInvitation",
  leaveRoom: "leaveRoom",
  removeMember: "removeMember",
  listMembers: "members",
  registerAgent: "registerAgent",
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
