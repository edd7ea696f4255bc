"""``dspark-regenerate`` as the tests run it: the installed console script in a process of its own,
and the rows it reads and writes."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.support.faultproxy import FaultProxy, matching
from tests.support.ports import free_port
from tests.support.proc import run, start
from tests.support.warm import BIN

CHAT = matching(method="POST", suffix="/v1/chat/completions")
MODELS = matching(method="GET", suffix="/v1/models")

# What every test run asks: short greedy answers, so that a run over the sample data takes about 2 s (the
# server generates one request at a time, ~400 tokens/s). With 8 tokens the stopping target
# (tests.support.serving) still ends about a fifth of the sample data's turns early and cuts the rest.
MAX_TOKENS = 8
BASE = ("--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--no-progress", "--log-level", "WARNING")


def regen_cmd(endpoints: list[str], data: str, out: str, *extra: str) -> list[str]:
    ends = [a for url in endpoints for a in ("--endpoint", url)]
    return [
        os.path.join(BIN, "dspark-regenerate"),
        "--input-data",
        str(data),
        "--output",
        str(out),
        *ends,
        *BASE,
        *extra,
    ]


def regenerate(endpoints: list[str], data: str, out: str, *extra: str, timeout: float = 300,
               env: dict | None = None) -> subprocess.CompletedProcess:
    return run(regen_cmd(endpoints, data, out, *extra), env=env, timeout=timeout)


def start_regenerate(endpoints: list[str], data: str, out: str, *extra: str):
    return start(regen_cmd(endpoints, data, out, *extra))


def read_jsonl(path: str) -> list[Any]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def count_lines(path: str) -> int:
    try:
        with open(path, "rb") as handle:
            return handle.read().count(b"\n")
    except FileNotFoundError:
        return 0


def completion(model: str, content: str, tokens: int = 3) -> dict[str, Any]:
    """A chat completion as an OpenAI-compatible server answers one."""
    return {"object": "chat.completion", "model": model, "usage": {"completion_tokens": tokens},
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}]}


@contextmanager
def canned_endpoint(model: str = "canned/model", content: str = "a canned answer") -> Iterator[FaultProxy]:
    """The fault proxy as an OpenAI-compatible server with nothing behind it (its upstream port is free): it
    lists ``model`` and answers every chat completion ``content``. For what happens around the requests (the
    output's files, a full disk); faults go ahead of the canned answers (``fail_next(..., first=True)``)."""
    with FaultProxy("127.0.0.1", free_port(), dialect="openai") as proxy:
        proxy.fail_next(None, "answer", match=MODELS, body={"object": "list", "data": [{"id": model}]})
        proxy.fail_next(None, "answer", match=CHAT, body=completion(model, content))
        yield proxy
