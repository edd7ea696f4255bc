"""Shared fixtures: the embedded target (both template variants), sample data, a small cache."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True)
class Embedded:
    stock: str  # target dir, stock Qwen3-style template (no generation blocks)
    generation: str  # same weights and tokenizer, template with {% generation %} blocks
    data: str  # sample JSONL


@pytest.fixture(scope="session")
def embedded(tmp_path_factory) -> Embedded:
    from dspark_cache.embedded.data import write_sample_data
    from dspark_cache.embedded.target import build_target

    root = tmp_path_factory.mktemp("embedded")
    stock = build_target(str(root / "stock"), template="stock")
    generation = build_target(str(root / "generation"), template="generation")
    data = write_sample_data(str(root / "data.jsonl"), num_rows=48, seed=3)
    return Embedded(stock, generation, data)


def produce_args(target: str, data: str, out: str, *extra: str) -> list[str]:
    return ["--target-model", target, "--input-data", data, "--output-dir", out, "--device", "cpu",
            "--log-level", "WARNING", *extra]


def run_produce(target: str, data: str, out: str, *extra: str) -> int:
    from dspark_cache.producer.__main__ import main

    return main(produce_args(target, data, out, *extra))


@pytest.fixture(scope="session")
def small_cache(embedded, tmp_path_factory) -> str:
    """48 rows of sample data through the stock target: bf16, seq 512, shards of 8."""
    out = str(tmp_path_factory.mktemp("cache") / "cache")
    code = run_produce(embedded.stock, embedded.data, out, "--seq-length", "512", "--shard-size", "8",
                       "--batch-size", "4")
    assert code == 0
    return out


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


@pytest.fixture(params=["native", "python"])
def executor(request, monkeypatch):
    """Run a test with the native batch filler and with the Python one."""
    if request.param == "native" and os.environ.get("DSPARK_NATIVE") == "0":
        pytest.skip("DSPARK_NATIVE=0: testing the Python filler only")
    monkeypatch.setenv("DSPARK_NATIVE", "1" if request.param == "native" else "0")
    return request.param
