"""Anthropic Messages API wire format (POST {base}/v1/messages)."""

from __future__ import annotations

import json
from typing import Any

from .types import BadReply, ModelReply, ModelRequest, ModelTarget, ToolCall

DEFAULT_BASE_URL = "https://api.anthropic.com"
API_VERSION = "2023-06-01"


def build(target: ModelTarget, request: ModelRequest) -> tuple[str, dict[str, str], dict[str, Any]]:
    """URL, headers and JSON body for one request."""
    base = (target.base_url or DEFAULT_BASE_URL).rstrip("/")
    headers = {
        "x-api-key": target.api_key,
        "anthropic-version": API_VERSION,
        "content-type": "application/json",
    }
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": request.max_tokens,
        "messages": [{"role": m.role, "content": m.content} for m in request.messages],
    }
    if request.system:
        body["system"] = request.system
    if request.tools:
        body["tools"] = [
            {"name": t.name, "description": t.description, "input_schema": dict(t.json_schema)} for t in request.tools
        ]
    return f"{base}/v1/messages", headers, body


def parse(raw: bytes) -> ModelReply:
    """Text blocks joined, tool_use blocks as tool calls; other block kinds are ignored."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadReply("body is not JSON") from exc
    if not isinstance(data, dict) or not isinstance(data.get("content"), list):
        raise BadReply("no content list")
    texts: list[str] = []
    calls: list[ToolCall] = []
    for block in data["content"]:
        if not isinstance(block, dict):
            raise BadReply("content block is not an object")
        kind = block.get("type")
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise BadReply("text block without text")
            texts.append(text)
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise BadReply("tool_use block without id or name")
            if not isinstance(args, dict):
                raise BadReply(f"tool_use {name} input is not an object")
            calls.append(ToolCall(id=call_id, name=name, arguments=args))
    usage = data.get("usage")
    if not isinstance(usage, dict):
        usage = {}
    model = data.get("model")
    return ModelReply(
        text="\n\n".join(t for t in texts if t),
        tool_calls=tuple(calls),
        input_tokens=_int(usage.get("input_tokens")),
        output_tokens=_int(usage.get("output_tokens")),
        stop_reason=str(data.get("stop_reason") or ""),
        response_model=model if isinstance(model, str) else None,
    )


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
