// @quayutec/client: the Gateway API of Quayutec rooms from TypeScript.
export { API_KEY_ENV, checkAddress, Client, connect, GATEWAY_ENV, newIdempotencyKey, WRAPS, type ConnectOptions, type EnumInput } from "./client.js";
export * from "./errors.js";
export { DEFAULT_RETRY, NO_RETRY, retryPolicy, waitBeforeMs, type RetryPolicy } from "./retry.js";
export { SAFETY, Safety, setRetryListener, type PerCall, type RetryNotice, type TlsOptions } from "./transport.js";
export { RoomsWatch, RoomWatch, type RoomCursors } from "./watch.js";
export * from "./gen/quayutec/v1/common_pb.js";
export type {
  AcceptInvitationResponse,
  CreateSessionKeyResponse,
  DecideApprovalResponse,
  GetAgentRightsResponse,
  PostMessageResponse,
  SendTaskResponse,
} from "./gen/quayutec/v1/gateway_pb.js";
export { GatewayService } from "./gen/quayutec/v1/gateway_pb.js";
export { Code } from "@connectrpc/connect";
