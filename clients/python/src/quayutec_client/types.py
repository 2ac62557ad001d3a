"""The types of the Gateway API under this client's names: the messages the methods return and the
enums they take. They are protobuf messages (typed; ``str()`` prints them, ``MessageToDict`` of
``google.protobuf.json_format`` turns them into dicts)."""

from __future__ import annotations

from quayutec_client._proto import common_pb2, gateway_pb2

# Things of a room.
Company = common_pb2.Company
Room = common_pb2.Room
RoomMember = common_pb2.RoomMember
Invitation = common_pb2.Invitation
Agent = common_pb2.Agent
Author = common_pb2.Author
Message = common_pb2.Message
Task = common_pb2.Task
TaskUpdate = common_pb2.TaskUpdate
MemoryLine = common_pb2.MemoryLine
File = common_pb2.File
Passage = common_pb2.Passage
Run = common_pb2.Run
DeclaredAction = common_pb2.DeclaredAction
ModelAttempt = common_pb2.ModelAttempt
AgentRights = common_pb2.AgentRights
Waitpoint = common_pb2.Waitpoint
HeldAction = common_pb2.HeldAction
RoomEvent = common_pb2.RoomEvent

# Answers of more than one thing.
PostedMessage = gateway_pb2.PostMessageResponse  # .message and .wake_ids
SentTask = gateway_pb2.SendTaskResponse  # .task and .wake_ids
AcceptedInvitation = gateway_pb2.AcceptInvitationResponse  # .invitation and .member
RightsOfAgent = gateway_pb2.GetAgentRightsResponse  # .company_default, .agent and .effective
ApprovalDecision = gateway_pb2.DecideApprovalResponse  # .waitpoint, .completed and .already_decided
SessionKey = gateway_pb2.CreateSessionKeyResponse  # .key_id, .secret and .expires_at
RunWithApproval = gateway_pb2.GetRunResponse  # .run and, when it parked, .approval
KeyInfo = gateway_pb2.ApiKey  # one of your company's API keys as listed: never its secret
MadeKey = gateway_pb2.CreateApiKeyResponse  # .key and .secret (shown this once)

# Enums: values such as Provider.PROVIDER_ANTHROPIC; the methods also take the short name ("anthropic").
Provider = common_pb2.Provider
AuthorKind = common_pb2.AuthorKind
TaskStatus = common_pb2.TaskStatus
MemoryVisibility = common_pb2.MemoryVisibility
WakeKind = common_pb2.WakeKind
ActionKind = common_pb2.ActionKind
ActionOutcome = common_pb2.ActionOutcome
RunStatus = common_pb2.RunStatus
RunStep = common_pb2.RunStep
ActionRight = common_pb2.ActionRight
Decision = common_pb2.Decision
WaitpointStatus = common_pb2.WaitpointStatus
InvitationStatus = common_pb2.InvitationStatus
RoomEventKind = common_pb2.RoomEventKind
