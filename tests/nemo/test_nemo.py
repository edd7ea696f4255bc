"""``dspark_cache.nemo``: NeMo 0.7.0's recipe calls, checked against a NeMo cache of the same samples."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import dspark_cache
import dspark_cache.nemo as dn
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.manifest import read_manifest, write_manifest
from dspark_cache.nemo import nemo_format
from tests.support.nemo_fixture import NEMO_FIELDS, write_nemo_cache

FIELD_TYPES = {
    "target_model": str,
    "target_model_type": str,
    "target_vocab_size": int,
    "hidden_size": int,
    "num_hidden_layers": int,
    "seq_length": int,
    "dtype": str,
    "num_samples": int,
    "shard_size": int,
    "target_hidden_dim": int,
    "target_last_hidden_dim": int,
    "target_layer_ids": list,
    "train_data_path": str,
    "shuffle_seed": int,
    "mask_reasoning_content": bool,
    "mask_generation_prompt": bool,
    "chat_template_sha256": str,
}


@pytest.fixture(scope="module")
def nemo_cache(small_cache, tmp_path_factory) -> str:
    return write_nemo_cache(small_cache, str(tmp_path_factory.mktemp("nemo") / "cache"), shard_size=8)


def _copy(src: str, tmp_path, name: str = "c") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


# -- read_manifest ----------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["ours", "nemo"])
def test_read_manifest_is_nemos_dict(which, small_cache, nemo_cache):
    manifest = dn.read_manifest(small_cache if which == "ours" else nemo_cache)
    assert isinstance(manifest, dict)
    for field in NEMO_FIELDS:
        assert field in manifest, field
        assert isinstance(manifest[field], FIELD_TYPES.get(field, object)), field
    assert manifest["train_split"] is None and manifest["complete"] is True
    assert manifest["num_samples"] == len(dspark_cache.open_cache(small_cache))
    assert all(isinstance(i, int) for i in manifest["target_layer_ids"])


def test_nemo_manifest_gets_nemos_defaults(nemo_cache, tmp_path):
    copy = _copy(nemo_cache, tmp_path)
    path = nemo_format.manifest_path(copy)
    data = json.load(open(path))
    # an older NeMo cache
    del data["mask_generation_prompt"], data["mask_reasoning_content"], data["complete"]
    json.dump(data, open(path, "w"))
    manifest = dn.read_manifest(copy)
    assert manifest["mask_generation_prompt"] is False and manifest["mask_reasoning_content"] is False
    assert "complete" not in manifest  # a legacy cache without the marker is accepted, as NeMo


@pytest.mark.parametrize("which", ["ours", "nemo"])
def test_incomplete_cache_is_a_value_error(which, small_cache, nemo_cache, tmp_path):
    copy = _copy(small_cache if which == "ours" else nemo_cache, tmp_path)
    if which == "ours":
        paths = CachePaths(copy)
        manifest = read_manifest(paths.root)
        manifest.complete = False
        write_manifest(paths, manifest)
    else:
        data = json.load(open(nemo_format.manifest_path(copy)))
        data["complete"] = False
        json.dump(data, open(nemo_format.manifest_path(copy), "w"))
    with pytest.raises(ValueError, match="(?i)incomplete"):
        dn.read_manifest(copy)
    with pytest.raises(ValueError, match="(?i)incomplete"):
        dn.build_cached_dspark_dataloader(cache_dir=copy, batch_size=2, shuffle=False)
    assert dn.read_manifest(copy, allow_incomplete=True)["complete"] is False


def test_missing_cache_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="dspark-produce"):
        dn.read_manifest(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        dn.read_target_weight_modules(str(tmp_path))


def test_nemo_cache_with_another_version_is_refused_as_nemo_does(nemo_cache, tmp_path):
    copy = _copy(nemo_cache, tmp_path)
    os.unlink(nemo_format.manifest_path(copy))  # shards but no manifest: NeMo's format, unreadable
    with pytest.raises(FileNotFoundError, match="manifest not found"):
        dn.read_manifest(copy)


def test_our_manifest_is_never_taken_for_nemos(small_cache, nemo_cache):
    """NeMo's reader accepts exactly ``format_version == 1``; ours must fail that test, and ours must
    recognise NeMo's and say what to do with it."""
    ours = json.load(open(CachePaths(small_cache).manifest))
    assert ours["format_version"] != 1 and isinstance(ours["format_version"], str)
    with pytest.raises(dspark_cache.format.errors.CacheError, match="NeMo Automodel cache.*dspark-convert"):
        dspark_cache.open_cache(nemo_cache)


