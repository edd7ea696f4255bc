"""--for-draft-layers: one cache holds the layers of several drafter depths, and each trains from it."""

from __future__ import annotations

import re

import pytest
import torch

import dspark_cache
from dspark_cache.format.layers import build_target_layer_ids
from tests.support.produce import run_produce

DEPTHS = (1, 3, 5)  # the embedded target has 8 layers: [7], [1, 4, 7], [1, 2, 4, 6, 7]
ARGS = ("--seq-length", "256", "--shard-size", "16", "--dtype", "fp32")


def test_one_cache_serves_each_drafter_as_its_own_cache_would(embedded, tmp_path, capsys):
    union = str(tmp_path / "union")
    assert run_produce(embedded.stock, embedded.data, union, *ARGS, "--for-draft-layers",
                       ",".join(map(str, DEPTHS))) == 0
    cache = dspark_cache.open_cache(union)
    assert cache.manifest.target_layer_ids == [1, 2, 4, 6, 7]
    cache.close()
    for depth in (1, 3):  # depth 5's spread is the union itself
        layers = build_target_layer_ids(8, depth)
        alone = str(tmp_path / f"alone-{depth}")
        assert (
            run_produce(embedded.stock, embedded.data, alone, *ARGS, "--draft-num-hidden-layers", str(depth))
            == 0
        )
        own = dspark_cache.build_dataloader(alone, 4, shuffle=True, seed=2)
        shared = dspark_cache.build_dataloader(union, 4, shuffle=True, seed=2, target_layer_ids=layers,
                                               expect={"target_layer_ids": layers, "hidden_size": 64})
        steps = 0
        for a, b in zip(own, shared, strict=True):
            assert a.keys() == b.keys()
            for key in a:  # the same samples, the same bits: capturing more layers changes no state
                assert torch.equal(a[key], b[key]), (depth, key)
            steps += 1
        assert steps == len(own) > 0
        own.close()
        shared.close()


def test_dry_run_states_what_the_union_costs(embedded, tmp_path, capsys):
    out = str(tmp_path / "c")
    assert (
        run_produce(embedded.stock, embedded.data, out, *ARGS, "--for-draft-layers", "1,2,3,5", "--dry-run")
        == 0
    )
    printed = capsys.readouterr().out
    line = re.search(
        r"--for-draft-layers 1,2,3,5: layers \[1, 2, 4, 6, 7\] \(5 of 8\) serve all 4 drafter depths: "
        r"(\d+) bytes/token, .* one cache per depth would store (\d+) bytes/token \((\d+\.\d+)x\)",
        printed,
    )
    assert line, printed
    own, alone, ratio = int(line[1]), int(line[2]), float(line[3])
    # per token: fp32 states (64 columns a layer) plus an int32 id and a uint8 mask
    assert own == 5 * 64 * 4 + 5 and alone == (1 + 2 + 3 + 5) * 64 * 4 + 4 * 5
    assert ratio == pytest.approx(alone / own, abs=0.01)


@pytest.mark.parametrize("args,says", [
    (("--for-draft-layers", "1,3", "--target-layer-ids", "1", "7"), "give one"),
    (("--for-draft-layers", "0,3"), "depths of 1 or more"),
    (("--for-draft-layers", "three"), "not a comma-separated list"),
])
def test_bad_draft_layers_are_usage_errors(embedded, tmp_path, capsys, args, says):
    try:
        code = run_produce(embedded.stock, embedded.data, str(tmp_path / "c"), *args)
    except SystemExit as exc:  # argparse's own usage error
        code = exc.code
    assert code not in (0, None)
    assert says in capsys.readouterr().err
