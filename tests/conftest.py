"""Shared fixtures: the embedded target (both template variants), sample data, its tokenizers, and
the caches the producer writes from them (each made once a session, read-only to the tests)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import pytest

# Set before anything imports torch or transformers (the imports below may).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread per test process (inherited by the producers, ranks and workers they start):
# the suite runs in xdist workers on two cores, and OpenMP threads spinning on the core another
# worker needs cost about a third of the suite's CPU time, for no speed.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.support.produce import run_produce  # noqa: E402
from tests.support.s3server import s3_bucket, s3_env, s3_server  # noqa: E402,F401  (fixtures)


@dataclass(frozen=True)
class Embedded:
    stock: str  # target dir, stock Qwen3-style template (no generation blocks)
    generation: str  # same weights and tokenizer, template with {% generation %} blocks
    data: str  # sample JSONL


class Tokenizers(NamedTuple):
    stock: Any  # transformers' tokenizer of Embedded.stock
    generation: Any  # of Embedded.generation


@contextlib.contextmanager
def once_per_session(
    tmp_path_factory: pytest.TempPathFactory, name: str
) -> Iterator[tuple[pathlib.Path, bool]]:
    """``(directory, done)``: a directory every xdist worker of this session shares (the process's own
    without xdist), held under a lock while the caller fills it; ``done`` when a worker already has."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path, marker = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = marker.exists()
        if not done and path.exists():  # a worker's build that failed half-way
            shutil.rmtree(path)
        yield path, done
        marker.touch()


@pytest.fixture(scope="session")
def embedded(tmp_path_factory) -> Embedded:
    """Built once for the whole session, whatever the number of workers: read-only to every test."""
    with once_per_session(tmp_path_factory, "embedded") as (root, done):
        made = Embedded(str(root / "stock"), str(root / "generation"), str(root / "data.jsonl"))
        if not done:
            from dspark_cache.embedded.data import write_sample_data
            from dspark_cache.embedded.target import build_target

            build_target(made.stock, template="stock")
            build_target(made.generation, template="generation")
            write_sample_data(made.data, num_rows=48, seed=3)
    return made


@pytest.fixture(scope="session")
def tokenizers(embedded) -> Tokenizers:
    from transformers import AutoTokenizer

    return Tokenizers(
        AutoTokenizer.from_pretrained(embedded.stock), AutoTokenizer.from_pretrained(embedded.generation)
    )


@pytest.fixture(scope="session")
def produced(embedded, tmp_path_factory) -> Callable[..., str]:
    """``produced(*args)``: the cache one in-process producer writes from the sample data through the
    stock target with ``args``, made the first time a test asks for those arguments."""
    caches: dict[tuple[str, ...], str] = {}

    def cache(*args: str) -> str:
        if args not in caches:
            out = str(tmp_path_factory.mktemp("produced") / "cache")
            assert run_produce(embedded.stock, embedded.data, out, *args) == 0
            caches[args] = out
        return caches[args]

    return cache


@pytest.fixture
def reference(produced, request) -> str:
    """The single-process cache for the test module's ``ARGS``: what its other runs must equal."""
    return produced(*request.module.ARGS)


@pytest.fixture(scope="session")
def small_cache(produced) -> str:
    """48 rows of sample data through the stock target: bf16, seq 512, shards of 8."""
    return produced("--seq-length", "512", "--shard-size", "8", "--batch-size", "4")


@pytest.fixture(params=["native", "python"])
def executor(request, monkeypatch):
    """Run a test with the native batch filler and with the Python one."""
    if request.param == "native" and os.environ.get("DSPARK_NATIVE") == "0":
        pytest.skip("DSPARK_NATIVE=0: testing the Python filler only")
    monkeypatch.setenv("DSPARK_NATIVE", "1" if request.param == "native" else "0")
    return request.param