def test_legacy_dspark_manifest_gets_a_clear_message(small_cache, tmp_path):
    copy = _copy(small_cache, tmp_path)
    path = CachePaths(copy).manifest
    data = json.load(open(path))
    data.update(format_version=1, cache_format="dspark-wds")  # what dspark-cache 0.1 wrote
    json.dump(data, open(path, "w"))
    with pytest.raises(dspark_cache.format.errors.CacheError, match="dspark-cache 0.1.*--overwrite"):
        dspark_cache.open_cache(copy)
    with pytest.raises(ValueError, match="dspark-cache 0.1"):
        dn.read_manifest(copy)


# -- target weights ---------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["ours", "nemo"])
def test_target_weight_modules(which, small_cache, nemo_cache, embedded):
    embed, head = dn.read_target_weight_modules(small_cache if which == "ours" else nemo_cache)
    model = AutoModelForCausalLM.from_pretrained(embedded.stock, dtype=torch.float32)
    assert torch.equal(embed.weight, model.get_input_embeddings().weight.to(torch.bfloat16))
    assert torch.equal(head.weight, model.get_output_embeddings().weight.to(torch.bfloat16))


# -- validation -------------------------------------------------------------------------------


def _validate(manifest, **change):
    config = SimpleNamespace(hidden_size=manifest["hidden_size"], vocab_size=manifest["target_vocab_size"],
                             num_hidden_layers=manifest["num_hidden_layers"])
    kwargs = dict(target_model=manifest["target_model"], target_model_type=manifest["target_model_type"],
                  seq_length=manifest["seq_length"], compute_dtype=torch.bfloat16)
    layer_ids = change.pop("layer_ids", manifest["target_layer_ids"])
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if key in change:
            setattr(config, key, change.pop(key))
    cache_dir = change.pop("cache_dir", "CACHE")
    kwargs.update(change)
    dn.validate_cached_dspark_manifest(cache_dir, manifest, config, layer_ids, **kwargs)


@pytest.mark.parametrize("change, field", [
    ({"target_model_type": "llama"}, "target_model_type"),
    ({"vocab_size": 7}, "target_vocab_size"),
    ({"hidden_size": 32}, "hidden_size"),
    ({"num_hidden_layers": 9}, "num_hidden_layers"),
    ({"seq_length": 1024}, "seq_length"),
    ({"compute_dtype": torch.float32}, "fp32"),
    ({"layer_ids": [0, 1]}, r"holds target_layer_ids=\[1, 2, 4, 6, 7\].*requested target_layer_ids=\[0, 1\]"),
    ({"layer_ids": [0, 1, 2, 3, 4]}, "target_layer_ids"),
])
def test_validation_names_the_field(small_cache, change, field):
    manifest = dn.read_manifest(small_cache)
    _validate(manifest)  # the cache's own settings pass
    with pytest.raises(ValueError, match=field):
        _validate(manifest, **change)


def test_a_recipe_takes_its_layers_from_a_cache_that_holds_more(small_cache, nemo_cache, caplog):
    """A drafter of depth 2 (NeMo's spread [1, 7]) from a cache made for depth 5 ([1, 2, 4, 6, 7]):
    the check accepts the subset and the recipe's dataloader hands out exactly those layers."""
    manifest = dn.read_manifest(small_cache)
    stored, wanted = manifest["target_layer_ids"], [1, 7]
    assert stored == [1, 2, 4, 6, 7]
    with caplog.at_level(logging.INFO):
        _validate(manifest, layer_ids=wanted, cache_dir=small_cache)
    assert "training on [1, 7]" in caplog.text
    try:
        picked, _ = _run(small_cache, 5, 1, seed=3)
        _validate(manifest, cache_dir=small_cache)  # the cache's own layers again: all of them
        whole, _ = _run(small_cache, 5, 1, seed=3)
    finally:
        _validate(manifest, cache_dir=small_cache)
    h = manifest["hidden_size"]
    for a, b in zip(whole, picked, strict=True):
        assert b["target_hidden_states"].shape[-1] == 2 * h
        columns = a["target_hidden_states"].unflatten(-1, (-1, h))[:, :, [0, 4]].flatten(-2)
        assert torch.equal(columns, b["target_hidden_states"])
        assert torch.equal(a["target_last_hidden_states"], b["target_last_hidden_states"])
    with pytest.raises(ValueError, match=r"holds target_layer_ids=\[1, 2, 4, 6, 7\].*requested .*\[1, 3\]"):
        _validate(manifest, layer_ids=[1, 3], cache_dir=small_cache)
    # refused by the check, not later
    with pytest.raises(ValueError, match=r"layer ids \[1\] more than once"):
        _validate(manifest, layer_ids=[1, 1], cache_dir=small_cache)
    _validate({**manifest, "cache_id": "another"}, layer_ids=wanted, cache_dir=small_cache + "/")
    # a check of another cache at that place: not this one's layers
    again, _ = _run(small_cache, 5, 1, seed=3)
    assert again[0]["target_hidden_states"].shape[-1] == 5 * h
    _validate(manifest, cache_dir=small_cache)
    with pytest.raises(ValueError, match="target_hidden_dim"):  # NeMo's cache: exactly its layers, as in NeMo
        _validate(dn.read_manifest(nemo_cache), layer_ids=wanted, cache_dir=nemo_cache)


