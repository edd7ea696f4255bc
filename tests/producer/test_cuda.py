"""The CUDA path: side-stream copies to pinned memory, and pinned loader batches.

CI has no GPU, so these run only where one is visible (a GPU machine, or a session lent one).
The CPU cache of the same rows is the reference.
"""

from __future__ import annotations

import pytest
import torch

import dspark_cache
from tests.support.produce import run_produce

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

COMMON = (
    "--seq-length",
    "512",
    "--shard-size",
    "8",
    "--batch-size",
    "4",
    "--compute-dtype",
    "fp32",
    "--dtype",
    "fp32",
)


# The default ids contain the final state (the target returns no separate last state: the
# case a CUDA-only bug once crashed on); explicit ids without N-1 store it separately.
@pytest.mark.parametrize("layer_ids", [(), ("1", "3", "5")], ids=["final-in-ids", "final-separate"])
def test_cuda_cache_equals_cpu_cache(embedded, tmp_path, layer_ids):
    extra = ("--target-layer-ids", *layer_ids) if layer_ids else ()
    cpu, gpu = str(tmp_path / "cpu"), str(tmp_path / "gpu")
    assert run_produce(embedded.stock, embedded.data, cpu, *COMMON, *extra) == 0
    assert run_produce(embedded.stock, embedded.data, gpu, *COMMON, *extra, "--device", "cuda") == 0
    want, got = list(dspark_cache.open_cache(cpu).samples()), list(dspark_cache.open_cache(gpu).samples())
    assert [s["sample_id"] for s in got] == [s["sample_id"] for s in want]
    for a, b in zip(want, got):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("target_hidden_states", "target_last_hidden_states"):
            torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=1e-3)


def test_pinned_batches_are_exact(embedded, tmp_path):
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, embedded.data, out, *COMMON) == 0
    by_id = {s["sample_id"]: s for s in dspark_cache.open_cache(out).samples()}
    loader = dspark_cache.build_dataloader(out, 3, seed=1, pin_memory=True)
    for _ in range(2):
        for batch in loader:
            assert batch["target_hidden_states"].is_pinned()
            for row, sid in enumerate(batch["sample_ids"].tolist()):
                n = by_id[sid]["input_ids"].shape[0]
                for key in ("target_hidden_states", "target_last_hidden_states"):
                    assert torch.equal(batch[key][row, :n], by_id[sid][key])
                    assert not batch[key][row, n:].any()
            on_device = batch["target_hidden_states"].to("cuda", non_blocking=True)
            assert torch.equal(on_device.cpu(), batch["target_hidden_states"])


# ---------------------------------------------------------------- the default bf16 path

def test_bf16_default_path_matches_cpu_bf16(embedded, tmp_path):
    """No dtype flags: what a user on a GPU runs (bf16 compute, bf16 cache)."""
    base = ("--seq-length", "512", "--shard-size", "8", "--batch-size", "4")
    cpu, gpu = str(tmp_path / "cpu"), str(tmp_path / "gpu")
    assert run_produce(embedded.stock, embedded.data, cpu, *base, "--compute-dtype", "bf16") == 0
    assert run_produce(embedded.stock, embedded.data, gpu, *base, "--device", "cuda") == 0
    want, got = list(dspark_cache.open_cache(cpu).samples()), list(dspark_cache.open_cache(gpu).samples())
    assert [s["sample_id"] for s in got] == [s["sample_id"] for s in want]
    for a, b in zip(want, got):
        assert b["target_hidden_states"].dtype == torch.bfloat16
        assert torch.equal(a["input_ids"], b["input_ids"])
        diff = (a["target_hidden_states"].float() - b["target_hidden_states"].float()).abs()
        assert diff.mean() < 0.02 and diff.max() < 0.5  # bf16 kernels differ by rounding, not by meaning


