"""The CUDA path: side-stream copies to pinned memory, and pinned loader batches.

CI has no GPU, so these run only where one is visible (a GPU machine, or a session lent one).
The CPU cache of the same rows is the reference.
"""

from __future__ import annotations

import pytest
import torch

import dspark_cache
from tests.conftest import run_produce

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

COMMON = ("--seq-length", "512", "--shard-size", "8", "--batch-size", "4", "--compute-dtype", "fp32", "--dtype", "fp32")


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
