"""Normalise one input row (OpenAI ``messages`` or ShareGPT ``conversations``), as NeMo does."""

from __future__ import annotations

import json
from typing import Any

from dspark_cache.producer.encode.text import SURROGATE, surrogate_at
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


def _text(value: str, where: str) -> str:
    """A string field as it is, unless it holds a lone surrogate (a JSON escape like \\ud800), which
    no tokenizer takes: refused here, where the row's own key can be named."""
    if not value.isascii() and (m := SURROGATE.search(value)):
        raise InvalidRow("lone surrogate", surrogate_at(where, m) + ", which is not valid Unicode text")
    return value


def _content(value: Any, where: str) -> str:
    """``where``: the row's own key, e.g. ``messages[2].content`` or ``conversations[0].value``."""
    if value is None:
        return ""
    if isinstance(value, str):
        return _text(value, where)
    if isinstance(value, list):  # OpenAI content parts: keep the text parts
        parts = [p.get("text", "") for p in value if isinstance(p, dict) and p.get("type", "text") == "text"]
        if all(isinstance(p, str) for p in parts):
            return _text(" ".join(parts), where)
        raise InvalidRow("non-string content", f"{where} has a text part whose 'text' is not a string")
    raise InvalidRow("non-string content", f"{where} is of type {type(value).__name__}, expected a string")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise InvalidRow("bad tool_calls", f"{where} must be a list")
    out = []
    for i, call in enumerate(calls):
        if not isinstance(call, dict):
            raise InvalidRow("bad tool_calls", f"{where}[{i}] is not an object")
        fn = dict(call.get("function") or {})
        if not isinstance(fn.get("name"), str):
            raise InvalidRow("bad tool_calls", f"{where}[{i}].function has no name")
        if not isinstance(fn.get("arguments", {}), str):
            fn["arguments"] = json.dumps(fn.get("arguments", {}))
        out.append(
            {"id": call.get("id") or f"call_{i}", "type": call.get("type") or "function", "function": fn}
        )
    return out


def _message(raw: Any, where: str, content_key: str = "content") -> dict[str, Any]:
    """One OpenAI-style message; ``where`` is its place in the row (``messages[2]``), ``content_key``
    the row's name for its content (a ShareGPT turn's ``value``)."""
    if not isinstance(raw, dict):
        raise InvalidRow("message not an object", f"{where} is {type(raw).__name__}, expected an object")
    role = raw.get("role")
    if role is None:
        raise InvalidRow("message without role", f"{where} has no 'role'")
    if role not in ROLES:
        raise InvalidRow("unknown role", f"{where}.role: unknown role {role!r}; expected one of "
                         f"{', '.join(ROLES)}")
    msg: dict[str, Any] = {"role": role, "content": _content(raw.get("content"), f"{where}.{content_key}")}
    if role == "assistant":
        reasoning = raw.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise InvalidRow("non-string content", f"{where}.reasoning_content must be a string")
            msg["reasoning_content"] = _text(reasoning, f"{where}.reasoning_content")
        if raw.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(raw["tool_calls"], f"{where}.tool_calls")
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRow("tool message without tool_call_id",
                             f"{where}.tool_call_id is missing or empty; a tool message needs one")
        msg["tool_call_id"] = call_id
    return msg


def _from_sharegpt(turns: list[Any]) -> list[dict[str, Any]]:
    out = []
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise InvalidRow("message not an object", f"{where} is {type(turn).__name__}, expected an object")
        role = SHAREGPT_ROLES.get(turn.get("from"))  # type: ignore[arg-type]
        if role is None:
            raise InvalidRow("unknown role", f"{where}.from: unknown 'from' {turn.get('from')!r}; "
                             f"expected one of {', '.join(SHAREGPT_ROLES)}")
        out.append({"role": role, "content": turn.get("value")})
    return out


def normalise_row(row: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Return ``(messages, tools)`` for a row, or raise :class:`InvalidRow` naming the row's own key
    that is wrong (``messages[2].content``, ``conversations``, ``tools``)."""
    if not isinstance(row, dict):
        raise InvalidRow("row not an object", f"row is {type(row).__name__}, expected a JSON object")
    if "messages" in row and row["messages"] is not None:
        raw = row["messages"]
        if not isinstance(raw, list):
            raise InvalidRow("messages not a list", f"'messages' is {type(raw).__name__}, expected a list")
        messages = [_message(m, f"messages[{i}]") for i, m in enumerate(raw)]
    elif "conversations" in row and row["conversations"] is not None:
        raw = row["conversations"]
        if not isinstance(raw, list):
            raise InvalidRow("messages not a list",
                             f"'conversations' is {type(raw).__name__}, expected a list")
        messages = [_message(m, f"conversations[{i}]", "value") for i, m in enumerate(_from_sharegpt(raw))]
    else:
        raise InvalidRow("missing messages", "row has neither 'messages' nor 'conversations'")
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except json.JSONDecodeError as exc:
            raise InvalidRow("bad tools", f"'tools' is a string but not JSON ({exc})") from exc
    if tools is not None and not isinstance(tools, list):
        raise InvalidRow("bad tools", "'tools' must be a list")
    return messages, (tools or None)