def test_the_rings_batches_survive_the_next_forward(tmp_path):
    """Every batch filled with its own number: a region or device buffer reused too early shows."""
    import itertools

    import numpy as np

    from dspark_cache.format.geometry import SampleShape
    from dspark_cache.storage.output import CacheOutput
    from dspark_cache.format.paths import CachePaths
    from dspark_cache.producer.pipeline.loop import run_pipeline
    from dspark_cache.producer.plan.batches import PlannedSample, ShardPlan
    from tests.producer.test_host_ring import _read_shards

    rng = np.random.default_rng(0)
    samples = [PlannedSample(i, np.zeros(int(n), np.int32), np.ones(int(n), np.uint8))
               for i, n in enumerate(rng.integers(64, 1024, 96))]
    batches = [samples[i : i + 8] for i in range(0, len(samples), 8)]
    shards = [ShardPlan(i // 3, batches[i : i + 3]) for i in range(0, len(batches), 3)]
    counter = itertools.count(1)

    def numbered(ids, mask):
        return torch.full(
            (*ids.shape, 5 * 512), float(next(counter)), dtype=torch.bfloat16, device=ids.device
        ), None

    paths = CachePaths(str(tmp_path))
    import os

    os.makedirs(paths.shards_dir)
    run_pipeline(
        shards,
        numbered,
        output=CacheOutput(paths.root),
        shape=SampleShape((0, 1, 2, 3, 4), 5, 512, "BF16"),
        device=torch.device("cuda"),
        pad_id=0,
        max_inflight_bytes=32 << 20,
        check_finite=False,
    )
    stored = _read_shards(str(tmp_path))
    assert len(stored) == len(samples)
    for sid, hidden in stored.items():
        assert bool((hidden.float() == sid // 8 + 1).all()), f"sample {sid} holds another batch's values"


def test_pinned_batches_dropped_mid_copy_stay_intact(small_cache):
    """Copies queued behind device work, batches dropped at once: recycled pinned memory must wait."""
    want = [{k: v.clone() for k, v in b.items() if torch.is_tensor(v)}
            for b in dspark_cache.build_dataloader(small_cache, 3, seed=2, pin_memory=False)]
    loader = dspark_cache.build_dataloader(small_cache, 3, seed=2, pin_memory=True)
    got = []
    for batch in loader:
        assert all(v.is_pinned() for v in batch.values() if torch.is_tensor(v))
        torch.cuda._sleep(2_000_000)
        got.append({k: v.to("cuda", non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)})
        del batch
    torch.cuda.synchronize()
    assert len(got) == len(want)
    for a, b in zip(want, got):
        for key in a:
            assert torch.equal(a[key], b[key].cpu()), key


def test_producer_loop_has_no_host_sync(embedded, tmp_path):
    import json
    import warnings

    from dspark_cache.format.geometry import SampleShape
    from dspark_cache.storage.output import CacheOutput
    from dspark_cache.format.paths import CachePaths
    from dspark_cache.producer.pipeline.loop import run_pipeline
    from tests.support.syncs import HostSyncTrap
    from dspark_cache.producer.device.target import TargetRunner
    from tests.producer.test_host_ring import _plan

    layers = json.load(open(f"{embedded.stock}/config.json"))["num_hidden_layers"]
    hidden = json.load(open(f"{embedded.stock}/config.json"))["hidden_size"]
    device = torch.device("cuda")
    runner = TargetRunner(embedded.stock, [1, layers - 1], layers, device, torch.bfloat16, torch.bfloat16)
    assert runner.masks_without_waiting
    paths = CachePaths(str(tmp_path))
    import os

    os.makedirs(paths.shards_dir)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, HostSyncTrap() as trap:
            warnings.simplefilter("always")
            run_pipeline(
                _plan([[40, 33], [20], [64, 60, 2]] * 4, 3),
                runner.forward,
                output=CacheOutput(paths.root),
                shape=SampleShape((1, layers - 1), layers, hidden, "BF16"),
                device=device,
                pad_id=0,
                max_inflight_bytes=1 << 20,
            )
        syncs = [f"{os.path.basename(w.filename)}:{w.lineno} {w.message}" for w in caught
                 if "synchroniz" in str(w.message)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert trap.count == 0, trap.where
    # The writer thread waits for each batch's copy (writer.py) by design; nothing else may sync.
    assert [s for s in syncs if not s.startswith("writer.py")] == [], syncs


def test_a_pinned_slab_is_not_recycled_under_a_pending_copy():
    from dspark_cache.loader import memory

    fields = (memory.Field("x", 1 << 18, torch.float32, False),)

    def wrong_copies() -> int:
        pool = memory.BatchMemory(fields, 16, pinned=True, keep=1)
        wrong = 0
        for i in range(10):
            view = pool.take(16, 1).views(16, 1)["x"]
            view.fill_(float(i))
            torch.cuda._sleep(5_000_000)
            copied = view.to("cuda", non_blocking=True)
            del view
            again = pool.take(16, 1).views(16, 1)["x"]
            again.fill_(-1.0)
            del again
            torch.cuda.synchronize()
            wrong += int(not bool((copied == float(i)).all()))
        return wrong

    assert wrong_copies() == 0
    original = memory.Slab.reusable
    memory.Slab.reusable = lambda self, stream=None: self.idle()  # without the fence the test must fail
    try:
        assert wrong_copies() > 0
    finally:
        memory.Slab.reusable = original
