"""dspark-verify finds a flipped byte, a truncated shard, a missing index and a missing shard."""

from __future__ import annotations

import json
import os
import shutil

from dspark_cache.format.paths import CachePaths
from dspark_cache.verify import main


def test_verify_clean_cache(small_cache, capsys):
    assert main([small_cache]) == 0
    assert "OK" in capsys.readouterr().out
    assert main([small_cache, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["shards_ok"] == report["shards_total"] and not report["corrupt"]


def test_verify_detects_every_kind_of_damage(small_cache, tmp_path, capsys):
    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    paths = CachePaths(copy)
    with open(paths.shard_tar(0), "r+b") as handle:  # a flipped byte in sample data
        handle.seek(5000)
        b = handle.read(1)
        handle.seek(5000)
        handle.write(bytes([b[0] ^ 0x40]))
    with open(paths.shard_tar(1), "r+b") as handle:  # a truncated shard
        handle.truncate(1000)
    os.unlink(paths.shard_index(2))  # a missing index
    os.unlink(paths.shard_index(3))  # a missing shard (tar and index)
    os.unlink(paths.shard_tar(3))
    assert main([copy, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"]
    assert sorted(report["missing"]) == [2, 3]
    corrupt = {p["shard"]: p["reason"] for p in report["corrupt"]}
    assert set(corrupt) == {0, 1}
    assert "checksum" in corrupt[0] and "shard-000000.tar" in corrupt[0]
    assert "truncated" in corrupt[1]
    assert paths.shard_tar(2) in report["leftovers"]
    assert main([copy]) == 1
    text = capsys.readouterr().out
    assert "missing shards: 2-3" in text and "corrupt shard 0" in text and "--repair" in text
    assert main([copy, "--repair"]) == 1
    assert not os.path.exists(paths.shard_index(0)) and not os.path.exists(paths.shard_tar(1))


def test_verify_not_a_cache(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "not a dspark cache" in capsys.readouterr().err
