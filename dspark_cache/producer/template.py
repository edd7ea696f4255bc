"""The chat template argument and the identities the manifest records (template and tokenizer)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """The chat template argument or the tokenizer's template is unusable."""


def resolve_chat_template(arg: str) -> str:
    """Inline Jinja is used as is; otherwise ``arg`` must be a file (raw Jinja or JSON)."""
    if "{%" in arg or "{{" in arg:
        return arg
    if not os.path.isfile(arg):
        raise ChatTemplateError(
            f"--chat-template {arg!r} is neither an existing file nor an inline Jinja template "
            "(no '{%' or '{{' in it); fix the path or pass the template text"
        )
    with open(arg, encoding="utf-8") as handle:
        text = handle.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
        return data["chat_template"]
    return text


def sha256_text(text: str | None) -> str:
    return hashlib.sha256((text or "").encode()).hexdigest()


def tokenizer_sha256(tokenizer: Any) -> str:
    """Identity of the tokenizer's vocabulary, merges, normaliser and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    specials = json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    return hashlib.sha256((body + specials).encode()).hexdigest()
