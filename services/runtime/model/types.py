"""Value types of the model-call layer: what we send, what comes back, what each attempt did."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Provider = Literal["anthropic", "openai", "openai_compatible"]
Role = Literal["user", "assistant"]


class BadReply(Exception):
    """A success status whose body is not a reply we understand."""


@dataclass(frozen=True)
class ToolCall:
    """One declared action the model asked for (a provider tool call), arguments already parsed."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ModelReply:
    text: str
    tool_calls: tuple[ToolCall, ...]
    input_tokens: int
    output_tokens: int
    stop_reason: str
    response_model: str | None = None


@dataclass(frozen=True)
class ModelTarget:
    """Where and with whose key to call.

    `owner_supplied` is True when the agent's owner gave the base URL: exactly one request, never
    retried. A base URL from our own configuration (e.g. the stand-in) is not owner supplied.
    """

    provider: Provider
    model: str
    api_key: str = field(repr=False)
    base_url: str | None = None
    owner_supplied: bool = False

    def __post_init__(self) -> None:
        if self.provider not in ("anthropic", "openai", "openai_compatible"):
            raise ValueError(f"unknown provider {self.provider!r}")
        if self.provider == "openai_compatible" and not self.base_url:
            raise ValueError("an openai_compatible target needs a base_url")
        if not self.model:
            raise ValueError("model must not be empty")


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    json_schema: Mapping[str, Any]


@dataclass(frozen=True)
class ModelRequest:
    system: str
    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...] = ()
    max_tokens: int = 1024


@dataclass(frozen=True)
class Attempt:
    """One request to the provider, as the ledger records it.

    `wait_seconds` is the wait taken after this attempt before the next one (0 when none follows);
    `detail` is short and sanitized: it never holds the key.
    """

    number: int
    status_code: int | None
    error_class: str
    retryable: bool
    wait_seconds: float
    detail: str
    duration_ms: float


@dataclass(frozen=True)
class ModelOutcome:
    """The result of one model call: a reply, or the final error class; always every attempt."""

    reply: ModelReply | None
    attempts: tuple[Attempt, ...]
    error_class: str | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.reply is not None


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


DECLARED_ACTIONS: tuple[ToolSpec, ...] = (
    ToolSpec(
        name="remember",
        description="Write one line to the room's shared memory.",
        json_schema=_object(
            {
                "text": {"type": "string", "description": "The memory line."},
                "private": {
                    "type": "boolean",
                    "description": "True: readable only by your own company and its agents.",
                },
            },
            ["text", "private"],
        ),
    ),
    ToolSpec(
        name="create_task",
        description="Create a task in the room for another agent.",
        json_schema=_object(
            {
                "to_agent_id": {"type": "string"},
                "title": {"type": "string"},
                "body": {"type": "string"},
            },
            ["to_agent_id", "title", "body"],
        ),
    ),
    ToolSpec(
        name="update_task",
        description="Add a note to an open task.",
        json_schema=_object(
            {"task_id": {"type": "string"}, "note": {"type": "string"}},
            ["task_id", "note"],
        ),
    ),
    ToolSpec(
        name="close_task",
        description="Close a task as done or cancelled.",
        json_schema=_object(
            {
                "task_id": {"type": "string"},
                "status": {"type": "string", "enum": ["done", "cancelled"]},
                "note": {"type": "string"},
            },
            ["task_id", "status", "note"],
        ),
    ),
)
