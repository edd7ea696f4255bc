"""The producer run in this test's process, and the JSONL inputs it reads."""

from __future__ import annotations

import json
import os


def produce_args(target: str, data: str, out: str, *extra: str) -> list[str]:
    """``dspark-produce``'s arguments for a CPU run of ``target`` over ``data`` into ``out``."""
    return ["--target-model", target, "--input-data", data, "--output-dir", out, "--device", "cpu",
            "--log-level", "WARNING", *extra]


def run_produce(target: str, data: str, out: str, *extra: str) -> int:
    """The exit code of the torchrun entry's ``main`` on :func:`produce_args`."""
    from dspark_cache.producer.__main__ import main

    return main(produce_args(target, data, out, *extra))


def write_jsonl(path: str | os.PathLike[str], rows: list) -> str:
    """One line per row: a string as it is, anything else as its JSON."""
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)