def test_validation_only_warns_on_target_path(small_cache, caplog):
    manifest = dn.read_manifest(small_cache)
    with caplog.at_level(logging.WARNING):
        _validate(manifest, target_model="/elsewhere/Qwen3")
    assert "target_model" in caplog.text


def test_validation_refuses_unknown_dtype(small_cache):
    manifest = {**dn.read_manifest(small_cache), "dtype": "int4"}
    with pytest.raises(ValueError, match="unsupported dtype"):
        _validate(manifest)


# -- the loader: same batches, same order, same RNG draws -------------------------------------


def _run(cache_dir: str, batch_size: int, epochs: int, seed: int, **kwargs) -> tuple[list, list]:
    """Batches of ``epochs`` epochs and a draw from the global RNG after each (what the recipe does)."""
    torch.manual_seed(seed)
    loader = dn.build_cached_dspark_dataloader(
        cache_dir=cache_dir, batch_size=batch_size, shuffle=True, **kwargs
    )
    batches, draws = [], []
    for _ in range(epochs):
        for batch in loader:
            batches.append({k: v.clone() for k, v in batch.items()})
            draws.append(torch.rand(3))
    return batches, draws


def test_same_run_as_nemo_cache(small_cache, nemo_cache):
    ours, our_draws = _run(small_cache, 5, 2, seed=7)
    nemo, nemo_draws = _run(nemo_cache, 5, 2, seed=7)
    assert len(ours) == len(nemo) == 2 * -(-len(dspark_cache.open_cache(small_cache)) // 5)
    for a, b in zip(ours, nemo):
        assert (
            list(a)
            == list(b)
            == ["input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"]
        )
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert all(torch.equal(x, y) for x, y in zip(our_draws, nemo_draws))


def test_reads_one_batch_ahead_without_workers(small_cache):
    loader = dn.build_cached_dspark_dataloader(cache_dir=small_cache, batch_size=4, shuffle=False)
    assert isinstance(loader, torch.utils.data.DataLoader)
    iterator = iter(loader)
    first = next(iterator)
    assert iterator._ahead is not None  # the second batch is being read while the first is used
    dataset = dn.DSparkMapDataset(small_cache)
    assert torch.equal(
        next(iterator)["input_ids"], torch.stack([dataset[i]["input_ids"] for i in range(4, 8)])
    )
    assert first["input_ids"].shape[0] == 4


def test_order_is_torch_dataloaders(small_cache):
    """The position order equals a plain torch DataLoader's over range(n) with the same seed."""
    n = len(dspark_cache.open_cache(small_cache))
    dataset = dn.DSparkMapDataset(small_cache)
    id_of = {tuple(dataset[i]["input_ids"][:16].tolist()): i for i in range(n)}
    batches, _ = _run(small_cache, 4, 1, seed=3)
    torch.manual_seed(3)
    want = [b.tolist() for b in torch.utils.data.DataLoader(list(range(n)), batch_size=4, shuffle=True)]
    assert [[id_of[tuple(r[:16].tolist())] for r in b["input_ids"]] for b in batches] == want


def test_positions_follow_ascending_sample_id(small_cache):
    cache = dspark_cache.open_cache(small_cache)
    dataset = dn.DSparkMapDataset(small_cache)
    assert dataset.sample_ids == cache.sample_ids == sorted(cache.sample_ids)
    for position in (0, 13, len(cache) - 1):
        want = cache.read(position)
        n = want["input_ids"].shape[0]
        got = dataset[position]
        assert torch.equal(got["input_ids"][:n], want["input_ids"].long())
        assert torch.equal(got["target_hidden_states"][:n], want["target_hidden_states"])
    with pytest.raises(IndexError):
        dataset[len(cache)]


def test_worker_processes_give_the_same_run(small_cache):
    plain, plain_draws = _run(small_cache, 6, 1, seed=11)
    workers, worker_draws = _run(small_cache, 6, 1, seed=11, num_workers=2)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(plain, workers) for k in a)
    assert all(torch.equal(x, y) for x, y in zip(plain_draws, worker_draws))


