"""Checksums: each sample checked on its first read in a process (default) or on every read."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import dspark_cache
from dspark_cache.format.errors import CorruptShardError
from dspark_cache.loader import fill, verify
from dspark_cache.loader.records import OP_SAMPLE


def copy_cache(small_cache, tmp_path) -> str:
    copy = tmp_path / "c"
    shutil.copytree(small_cache, copy)
    return str(copy)


def flip(path: str, at: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(at)
        byte = handle.read(1)
        handle.seek(at)
        handle.write(bytes([byte[0] ^ 0x10]))


def victim_of(root: str):
    cache = dspark_cache.open_cache(root)
    victim = cache.shards[1].samples[0]
    return cache.paths.shard_tar(1), victim, victim.offset + victim.size // 2  # inside its hidden states


def epoch(loader, sample_id=None):
    """Read one epoch; the hidden states of ``sample_id`` (a copy) when it is given."""
    kept = None
    for batch in loader:
        ids = batch["sample_ids"].tolist()
        if sample_id in ids:
            kept = batch["target_hidden_states"][ids.index(sample_id)].clone()
    return kept


@pytest.fixture
def hashes(monkeypatch):
    """Payloads the batch programs hash: (fd, offset, size) of every sample op run with its checksum."""
    calls = []
    real = fill.run

    def counting(program, scratch, *, native):
        ops, _ = program.arrays()
        checked = ops[(ops["kind"] == OP_SAMPLE) & (ops["check"] == 1)]
        calls.extend(zip(checked["target"].tolist(), checked["offset"].tolist(), checked["count"].tolist()))
        return real(program, scratch, native=native)

    monkeypatch.setattr(fill, "run", counting)
    return calls


@pytest.mark.parametrize("mode", ["once", "always"])
def test_flip_before_the_first_read_is_detected(small_cache, tmp_path, executor, mode):
    root = copy_cache(small_cache, tmp_path)
    path, victim, at = victim_of(root)
    flip(path, at)
    loader = dspark_cache.build_dataloader(root, 4, shuffle=False, verify=mode)
    with pytest.raises(
        CorruptShardError, match=rf"shard-000001\.tar \(sample {victim.sample_id}\).*checksum mismatch"
    ):
        epoch(loader)
    loader.close()


def test_default_hashes_each_sample_once_per_process(small_cache, tmp_path, executor, hashes):
    root = copy_cache(small_cache, tmp_path)
    loader = dspark_cache.build_dataloader(root, 4, shuffle=True, seed=1)
    assert loader.reader.verified.mode == "once"
    epoch(loader)
    n = loader.manifest.num_samples
    assert len(hashes) == n and len(set(hashes)) == n
    epoch(loader)
    epoch(loader)
    assert len(hashes) == n  # later epochs: no sample hashed again
    shards = loader.manifest.num_shards
    per_shard = -(-loader.manifest.shard_size // 8)
    assert loader.reader.verified.bitmap_bytes() <= shards * per_shard  # one bit per sample
    loader.close()


def test_always_hashes_every_read(small_cache, tmp_path, executor, hashes):
    loader = dspark_cache.build_dataloader(copy_cache(small_cache, tmp_path), 4, verify="always")
    epoch(loader)
    epoch(loader)
    assert len(hashes) == 2 * 4 * len(loader)  # every row of every batch (repeats included)
    assert loader.reader.verified.bitmap_bytes() == 0
    loader.close()


def test_flip_after_the_first_read_is_missed_once_caught_always(small_cache, tmp_path, executor):
    root = copy_cache(small_cache, tmp_path)
    path, victim, at = victim_of(root)
    once = dspark_cache.build_dataloader(root, 4, shuffle=False)
    always = dspark_cache.build_dataloader(root, 4, shuffle=False, verify="always")
    before = epoch(once, victim.sample_id)
    epoch(always)
    flip(path, at)  # both loaders keep the shard open: the same file, changed in place
    after = epoch(once, victim.sample_id)  # "once": the changed byte reaches the batch unchecked
    assert after is not None and not np.array_equal(before.float().numpy(), after.float().numpy())
    with pytest.raises(CorruptShardError, match=rf"sample {victim.sample_id}\).*checksum mismatch"):
        epoch(always)
    once.close()
    always.close()


def test_a_replaced_file_is_checked_again(small_cache, tmp_path, executor, hashes):
    root = copy_cache(small_cache, tmp_path)
    path, victim, at = victim_of(root)
    loader = dspark_cache.build_dataloader(root, 4, shuffle=False)
    epoch(loader)
    shutil.copyfile(path, path + ".new")
    flip(path + ".new", at)
    os.replace(path + ".new", path)  # another inode
    loader.cache.close()  # the descriptors are reopened, as after an eviction
    with pytest.raises(CorruptShardError, match=rf"sample {victim.sample_id}\).*checksum mismatch"):
        epoch(loader)
    loader.close()


def test_a_reopened_unchanged_file_stays_checked(small_cache, tmp_path, executor, hashes):
    loader = dspark_cache.build_dataloader(copy_cache(small_cache, tmp_path), 4, shuffle=False)
    epoch(loader)
    loader.cache.close()
    epoch(loader)
    assert len(hashes) == loader.manifest.num_samples
    loader.close()


def test_a_forked_child_does_not_inherit_checks():
    seen = verify.VerifiedSamples("once")
    identity = (1, 2, 3, 4, 5)
    seen.mark(7, identity, 10, 3)
    assert not seen.needed(7, identity, 10, 3) and seen.needed(7, identity, 10, 4)
    pid = os.fork()
    if pid == 0:  # the child: only this object, no threads, then _exit
        os._exit(0 if seen.needed(7, identity, 10, 3) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not seen.needed(7, identity, 10, 3)  # the parent keeps its own
    assert seen.needed(7, (1, 2, 3, 4, 6), 10, 3)  # the shard's file is another one now: nothing checked
    assert seen.needed(7, identity, 10, 3)  # and the first one's checks are gone with it


def test_unknown_verify_mode_is_refused(small_cache):
    with pytest.raises(ValueError, match="verify must be one of"):
        dspark_cache.build_dataloader(small_cache, 4, verify="sometimes")
