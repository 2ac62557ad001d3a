"""OpenAI Chat Completions wire format (POST {base}/v1/chat/completions), also used for
OpenAI-compatible servers at the owner's base URL."""

from __future__ import annotations

import json
from typing import Any

from .types import BadReply, ModelReply, ModelRequest, ModelTarget, ToolCall

DEFAULT_BASE_URL = "https://api.openai.com"


def build(target: ModelTarget, request: ModelRequest) -> tuple[str, dict[str, str], dict[str, Any]]:
    """URL, headers and JSON body for one request."""
    base = (target.base_url or DEFAULT_BASE_URL).rstrip("/")
    headers = {
        "authorization": f"Bearer {target.api_key}",
        "content-type": "application/json",
    }
    messages: list[dict[str, str]] = []
    if request.system:
        messages.append({"role": "system", "content": request.system})
    messages.extend({"role": m.role, "content": m.content} for m in request.messages)
    body: dict[str, Any] = {"model": target.model, "messages": messages}
    # OpenAI's newer models refuse `max_tokens`; most compatible servers only know `max_tokens`.
    limit_key = "max_completion_tokens" if target.provider == "openai" else "max_tokens"
    body[limit_key] = request.max_tokens
    if request.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": dict(t.json_schema),
                },
            }
            for t in request.tools
        ]
    return f"{base}/v1/chat/completions", headers, body


def parse(raw: bytes) -> ModelReply:
    """choices[0].message: content and tool_calls, whose `arguments` is a JSON string."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadReply("body is not JSON") from exc
    if not isinstance(data, dict):
        raise BadReply("body is not an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BadReply("no choices")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise BadReply("choice without message")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise BadReply("message content is not a string")
    calls: list[ToolCall] = []
    for item in message.get("tool_calls") or []:
        calls.append(_tool_call(item))
    usage = data.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    model = data.get("model")
    return ModelReply(
        text=content or "",
        tool_calls=tuple(calls),
        input_tokens=_int(usage.get("prompt_tokens")),
        output_tokens=_int(usage.get("completion_tokens")),
        stop_reason=str(choice.get("finish_reason") or ""),
        response_model=model if isinstance(model, str) else None,
    )


def _tool_call(item: object) -> ToolCall:
    if not isinstance(item, dict):
        raise BadReply("tool call is not an object")
    function = item.get("function")
    call_id = item.get("id")
    if not isinstance(function, dict) or not isinstance(call_id, str):
        raise BadReply("tool call without id or function")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str):
        raise BadReply("tool call without a name")
    if arguments is None or arguments == "":
        return ToolCall(id=call_id, name=name, arguments={})
    if not isinstance(arguments, str):
        raise BadReply(f"tool call {name} arguments are not a JSON string")
    try:
        parsed = json.loads(arguments)
    except ValueError as exc:
        raise BadReply(f"tool call {name} arguments are not valid JSON") from exc
    if not isinstance(parsed, dict):
        raise BadReply(f"tool call {name} arguments are not an object")
    return ToolCall(id=call_id, name=name, arguments=parsed)


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
