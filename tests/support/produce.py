"""The producer run in this test's process, and the JSONL inputs it reads."""

from __future__ import annotations

import json
import os


def produce_args(target: str, data: str, out: str, *extra: str) -> list[str]:
    """``dspark-produce``'s arguments for a CPU run of ``target`` over ``data`` into ``out``."""
    return ["--target-model", target, "--input-data", data, "--output-dir", out, "--device", "cpu",
            "--log-level", "WARNING", *extra]


def small_run(shard_size: int, batch_size: int, *extra: str, dtype: str | None = "fp32") -> tuple[str, ...]:
    """The options of the tests' small CPU runs: 256-token rows, these shard and batch sizes, rows encoded
    in the process (no worker pool), ``dtype`` stored (``None``: the default)."""
    stored = ("--dtype", dtype) if dtype else ()
    return ("--seq-length", "256", "--shard-size", str(shard_size), "--batch-size", str(batch_size), *stored,
            "--num-workers", "0", *extra)


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
