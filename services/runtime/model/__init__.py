"""Model-call layer of the Runtime: one bounded retry loop over the Anthropic and OpenAI wire
formats, classifying each answer per provider-errors.md."""

from .classify import Verdict, classify_exception, classify_response, sanitize
from .client import (
    DEFAULT_MAX_RESPONSE_BYTES,
    RETRY_WAIT_EVENT,
    TRACER_NAME,
    OnAttempt,
    call_model,
    make_http_client,
    make_owner_http_client,
)
from .policy import Clock, RealClock, RetryPolicy
from .types import (
    DECLARED_ACTIONS,
    Attempt,
    BadReply,
    ChatMessage,
    ModelOutcome,
    ModelReply,
    ModelRequest,
    ModelTarget,
    Provider,
    ToolCall,
    ToolSpec,
)

__all__ = [
    "DECLARED_ACTIONS",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "RETRY_WAIT_EVENT",
    "TRACER_NAME",
    "Attempt",
    "BadReply",
    "ChatMessage",
    "Clock",
    "ModelOutcome",
    "ModelReply",
    "ModelRequest",
    "ModelTarget",
    "OnAttempt",
    "Provider",
    "RealClock",
    "RetryPolicy",
    "ToolCall",
    "ToolSpec",
    "Verdict",
    "call_model",
    "classify_exception",
    "classify_response",
    "make_http_client",
    "make_owner_http_client",
    "sanitize",
]
