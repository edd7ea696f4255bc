"""The producer's host ring and pipeline on a CPU: bounded host memory, exact bytes, honest
stage times, and no operation in the main loop that would wait for a device."""

from __future__ import annotations

import json
import os
import random
import tarfile
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.paths import CachePaths
from dspark_cache.producer.device.target import TargetError, TargetRunner, resolve_device
from dspark_cache.producer.pipeline.host_ring import ALIGN, HostCopier, HostRing, aligned
from dspark_cache.producer.pipeline.loop import run_pipeline
from dspark_cache.producer.pipeline.writer import NonFiniteError
from dspark_cache.producer.plan.batches import PlannedSample, ShardPlan
from dspark_cache.storage.output import CacheOutput
from tests.support.syncs import HostSyncTrap

HIDDEN = 16
SHAPE = SampleShape((0, 2), 3, HIDDEN, "F32")  # final state (2) is a feature layer


@pytest.mark.parametrize("any_order", [False, True])
def test_ring_regions_never_overlap_and_stay_within_capacity(any_order):
    ring = HostRing(64 * ALIGN, pinned=False)
    rng = random.Random(3)
    held: list = []

    def release_one() -> None:  # writer lanes give regions back in nearly, not exactly, claim order
        ring.release(held.pop(rng.randrange(min(3, len(held))) if any_order else 0))

    for _ in range(3000):
        if held and (rng.random() < 0.5 or ring.inflight > ring.capacity // 2):
            release_one()
            continue
        region = ring.claim(rng.randint(1, 20 * ALIGN), abort=lambda: True)
        if region is None:  # full
            release_one()
            continue
        spans = [(r.start, r.start + r.size) for r in held]
        assert region.start + region.size <= ring.capacity
        assert all(region.start >= end or region.start + region.size <= start for start, end in spans)
        held.append(region)
        assert ring.inflight == sum(r.size for r in held) <= ring.capacity


def test_ring_waits_until_the_oldest_region_is_released():
    ring = HostRing(4 * ALIGN, pinned=False)
    first = ring.claim(3 * ALIGN)
    released = threading.Event()

    def release_later() -> None:
        time.sleep(0.2)
        released.set()
        ring.release(first)

    threading.Thread(target=release_later).start()
    second = ring.claim(2 * ALIGN)  # does not fit before ``first`` goes back
    assert released.is_set() and second is not None and second.start == 0
    assert ring.claim(3 * ALIGN, abort=lambda: True) is None  # full again: an abort gives up
    with pytest.raises(ValueError, match="does not fit"):
        ring.claim(5 * ALIGN)
    with pytest.raises(RuntimeError, match="not held"):
        ring.release(first)  # given back already


def test_a_region_released_early_is_reused_once_the_older_ones_are():
    ring = HostRing(4 * ALIGN, pinned=False)
    old, young = ring.claim(2 * ALIGN), ring.claim(2 * ALIGN)
    ring.release(young)  # a faster lane finished first
    assert ring.inflight == 2 * ALIGN
    assert ring.claim(ALIGN, abort=lambda: True) is None  # its space follows the older region's
    ring.release(old)
    assert ring.inflight == 0 and ring.claim(4 * ALIGN).start == 0


def test_region_views_are_aligned_and_disjoint():
    ring = HostRing(16 * ALIGN, pinned=False)
    shapes = [((3, 5), torch.bfloat16), ((7,), torch.float32), ((2,), torch.bool)]
    region = ring.claim(sum(aligned(int(np.prod(s)) * d.itemsize) for s, d in shapes))
    views = region.views(shapes)
    for view, (shape, dtype) in zip(views, shapes):
        assert view.shape == shape and view.dtype == dtype and view.data_ptr() % ALIGN == 0
    for view, value in zip(views, (1.5, 2.0, True)):
        view.fill_(value)
    assert views[0].float().eq(1.5).all() and views[1].eq(2.0).all() and views[2].all()


# ---------------------------------------------------------------- the pipeline on a fake device

def _plan(lengths: list[list[int]], shard_size: int) -> list[ShardPlan]:
    samples = [PlannedSample(i, np.arange(n, dtype=np.int32) % 97, np.ones(n, dtype=np.uint8))
               for i, n in enumerate(x for batch in lengths for x in batch)]
    batches, cursor = [], 0
    for batch in lengths:
        batches.append(samples[cursor : cursor + len(batch)])
        cursor += len(batch)
    return [
        ShardPlan(i // shard_size, batches[i : i + shard_size]) for i in range(0, len(batches), shard_size)
    ]


class NumberedForward:
    """Fills every real position with (sample id, position): a reused or overwritten region shows."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls = 0

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        b, t = ids.shape
        first_ids = ids[:, :1].float()  # the first token of each sample is its id (see _numbered_plan)
        pos = torch.arange(t, dtype=torch.float32).view(1, t, 1)
        hidden = (first_ids.view(b, 1, 1) * 10000 + pos).expand(b, t, 2 * HIDDEN).contiguous()
        return hidden, None


def _paths(root) -> CachePaths:
    paths = CachePaths(str(root))
    os.makedirs(paths.shards_dir, exist_ok=True)
    return paths


def _numbered_plan(lengths: list[list[int]], shard_size: int) -> list[ShardPlan]:
    shards = _plan(lengths, shard_size)
    for shard in shards:
        for sample in shard.samples:
            sample.input_ids[0] = sample.sample_id
    return shards


def _read_shards(root: str) -> dict[int, torch.Tensor]:
    """Every stored sample's hidden states, read back with the standard library and safetensors."""
    out = {}
    for sid in CachePaths(root).indexed_shard_ids():
        with tarfile.open(CachePaths(root).shard_tar(sid)) as tar:
            for member in tar.getmembers():
                tensors = load_safetensors(tar.extractfile(member).read())
                out[int(member.name.split(".")[0].split("-")[-1])] = tensors["target_hidden_states"]
    return out


@pytest.mark.parametrize("budget_batches,writers", [(1, 1), (3, 1), (3, 3), (1, 2)])
def test_writer_bound_run_keeps_the_rings_bytes_within_budget_and_exact(tmp_path, budget_batches, writers):
    rng = random.Random(budget_batches)
    lengths = [[rng.choice([3, 17, 64, 200, 511]) for _ in range(rng.randint(1, 4))] for _ in range(40)]
    shards = _numbered_plan(lengths, shard_size=4)
    largest = max(sum(aligned(n * 2 * HIDDEN * 4) for n in batch) + ALIGN for batch in lengths)
    budget = budget_batches * largest
    seen: list[tuple[int, int]] = []
    stats = run_pipeline(
        shards,
        NumberedForward(),
        output=CacheOutput(_paths(tmp_path).root),
        shape=SHAPE,
        device=torch.device("cpu"),
        pad_id=0,
        max_inflight_bytes=budget,
        writer_threads=writers,
        on_batch=lambda stats, ring: seen.append((ring.inflight, ring.capacity)),
    )
    assert stats.samples == sum(len(b) for b in lengths)
    capacity = seen[0][1]
    assert capacity <= budget + largest
    assert max(inflight for inflight, _ in seen) <= capacity
    assert stats.times.backpressure > 0  # the writer was the bottleneck: the ring did fill
    stored = _read_shards(str(tmp_path))
    assert len(stored) == stats.samples
    for sid, hidden in stored.items():
        n = hidden.shape[0]
        want = (sid * 10000 + torch.arange(n, dtype=torch.float32)).view(n, 1).expand(n, 2 * HIDDEN)
        assert torch.equal(hidden, want), f"sample {sid} was overwritten while in the ring"


def test_stage_times_add_up_on_a_cpu(tmp_path):
    shards = _numbered_plan([[32, 30]] * 12, shard_size=3)
    forward = NumberedForward(delay=0.02)
    started = time.perf_counter()
    stats = run_pipeline(
        shards,
        forward,
        output=CacheOutput(_paths(tmp_path).root),
        shape=SHAPE,
        device=torch.device("cpu"),
        pad_id=0,
        max_inflight_bytes=1 << 20,
    )
    wall = time.perf_counter() - started
    times = stats.times
    assert 12 * 0.02 <= times.device <= wall  # the forward's own time, every batch
    assert times.copy > 0 and times.write > 0 and times.data > 0
    assert times.wait == 0  # nothing to wait for without a device
    main_thread = times.data + times.device + times.copy + times.backpressure
    assert main_thread <= wall


# ---------------------------------------------------------------- no host syncs, real target

@pytest.fixture(scope="module")
def tiny_target(embedded):
    return embedded.stock


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_pipeline_main_loop_never_waits_for_the_device(tiny_target, tmp_path, attn):
    config = json.load(open(f"{tiny_target}/config.json"))
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    shape = SampleShape((1, layers - 1), layers, hidden, "F32")
    runner = TargetRunner(
        tiny_target, [1, layers - 1], layers, torch.device("cpu"), torch.float32, torch.float32, attn
    )
    assert runner.masks_without_waiting
    shards = _plan([[40, 33], [20], [64, 60, 2]], shard_size=2)
    with HostSyncTrap() as trap:
        run_pipeline(shards, runner.forward, output=CacheOutput(_paths(tmp_path / "ours").root), shape=shape,
                     device=torch.device("cpu"), pad_id=0, max_inflight_bytes=1 << 20)
    assert trap.count == 0, trap.where
    # Control: the model's own masks wait once per forward, and the trap sees it.
    runner.masks_without_waiting = False
    with HostSyncTrap() as trap:
        run_pipeline(
            shards,
            runner.forward,
            output=CacheOutput(_paths(tmp_path / "theirs").root),
            shape=shape,
            device=torch.device("cpu"),
            pad_id=0,
            max_inflight_bytes=1 << 20,
        )
    assert trap.count == 3
    ours, theirs = _read_shards(str(tmp_path / "ours")), _read_shards(str(tmp_path / "theirs"))
    assert ours.keys() == theirs.keys()
    for sid in ours:
        torch.testing.assert_close(ours[sid], theirs[sid], rtol=1e-5, atol=1e-5)


def test_a_mask_mapping_the_model_reads_differently_is_refused(tiny_target, monkeypatch):
    from dspark_cache.producer.device import masks

    # "No mask" means causal to sdpa but bidirectional to eager: the check must catch it.
    monkeypatch.setattr(
        masks.CausalMasks, "mapping", lambda self, b, t, device: {kind: None for kind in self.kinds}
    )
    config = json.load(open(f"{tiny_target}/config.json"))
    layers = config["num_hidden_layers"]
    eager = TargetRunner(tiny_target, [1], layers, torch.device("cpu"), torch.float32, torch.float32, "eager")
    sdpa = TargetRunner(tiny_target, [1], layers, torch.device("cpu"), torch.float32, torch.float32, "sdpa")
    assert not eager.masks_without_waiting and sdpa.masks_without_waiting


def test_device_choices_are_checked(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TargetError, match="every rank on GPU 1"):
        resolve_device("cuda:1")
    with pytest.raises(TargetError, match="not supported|not a device"):
        resolve_device("tpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_the_mask_check_sees_a_wrong_sliding_window(monkeypatch):
    from transformers import Qwen3Config, Qwen3Model

    from dspark_cache.producer.device import masks

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"],
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = Qwen3Model(config).eval()
    checker = masks.CausalMasks(config, torch.float32)
    assert checker.probe_length() > 16 and masks.masks_match(base, checker, 64, torch.device("cpu"))
    # A sliding layer given a full causal mask differs only past the window: the probe must see it.
    builders = masks._mask_builders()
    monkeypatch.setattr(masks, "_mask_builders", lambda: {masks.FULL: builders[masks.FULL],
                                                          masks.SLIDING: builders[masks.FULL]})
    assert not masks.masks_match(base, masks.CausalMasks(config, torch.float32), 64, torch.device("cpu"))


class _SpyCopier(HostCopier):
    """The real copier, noting what crosses to the host: each stored tensor's dtype and the region's bytes."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.crossed: list[tuple[dict[str, torch.dtype], int, int]] = []

    def copy_in(self, region, shapes, names, stored, finite, lengths, clock):
        self.crossed.append(({k: v.dtype for k, v in stored.items()}, region.size, sum(lengths)))
        return super().copy_in(region, shapes, names, stored, finite, lengths, clock)


@pytest.mark.parametrize("code", ["F8_E4M3", "F8_E5M2"])
def test_fp8_codes_and_scales_alone_cross_to_the_host(tmp_path, code):
    """Quantised where the states were computed, before the copy: the host gets one byte a value plus
    a float32 scale per (token, layer), never the 2-4 byte states."""
    h = 256
    shape = SampleShape((0, 1), 3, h, code)  # the final state (2) is stored apart, with its scales
    spy = _SpyCopier()
    forward = lambda ids, mask: (torch.randn(*ids.shape, 2 * h), torch.randn(*ids.shape, h))  # noqa: E731
    shards = _plan([[40, 33], [20], [64, 60, 2]], shard_size=2)
    run_pipeline(
        shards,
        forward,
        output=CacheOutput(_paths(tmp_path).root),
        shape=shape,
        device=torch.device("cpu"),
        pad_id=0,
        max_inflight_bytes=1 << 20,
        copier=spy,
        writer_threads=2,
    )
    fp8 = torch.float8_e4m3fn if code == "F8_E4M3" else torch.float8_e5m2
    for dtypes, nbytes, tokens in spy.crossed:
        assert dtypes == {"target_hidden_states": fp8, "target_hidden_states_scale": torch.float32,
                          "target_last_hidden_states": fp8, "target_last_hidden_states_scale": torch.float32}
        per_token = 3 * h + 4 * 3  # three layers of one-byte codes, three float32 scales
        assert tokens * per_token <= nbytes < tokens * per_token + 16 * ALIGN  # alignment slack only
        assert nbytes < tokens * 3 * h * 2  # less than the bf16 states alone would be


def test_a_ring_too_small_for_the_writers_is_named(tmp_path, caplog):
    shards = _numbered_plan([[200, 190]] * 12, shard_size=3)
    one_batch = sum(aligned(n * 2 * HIDDEN * 4) for n in (200, 190)) + ALIGN
    with caplog.at_level("WARNING", logger="dspark_cache.producer.pipeline.loop"):
        run_pipeline(
            shards,
            NumberedForward(),
            output=CacheOutput(_paths(tmp_path / "small").root),
            shape=SHAPE,
            device=torch.device("cpu"),
            pad_id=0,
            max_inflight_bytes=2 * one_batch,
            writer_threads=3,
        )
    assert "--max-inflight-bytes" in caplog.text and "3 writer threads cannot all be busy" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="dspark_cache.producer.pipeline.loop"):
        run_pipeline(
            shards,
            NumberedForward(),
            output=CacheOutput(_paths(tmp_path / "big").root),
            shape=SHAPE,
            device=torch.device("cpu"),
            pad_id=0,
            max_inflight_bytes=4 * one_batch,
            writer_threads=3,
        )
    assert "cannot all be busy" not in caplog.text


class _SlowPublish(CacheOutput):
    """The n-th shard's publication waits (at most 5 s) until the device has copied batch n + 1 in: a writer
    that kept its batch's ring space through the publication would leave the device none."""

    def __init__(self, root: str, batches: int) -> None:
        super().__init__(root)
        self.copied, self.waited, self.batches = 0, [], batches
        self.cond = threading.Condition()

    def on_batch(self, stats, ring) -> None:
        with self.cond:
            self.copied += 1
            self.cond.notify_all()

    def publish(self, writer, nonfinite=None, published=None):
        with self.cond:
            wanted = min(len(self.waited) + 2, self.batches)  # the last shard has no next batch
            self.waited.append(self.cond.wait_for(lambda: self.copied >= wanted, timeout=5))
        return super().publish(writer, nonfinite, published)


def test_a_publication_does_not_hold_ring_space(tmp_path):
    shards = _numbered_plan([[100]] * 4, shard_size=1)
    output = _SlowPublish(_paths(tmp_path).root, 4)
    run_pipeline(shards, NumberedForward(), output=output, shape=SHAPE, device=torch.device("cpu"), pad_id=0,
                 max_inflight_bytes=aligned(100 * 2 * HIDDEN * 4) + ALIGN, on_batch=output.on_batch)
    # A ring of one batch: the next batch is copied in once this one's bytes are in the file, while its
    # shard is being published.
    assert output.waited == [True] * 4


def test_a_failed_writer_names_its_shard_not_the_device_s(tmp_path):
    shards = _numbered_plan([[30, 20]] * 8, shard_size=2)

    def nan_in_shard_0(ids: torch.Tensor, mask: torch.Tensor):
        hidden, last = NumberedForward()(ids, mask)
        if int(ids[0, 0]) in {s.sample_id for s in shards[0].samples}:
            hidden[0, 0, 0] = float("nan")
        return hidden, last

    seen = []
    with pytest.raises(NonFiniteError, match="shard 0"):
        run_pipeline(shards, nan_in_shard_0, output=CacheOutput(_paths(tmp_path).root), shape=SHAPE,
                     device=torch.device("cpu"), pad_id=0, max_inflight_bytes=1 << 20, writer_threads=3,
                     on_batch=lambda stats, ring: seen.append(stats))
    assert seen[-1].failed_shard == 0
