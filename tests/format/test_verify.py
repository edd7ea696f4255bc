"""dspark-verify finds a flipped byte, a truncated shard, a missing index and a missing shard."""

from __future__ import annotations

import json
import os
import shlex
import shutil

from dspark_cache.format.paths import CachePaths
from dspark_cache.cli import verify as main
from tests.support.proc import run


def test_verify_clean_cache(small_cache, capsys):
    assert main([small_cache]) == 0
    assert "OK" in capsys.readouterr().out
    assert main([small_cache, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["shards_ok"] == report["shards_total"] and not report["corrupt"]
    assert report["state"] == "complete"


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
    assert not report["ok"] and report["state"] == "CORRUPT, INCOMPLETE"
    assert sorted(report["missing"]) == [2, 3]
    corrupt = {p["shard"]: p["reason"] for p in report["corrupt"]}
    assert set(corrupt) == {0, 1}
    assert "checksum" in corrupt[0] and os.path.basename(paths.shard_tar(0)) in corrupt[0]
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


def _tree(root: str) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its inode and mtime: what a write (or an atomic replace) changes."""
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            st = os.stat(os.path.join(base, name))
            out[os.path.join(base, name)] = (st.st_ino, st.st_mtime_ns)
    return out


def test_repair_of_an_intact_cache_writes_nothing(small_cache, tmp_path, capsys):
    """Issue 23, item 14: --repair writes only when something needs repairing."""
    import subprocess
    import sys

    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    before = _tree(copy)
    assert main([copy, "--repair"]) == 0
    assert "OK" in capsys.readouterr().out
    assert _tree(copy) == before
    # The same on a real read-only filesystem: a read-only bind mount in a private mount namespace.
    script = (
        f"mount --bind {copy} {copy} && mount -o remount,ro,bind {copy} && touch {copy}/probe 2>/dev/null; "
        f"test ! -e {copy}/probe && exec {sys.executable} -m dspark_cache.verify --repair {copy}"
    )
    try:
        done = subprocess.run(
            ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError:
        return  # no unshare here: the check above stands alone
    if "mount" in done.stderr and done.returncode != 0 and "OK" not in done.stdout:
        return  # namespaces are not allowed here
    assert done.returncode == 0 and done.stdout.rstrip().endswith("OK"), done.stdout + done.stderr


def test_headline_says_corrupt_or_incomplete_first(small_cache, tmp_path, capsys):
    """Issue 23, item 17: a damaged complete cache is not 'complete, 5/6 shards verified'."""
    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    paths = CachePaths(copy)
    total = len(paths.indexed_shard_ids())
    with open(paths.shard_tar(0), "r+b") as handle:  # a flipped byte in sample data
        handle.seek(5000)
        b = handle.read(1)
        handle.seek(5000)
        handle.write(bytes([b[0] ^ 0x40]))
    assert main([copy]) == 1
    assert (
        capsys.readouterr().out.splitlines()[0] == f"{copy}: CORRUPT, {total - 1}/{total} shards verified, "
        f"{sum(len(json.load(open(paths.shard_index(s)))['samples']) for s in range(1, total))} samples"
    )
    os.unlink(paths.shard_index(total - 1))
    assert main([copy]) == 1
    assert capsys.readouterr().out.startswith(
        f"{copy}: CORRUPT, INCOMPLETE, {total - 2}/{total} shards verified"
    )
    assert main([copy, "--repair"]) == 1  # shard 0's tar is damaged: deleted, to be recomputed with the other
    out = capsys.readouterr().out
    assert (
        "corrupt shard 0:" in out
        and f"compute the missing shards (0, {total - 1}), or wait, if a producer is still running:\n  "
        in out
    )
    assert main([copy]) == 1
    assert capsys.readouterr().out.startswith(f"{copy}: INCOMPLETE, {total - 2}/{total} shards verified")


def test_repair_of_a_damaged_index_blames_the_index_and_asks_for_nothing_missing(
    small_cache, tmp_path, capsys
):
    """Issue 23, item 17: the tar is intact, the index is rebuilt, and no shard is missing afterwards."""
    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    paths = CachePaths(copy)
    with open(paths.shard_index(1)) as handle:
        index = json.load(handle)
    index["samples"][0][1] += 1  # a wrong length
    with open(paths.shard_index(1), "w") as handle:
        json.dump(index, handle)
    assert main([copy, "--repair"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{copy}: CORRUPT, ")
    assert lines[1].startswith("damaged index of shard 1: ")
    assert lines[1].endswith("(index rebuilt from the intact tar)")
    assert "dspark-produce" not in lines[-1] and lines[-1].startswith(
        "Repaired: every damaged index was rebuilt"
    )
    assert main([copy]) == 0


def _flip(path: str, at: int = 5000) -> None:
    with open(path, "r+b") as handle:
        handle.seek(at)
        b = handle.read(1)
        handle.seek(at)
        handle.write(bytes([b[0] ^ 0x40]))


def test_advice_is_given_once_with_the_command_that_recomputes_the_bad_shards(small_cache, tmp_path, capsys):
    """Issue 41, item 17e: three bad shards, one piece of advice (not one per shard), ending in the
    dspark-produce command the manifest's settings make; run as printed, it recomputes exactly them."""
    copy = str(tmp_path / "c")
    shutil.copytree(small_cache, copy)
    paths = CachePaths(copy)
    for shard in (0, 2):
        _flip(paths.shard_tar(shard))
    with open(paths.shard_tar(3), "r+b") as handle:
        handle.truncate(1000)
    assert main([copy]) == 1
    out = capsys.readouterr().out
    assert out.count("--repair") == 1 and out.count("dspark-produce") == 2, out  # the advice, and its command
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("corrupt")] == \
        ["corrupt shard 0", "corrupt shard 2", "corrupt shard 3"]
    assert main([copy, "--repair"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.endswith("(deleted)")] == [
        line for line in lines if line.startswith("corrupt shard")] and len(lines) == 6, lines
    assert lines[-2].startswith("Rerun dspark-produce") and "missing shards (0, 2-3)" in lines[-2]
    assert main([copy, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["produce_command"] == lines[-1].strip()  # for machines too
    command = shlex.split(lines[-1])
    assert "dspark-produce" in command[0] and command[command.index("--output-dir") + 1] == copy
    kept = {s: os.stat(paths.shard_tar(s)).st_ino for s in paths.indexed_shard_ids()}
    done = run(command, timeout=600)
    assert done.returncode == 0, done.stderr
    assert main([copy]) == 0
    assert {s: os.stat(paths.shard_tar(s)).st_ino for s in kept} == kept  # only the bad shards were computed
