"""The target: what was loaded is fingerprinted (a replaced checkpoint is refused on resume), a
checkpoint with missing weights or only pickles is refused, and a hub id without network fails fast."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

import dspark_cache
from dspark_cache.format.paths import CachePaths
from dspark_cache.verify import verify_cache
from tests.support.hub import fake_hub
from tests.support.produce import produce_args, run_produce
from tests.support.proc import producer_cmd, run

ARGS = ("--seq-length", "64", "--shard-size", "16", "--batch-size", "8", "--dtype", "fp32")


def _copy_target(embedded, tmp_path, name: str = "target") -> str:
    return shutil.copytree(embedded.stock, str(tmp_path / name), symlinks=True)


def _edit_safetensors(path: str, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# -- item 2: the cache's identity includes the checkpoint's fingerprint -------------------------------


def test_resume_refuses_a_checkpoint_replaced_at_the_same_path(embedded, tmp_path, capsys):
    from dspark_cache.embedded.target import build_target

    target = _copy_target(embedded, tmp_path)
    out = str(tmp_path / "cache")
    assert run_produce(target, embedded.data, out, *ARGS) == 0
    recorded = dspark_cache.open_cache(out).manifest.target_fingerprint
    assert recorded.startswith("sha256:") and "1 weight files" in recorded
    # Touching the files changes nothing that was loaded: the same cache, nothing to do.
    for name in os.listdir(target):
        os.utime(os.path.join(target, name))
    assert run_produce(target, embedded.data, out, *ARGS) == 0
    manifest_before = open(CachePaths(out).manifest, "rb").read()
    # An in-place update: another checkpoint of the same architecture copied over this one (same
    # file name, size and safetensors header; other values).
    fine_tune = build_target(str(tmp_path / "fine-tune"), seed=11)
    weights = os.path.join(target, "model.safetensors")
    assert os.path.getsize(os.path.join(fine_tune, "model.safetensors")) == os.path.getsize(weights)
    shutil.copyfile(os.path.join(fine_tune, "model.safetensors"), weights)
    capsys.readouterr()
    assert run_produce(target, embedded.data, out, *ARGS) == 1
    err = capsys.readouterr().err
    assert "target_fingerprint" in err and "--overwrite" in err and "checkpoint at --target-model" in err
    assert open(CachePaths(out).manifest, "rb").read() == manifest_before  # nothing lost
    assert verify_cache(out).ok


def test_resume_refuses_a_moved_symlink_and_a_new_config(embedded, tmp_path, capsys):
    from dspark_cache.embedded.target import build_target

    first = _copy_target(embedded, tmp_path, "first")
    other = build_target(str(tmp_path / "other"), seed=7)  # same architecture and sizes, other weights
    link = str(tmp_path / "current")
    os.symlink(first, link)
    out = str(tmp_path / "cache")
    assert run_produce(link, embedded.data, out, *ARGS) == 0
    os.unlink(link)
    os.symlink(other, link)
    capsys.readouterr()
    assert run_produce(link, embedded.data, out, *ARGS) == 1
    assert "target_fingerprint" in capsys.readouterr().err
    # The weights are the same but config.json changed (a new revision's settings): refused too.
    os.unlink(link)
    os.symlink(first, link)
    config = json.load(open(os.path.join(first, "config.json")))
    config["rope_theta"] = config.get("rope_theta", 10000) * 2
    json.dump(config, open(os.path.join(first, "config.json"), "w"))
    assert run_produce(link, embedded.data, out, *ARGS) == 1
    assert "target_fingerprint" in capsys.readouterr().err


def _replace_weights_after_a_run(embedded, tmp_path, capsys, target: str, loaded: str) -> None:
    """Produce a cache from ``target``, then copy another model's weights over ``loaded`` (the file
    transformers loads): the resume must be refused, naming the fingerprint."""
    from dspark_cache.embedded.target import build_target

    out = str(tmp_path / "cache")
    assert run_produce(target, embedded.data, out, *ARGS) == 0
    other = build_target(str(tmp_path / "other"), seed=1)
    shutil.copyfile(os.path.join(other, "model.safetensors"), os.path.join(target, loaded))
    capsys.readouterr()
    assert run_produce(target, embedded.data, out, *ARGS) == 1
    assert "target_fingerprint" in capsys.readouterr().err
    assert verify_cache(out).ok


def test_fingerprint_covers_the_single_file_loaded_before_a_stray_index(embedded, tmp_path, capsys):
    # Both model.safetensors and an index (of a shard): transformers loads model.safetensors, so
    # replacing it must be refused even though the index and its shard are unchanged.
    from safetensors import safe_open

    target = _copy_target(embedded, tmp_path)
    weights = os.path.join(target, "model.safetensors")
    shard = "model-00001-of-00001.safetensors"
    shutil.copyfile(weights, os.path.join(target, shard))
    with safe_open(weights, "pt") as f:
        weight_map = {name: shard for name in f.keys()}
    json.dump({"metadata": {"total_size": os.path.getsize(weights)}, "weight_map": weight_map},
              open(os.path.join(target, "model.safetensors.index.json"), "w"))
    _replace_weights_after_a_run(embedded, tmp_path, capsys, target, "model.safetensors")


def test_fingerprint_covers_config_transformers_weights(embedded, tmp_path, capsys):
    # config.json's "transformers_weights" makes transformers load that file instead of model.safetensors.
    target = _copy_target(embedded, tmp_path)
    shutil.copyfile(os.path.join(target, "model.safetensors"), os.path.join(target, "alt.safetensors"))
    config = json.load(open(os.path.join(target, "config.json")))
    json.dump(
        {**config, "transformers_weights": "alt.safetensors"}, open(os.path.join(target, "config.json"), "w")
    )
    _replace_weights_after_a_run(embedded, tmp_path, capsys, target, "alt.safetensors")


def test_fingerprint_covers_weight_files_in_subfolders(tmp_path):
    from dspark_cache.embedded.target import build_target
    from dspark_cache.producer.device.checkpoint import local_fingerprint

    target = build_target(str(tmp_path / "target"), seed=3)
    before = local_fingerprint(target)
    os.makedirs(os.path.join(target, "sub"))
    other = build_target(str(tmp_path / "other"), seed=1)
    shutil.copyfile(
        os.path.join(other, "model.safetensors"), os.path.join(target, "sub", "model.fp16.safetensors")
    )
    after = local_fingerprint(target)
    assert after != before and "2 weight files" in after
    shutil.copyfile(
        os.path.join(target, "model.safetensors"), os.path.join(target, "sub", "model.fp16.safetensors")
    )
    assert local_fingerprint(target) != after


def test_cache_without_a_fingerprint_is_refused_with_how_to_remake_it(embedded, tmp_path, capsys):
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 0
    path = CachePaths(out).manifest
    manifest = json.load(open(path))
    json.dump({**manifest, "target_fingerprint": ""}, open(path, "w"))  # as an older version wrote it
    capsys.readouterr()
    assert run_produce(embedded.stock, embedded.data, out, *ARGS) == 1
    err = capsys.readouterr().err
    assert "target_fingerprint" in err and "did not fingerprint its target" in err and "--overwrite" in err


# -- item 3: no silently random weights, no pickles unless asked ---------------------------------------


def test_checkpoint_with_missing_weights_is_refused_naming_them(embedded, tmp_path, capsys):
    target = _copy_target(embedded, tmp_path)
    _edit_safetensors(os.path.join(target, "model.safetensors"),
                      lambda t: t.pop("model.layers.3.mlp.up_proj.weight"))
    out = str(tmp_path / "cache")
    assert run_produce(target, embedded.data, out, *ARGS) == 1
    err = capsys.readouterr().err
    assert "model.layers.3.mlp.up_proj.weight" in err and "missing" in err and "re-download" in err
    assert not CachePaths(out).indexed_shard_ids()
    # A tied lm_head is not missing: a checkpoint that stores only the embedding is fine.
    tied = _copy_target(embedded, tmp_path, "tied")
    config = json.load(open(os.path.join(tied, "config.json")))
    json.dump({**config, "tie_word_embeddings": True}, open(os.path.join(tied, "config.json"), "w"))
    _edit_safetensors(os.path.join(tied, "model.safetensors"), lambda t: t.pop("lm_head.weight"))
    assert run_produce(tied, embedded.data, str(tmp_path / "tied-cache"), *ARGS) == 0


def test_pickle_only_checkpoint_needs_the_opt_in_flag(embedded, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    target = _copy_target(embedded, tmp_path)
    torch.save(
        load_file(os.path.join(target, "model.safetensors")), os.path.join(target, "pytorch_model.bin")
    )
    os.unlink(os.path.join(target, "model.safetensors"))
    out = str(tmp_path / "cache")
    assert run_produce(target, embedded.data, out, *ARGS) == 1
    err = capsys.readouterr().err
    assert "pytorch_model.bin" in err and "--allow-pickle-weights" in err and "arbitrary code" in err
    assert not os.path.exists(CachePaths(out).manifest)  # refused before planning
    assert run_produce(target, embedded.data, out, *ARGS, "--allow-pickle-weights") == 0
    assert dspark_cache.open_cache(out).manifest.target_fingerprint.startswith("sha256:")


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_a_checkpoint_file_that_is_not_plain_is_refused_unread(embedded, tmp_path, kind):
    target = _copy_target(embedded, tmp_path)
    victim = os.path.join(target, "tokenizer.json")
    os.unlink(victim)
    if kind == "fifo":
        os.mkfifo(victim)  # transformers would wait on it forever
    else:
        os.symlink("/dev/zero", victim)  # and read this until memory ran out
    done = run(producer_cmd(*produce_args(target, embedded.data, str(tmp_path / "cache"), *ARGS)), timeout=60)
    assert done.returncode == 1, done.stderr
    assert "tokenizer.json" in done.stderr and "not a regular file" in done.stderr


def test_allow_pickle_weights_help_says_what_it_risks():
    done = run(producer_cmd("--help"))
    assert "--allow-pickle-weights" in done.stdout and "arbitrary code" in " ".join(done.stdout.split())


# -- item 22: a hub id without network fails fast, in one line ----------------------------------------


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.slow
@pytest.mark.parametrize("network", ["offline", "connection refused"])
def test_uncached_hub_id_without_network_fails_fast_in_one_line(embedded, tmp_path, network):
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "home")}
    offline = "1" if network == "offline" else "0"
    env.update(
        HF_HUB_OFFLINE=offline, TRANSFORMERS_OFFLINE=offline, HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}"
    )
    started = time.monotonic()
    done = run(
        producer_cmd(*produce_args("someorg/not-cached", embedded.data, str(tmp_path / "cache"))),
        env=env,
        timeout=120,
    )
    took = time.monotonic() - started
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1, done.stderr  # no retries, no warning printed twice
    assert (
        "someorg/not-cached" in lines[0]
        and "local Hugging Face cache" in lines[0]
        and "hf download" in lines[0]
    )
    assert took < 15, took  # the interpreter and its imports; the hub is asked once, without retries


@pytest.mark.slow
def test_cached_hub_id_resolves_offline_to_its_commit(embedded, tmp_path):
    hub = str(tmp_path / "hub")
    commit = fake_hub(embedded.stock, hub, "someorg/tiny")
    out = str(tmp_path / "cache")
    for offline in ("1", "0"):  # offline, then online with the hub unreachable: the cached commit both times
        env = {"HF_HUB_CACHE": hub, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": offline,
               "TRANSFORMERS_OFFLINE": offline, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
        started = time.monotonic()
        done = run(
            producer_cmd(*produce_args("someorg/tiny", embedded.data, out, *ARGS)), env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr
        assert "Retry" not in done.stderr and time.monotonic() - started < 120
    assert dspark_cache.open_cache(out).manifest.target_fingerprint == f"hub someorg/tiny@{commit}"


@pytest.mark.slow
@pytest.mark.parametrize("network", ["offline", "connection refused"])
def test_an_uncached_hub_dataset_without_network_fails_fast_in_one_line(embedded, tmp_path, network):
    hub = str(tmp_path / "hub")
    offline = "1" if network == "offline" else "0"
    env = {"HF_HUB_CACHE": hub, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": offline,
           "HF_DATASETS_OFFLINE": offline, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    started = time.monotonic()
    done = run(
        producer_cmd(*produce_args(embedded.stock, "someorg/not-cached", str(tmp_path / "a"), "--dry-run")),
        env=env,
        timeout=120,
    )
    took = time.monotonic() - started
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1 and "Retry" not in done.stderr, done.stderr  # asked once, said once
    assert (
        "someorg/not-cached" in lines[0]
        and "local Hugging Face cache" in lines[0]
        and "hf download" in lines[0]
    )
    assert took < 15, took  # datasets alone retried each file it looked up: 28 s and a warning per try
