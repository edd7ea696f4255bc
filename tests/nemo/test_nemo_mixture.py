"""NeMo's recipe calls on a mixture file: the run of one cache of the concatenated rows, checks by source."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import dspark_cache
import dspark_cache.nemo as dn
from tests.nemo.test_nemo import _run
from tests.support.produce import run_produce, write_jsonl

ARGS = ("--seq-length", "512", "--shard-size", "8", "--batch-size", "4")  # small_cache's


@pytest.fixture(scope="module")
def halves(embedded, tmp_path_factory) -> list[str]:
    """Two caches of the sample data's first and second 24 rows, produced as small_cache is (FP8 second)."""
    rows = open(embedded.data, encoding="utf-8").read().splitlines()
    root = tmp_path_factory.mktemp("halves")
    out = []
    halves = (("first", rows[:24], ()), ("second", rows[24:], ()), ("fp8", rows[24:], ("--dtype", "fp8")))
    for name, part, extra in halves:
        assert run_produce(embedded.stock, write_jsonl(root / f"{name}.jsonl", part), str(root / name),
                           *ARGS, *extra) == 0
        out.append(str(root / name))
    return out


def mixture_file(tmp_path, *sources: dict, name: str = "mix.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"sources": list(sources)}))
    return str(path)


def test_an_unweighted_mixture_runs_as_one_cache_of_the_concatenated_rows(halves, small_cache, tmp_path):
    """Same batches (ids and masks exact, states to the producer's batching noise), same RNG draws."""
    mix = mixture_file(tmp_path, {"path": halves[0]}, {"path": halves[1]})
    assert dn.read_manifest(mix)["num_samples"] == len(dspark_cache.open_cache(small_cache))
    ours, our_draws = _run(mix, 5, 2, seed=7)
    one, one_draws = _run(small_cache, 5, 2, seed=7)
    assert len(ours) == len(one)
    for a, b in zip(ours, one):
        assert list(a) == list(b) == list(dn.nemo_format.CACHE_KEYS)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("target_hidden_states", "target_last_hidden_states"):
            assert a[key].dtype == b[key].dtype
            torch.testing.assert_close(a[key].float(), b[key].float(), atol=0.05, rtol=0.02)
    assert all(torch.equal(x, y) for x, y in zip(our_draws, one_draws))


def test_weights_set_the_positions(halves, tmp_path):
    n = [len(dspark_cache.open_cache(p)) for p in halves[:2]]
    mix = mixture_file(tmp_path, {"path": halves[0], "repeat": 2}, {"path": halves[1], "choose": 5})
    dataset = dn.MixtureMapDataset(mix)
    assert len(dataset) == 2 * n[0] + 5 == dn.read_manifest(mix)["num_samples"]
    ids, sources = dataset.sample_ids, dataset.source_ids
    first = dspark_cache.open_cache(halves[0]).sample_ids
    assert ids[: 2 * n[0]] == first + first and sources == [0] * 2 * n[0] + [1] * 5
    assert len(set(ids[2 * n[0]:])) == 5 and ids[2 * n[0]:] == sorted(ids[2 * n[0]:])


def test_the_manifest_shows_what_the_sources_share_and_fp8_is_read_as_training_computes(halves, tmp_path):
    mix = mixture_file(tmp_path, {"path": halves[0]}, {"path": halves[2]})
    if torch.cuda.is_available():  # pragma: no cover - the FP8 source is read as bf16, as the other is
        assert dn.read_manifest(mix)["dtype"] == "bf16"
        return
    # On CPU the recipe computes in fp32: the FP8 source is read as fp32, the bf16 one is bf16.
    with pytest.raises(ValueError, match=r"source 1 .*dtype: training reads it as fp32 but source 0 .* bf16"):
        dn.read_manifest(mix)
    fp8_only = mixture_file(tmp_path, {"path": halves[2]}, {"path": halves[2], "choose": 3}, name="fp8.json")
    fields = dn.read_manifest(fp8_only)
    assert fields["dtype"] == "fp32" and fields["stored_dtype"] == ["fp8", "fp8"]
    batch = next(iter(dn.build_cached_dspark_dataloader(cache_dir=fp8_only, batch_size=2, shuffle=False)))
    assert batch["target_hidden_states"].dtype == torch.float32


def test_mixture_of_caches_of_other_targets_is_refused(halves, small_cache, produced, tmp_path):
    other = produced(*ARGS[:2], "--shard-size", "8", "--batch-size", "4", "--target-layer-ids", "1,2")
    mix = mixture_file(tmp_path, {"path": halves[0]}, {"path": other})
    fields = dn.read_manifest(mix)  # the layers both hold
    assert fields["target_layer_ids"] == [1, 2] and fields["target_hidden_dim"] == 2 * fields["hidden_size"]
    seq = produced("--seq-length", "256", "--shard-size", "8", "--batch-size", "4")
    with pytest.raises(ValueError, match=r"source 1 .*: seq_length is 256 but source 0"):
        dn.read_manifest(mixture_file(tmp_path, {"path": halves[0]}, {"path": seq}, name="seq.json"))


def test_the_recipes_layer_check_and_loader_on_a_mixture(halves, produced, tmp_path, embedded):
    """The recipe's check sees the layers every source holds and the loader hands out the recipe's."""
    other = produced(*ARGS, "--target-layer-ids", "1,2")
    mix = mixture_file(tmp_path, {"path": halves[0]}, {"path": other})
    fields = dn.read_manifest(mix)
    config = SimpleNamespace(hidden_size=fields["hidden_size"], vocab_size=fields["target_vocab_size"],
                             num_hidden_layers=fields["num_hidden_layers"])
    dn.validate_cached_dspark_manifest(mix, fields, config, [2], target_model=fields["target_model"],
                                       target_model_type=fields["target_model_type"], seq_length=512,
                                       compute_dtype=torch.bfloat16)
    batch = next(iter(dn.build_cached_dspark_dataloader(cache_dir=mix, batch_size=3, shuffle=False)))
    assert batch["target_hidden_states"].shape[-1] == fields["hidden_size"]
    embed, head = dn.read_target_weight_modules(mix)
    assert embed.weight.shape[-1] == fields["hidden_size"]


def test_worker_processes_give_the_same_run(halves, tmp_path):
    mix = mixture_file(tmp_path, {"path": halves[0], "repeat": 1.5}, {"path": halves[1]})
    plain, plain_draws = _run(mix, 6, 1, seed=11)
    workers, worker_draws = _run(mix, 6, 1, seed=11, num_workers=2)
    assert len(plain) == len(workers)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(plain, workers) for k in a)
    assert all(torch.equal(x, y) for x, y in zip(plain_draws, worker_draws))