DISTRIBUTED = r"""
import json, sys, torch, torch.distributed as dist
import dspark_cache.nemo as dn
dist.init_process_group("gloo")
out = {}
for name, path in (("ours", sys.argv[1]), ("nemo", sys.argv[2])):
    torch.manual_seed(5)
    loader = dn.build_cached_dspark_dataloader(cache_dir=path, batch_size=4, shuffle=True, distributed=True)
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        epochs.append([b["input_ids"][:, :12].tolist() for b in loader])
    out[name] = {"epochs": epochs, "len": len(loader), "draw": torch.rand(2).tolist()}
json.dump(out, open(sys.argv[3] + f".{dist.get_rank()}", "w"))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_distributed_sampler_semantics(small_cache, nemo_cache, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(DISTRIBUTED)
    out = str(tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    str(script), small_cache, nemo_cache, out], check=True, env=env, timeout=300,
                   capture_output=True)
    ranks = [json.load(open(f"{out}.{r}")) for r in range(2)]
    n = len(dspark_cache.open_cache(small_cache))
    for rank in ranks:
        assert rank["ours"] == rank["nemo"]  # batches, len and RNG state after two epochs
        assert rank["ours"]["len"] == -(-(-(-n // 2)) // 4)
    epoch0 = [row for rank in ranks for batch in rank["ours"]["epochs"][0] for row in batch]
    assert len(epoch0) == 2 * -(-n // 2)  # DistributedSampler pads to a multiple of the world size
    assert ranks[0]["ours"]["epochs"][0] != ranks[0]["ours"]["epochs"][1]  # set_epoch reshuffles


# -- install() and python -m dspark_cache.nemo ------------------------------------------------


def _fake_recipe(monkeypatch, names=tuple(dn.recipe.REPLACEMENTS),
                 path: str = dn.recipe.RECIPE_MODULES[-1]) -> types.ModuleType:
    """NeMo's recipe module at ``path`` (0.7.0's by default), nothing at the other layout's."""
    module = types.ModuleType(path)
    for name in names:
        setattr(module, name, object())
    seen = {}

    def main():
        seen["argv"] = list(sys.argv[1:])
        seen["manifest"] = module.read_manifest(sys.argv[-1])

    module.main, module.seen = main, seen
    parts = path.split(".")
    for depth in range(1, len(parts)):  # packages: an absent sibling module is then "not found"
        parent = ".".join(parts[:depth])
        if parent not in sys.modules or not hasattr(sys.modules[parent], "__path__"):
            package = types.ModuleType(parent)
            package.__path__ = []
            monkeypatch.setitem(sys.modules, parent, package)
    monkeypatch.setitem(sys.modules, path, module)
    return module


def test_install_replaces_the_recipe_globals(monkeypatch, small_cache):
    module = _fake_recipe(monkeypatch)
    assert dn.install() is module
    for name, fn in dn.recipe.REPLACEMENTS.items():
        assert getattr(module, name) is fn
    dn.main(["-c", "recipe.yaml", small_cache])
    assert module.seen["argv"] == ["-c", "recipe.yaml", small_cache]
    assert module.seen["manifest"]["num_samples"] == len(dspark_cache.open_cache(small_cache))


@pytest.mark.parametrize("path", dn.recipe.RECIPE_MODULES)
def test_install_finds_the_recipe_under_either_layout(monkeypatch, small_cache, path):
    """NeMo's nightly moves its recipes to nemo_automodel.recipes.speculative_decoding."""
    module = _fake_recipe(monkeypatch, path=path)
    assert dn.install() is module
    dn.main(["-c", "recipe.yaml", small_cache])
    assert module.seen["manifest"]["num_samples"] == len(dspark_cache.open_cache(small_cache))


def test_install_takes_the_new_layout_when_the_old_path_is_kept_too(monkeypatch):
    old = _fake_recipe(monkeypatch, path=dn.recipe.RECIPE_MODULES[1])
    new = _fake_recipe(monkeypatch, path=dn.recipe.RECIPE_MODULES[0])
    assert dn.install() is new and old.read_manifest is not dn.recipe.REPLACEMENTS["read_manifest"]


def test_install_refuses_another_recipe_api(monkeypatch):
    _fake_recipe(monkeypatch, names=("read_manifest",))
    with pytest.raises(RuntimeError, match="nemo-automodel==0.7.0"):
        dn.install()


def test_install_without_nemo_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_automodel", None)
    with pytest.raises(ImportError, match="pip install nemo-automodel==0.7.0"):
        dn.install()


def test_a_sample_listed_by_two_shards_is_refused(small_cache, tmp_path):
    """A crafted cache whose shards 0 and 1 both hold shard 0's samples (tar and index copied)."""
    copy = _copy(small_cache, tmp_path)
    paths = CachePaths(copy)
    index = json.load(open(paths.shard_index(0)))
    index["shard_id"] = 1
    shutil.copy(paths.shard_tar(0), paths.shard_tar(1))
    json.dump(index, open(paths.shard_index(1), "w"))
    with pytest.raises(ValueError, match="listed by two shards"):
        dn.build_cached_dspark_dataloader(cache_dir=copy, batch_size=2, shuffle=False)
