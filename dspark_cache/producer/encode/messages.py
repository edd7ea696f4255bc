"""Normalise one input row (OpenAI ``messages`` or ShareGPT ``conversations``), as NeMo does."""

from __future__ import annotations

import json
from typing import Any

from dspark_cache.producer.inputs.rows import InvalidRow

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "tool": "tool",
}


def _content(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts: keep the text parts
        parts = [p.get("text", "") for p in value if isinstance(p, dict) and p.get("type", "text") == "text"]
        if all(isinstance(p, str) for p in parts):
            return " ".join(parts)
    raise InvalidRow("non-string content", f"{where} has content of type {type(value).__name__}, expected a string")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise InvalidRow("bad tool_calls", f"{where}: tool_calls must be a list")
    out = []
    for i, call in enumerate(calls):
        if not isinstance(call, dict):
            raise InvalidRow("bad tool_calls", f"{where}: tool_calls[{i}] is not an object")
        fn = dict(call.get("function") or {})
        if not isinstance(fn.get("name"), str):
            raise InvalidRow("bad tool_calls", f"{where}: tool_calls[{i}] has no function name")
        if not isinstance(fn.get("arguments", {}), str):
            fn["arguments"] = json.dumps(fn.get("arguments", {}))
        out.append({"id": call.get("id") or f"call_{i}", "type": call.get("type") or "function", "function": fn})
    return out


def _message(raw: Any, index: int) -> dict[str, Any]:
    where = f"message {index}"
    if not isinstance(raw, dict):
        raise InvalidRow("message not an object", f"{where} is {type(raw).__name__}, expected an object")
    role = raw.get("role")
    if role is None:
        raise InvalidRow("message without role", f"{where} has no 'role'")
    if role not in ROLES:
        raise InvalidRow("unknown role", f"{where} has unknown role {role!r}; expected one of {', '.join(ROLES)}")
    msg: dict[str, Any] = {"role": role, "content": _content(raw.get("content"), where)}
    if role == "assistant":
        reasoning = raw.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise InvalidRow("non-string content", f"{where}: reasoning_content must be a string")
            msg["reasoning_content"] = reasoning
        if raw.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(raw["tool_calls"], where)
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRow("tool message without tool_call_id",
                             f"{where}: a tool message needs a non-empty tool_call_id")
        msg["tool_call_id"] = call_id
    return msg


def _from_sharegpt(turns: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise InvalidRow("message not an object", f"conversations[{i}] is not an object")
        role = SHAREGPT_ROLES.get(turn.get("from"))  # type: ignore[arg-type]
        if role is None:
            raise InvalidRow("unknown role", f"conversations[{i}] has unknown 'from' {turn.get('from')!r}")
        out.append({"role": role, "content": turn.get("value")})
    return out


def normalise_row(row: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Return ``(messages, tools)`` for a row, or raise :class:`InvalidRow`."""
    if not isinstance(row, dict):
        raise InvalidRow("row not an object", f"row is {type(row).__name__}, expected a JSON object")
    if "messages" in row and row["messages"] is not None:
        raw = row["messages"]
    elif "conversations" in row and row["conversations"] is not None:
        if not isinstance(row["conversations"], list):
            raise InvalidRow("messages not a list", "'conversations' must be a list")
        raw = _from_sharegpt(row["conversations"])
    else:
        raise InvalidRow("missing messages", "row has neither 'messages' nor 'conversations'")
    if not isinstance(raw, list):
        raise InvalidRow("messages not a list", f"'messages' is {type(raw).__name__}, expected a list")
    messages = [_message(m, i) for i, m in enumerate(raw)]
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as exc:
            raise InvalidRow("bad tools", f"'tools' is a string but not JSON ({exc})") from exc
    if tools is not None and not isinstance(tools, list):
        raise InvalidRow("bad tools", "'tools' must be a list")
    return messages, (tools or None)
