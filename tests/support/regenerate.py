"""``dspark-regenerate`` as the tests run it: the installed console script in a process of its own,
and the rows it reads and writes."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from tests.support.proc import run, start
from tests.support.warm import BIN

# What every test run asks: short greedy answers, so that a run over the sample data takes about 2 s (the
# server generates one request at a time, ~400 tokens/s). With 8 tokens the stopping target
# (tests.support.serving) still ends about a fifth of the sample data's turns early and cuts the rest.
MAX_TOKENS = 8
BASE = ("--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--no-progress", "--log-level", "WARNING")


def regen_cmd(endpoints: list[str], data: str, out: str, *extra: str) -> list[str]:
    ends = [a for url in endpoints for a in ("--endpoint", url)]
    return [os.path.join(BIN, "dspark-regenerate"), "--input-data", str(data), "--output", str(out), *ends, *BASE,
            *extra]


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
