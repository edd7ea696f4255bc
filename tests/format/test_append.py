"""The shard writer's byte path: the C loop and the Python fallback write the same file and the same
checksums, the `xxhash` package's, for every shape of piece list."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import xxhash

from dspark_cache.format.tar.append import Piece, TarAppender, native_available, zeros


def _pieces(rng: random.Random, samples: int) -> list[Piece]:
    pieces = []
    for owner in range(samples):
        pieces.append(Piece(bytes(rng.getrandbits(8) for _ in range(512)), -1))  # a tar header
        for _ in range(rng.randint(1, 6)):
            n = rng.choice([0, 1, 63, 64, 65, 4096, 65535, 65536, 65537, 300_001])
            kind = rng.random()
            if kind < 0.4:
                buffer = np.frombuffer(rng.randbytes(n), dtype=np.uint8)
            elif kind < 0.7:  # a 2-d bf16-like view, as the host ring hands over
                buffer = np.frombuffer(rng.randbytes(n - n % 4), dtype=np.int16).reshape(-1, 2)
            elif kind < 0.85:
                buffer = memoryview(rng.randbytes(n))
            else:
                buffer = zeros(n % 512)
            pieces.append(Piece(buffer, owner))
        pieces.append(Piece(zeros(rng.randint(0, 511)), -1))
    return pieces


def _expected(pieces: list[Piece], samples: int) -> tuple[bytes, list[int]]:
    whole = b"".join(
        bytes(memoryview(p.buffer).cast("B")) if memoryview(p.buffer).nbytes else b"" for p in pieces
    )
    per = [b"".join(bytes(memoryview(p.buffer).cast("B")) for p in pieces
                    if p.owner == k and memoryview(p.buffer).nbytes) for k in range(samples)]
    return whole, [xxhash.xxh3_64_intdigest(x) for x in per]


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_bytes_and_checksums_match_xxhash(tmp_path, native, seed):
    if native and not native_available():
        pytest.skip("the native writer is not built")
    rng = random.Random(seed)
    path = tmp_path / "shard.tar"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    appender = TarAppender(fd, native)
    assert appender.native == native
    expected_file, expected_hashes = b"", []
    for _ in range(3):  # batches: the file's checksum runs on across calls
        samples = rng.randint(1, 5)
        pieces = _pieces(rng, samples)
        whole, hashes = _expected(pieces, samples)
        assert appender.append(pieces, samples) == hashes
        expected_file += whole
        expected_hashes += hashes
    os.close(fd)
    assert path.read_bytes() == expected_file
    assert appender.digest() == xxhash.xxh3_64_intdigest(expected_file)


@pytest.mark.parametrize("native", [True, False])
def test_more_pieces_than_one_writev_takes(tmp_path, native):
    if native and not native_available():
        pytest.skip("the native writer is not built")
    pieces = [Piece(bytes([i % 251]) * (i % 7 + 1), 0 if 100 <= i < 4000 else -1) for i in range(5000)]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    appender = TarAppender(fd, native)
    hashes = appender.append(pieces, 1)
    os.close(fd)
    whole = b"".join(p.buffer for p in pieces)
    assert (tmp_path / "f").read_bytes() == whole
    assert hashes == [xxhash.xxh3_64_intdigest(b"".join(p.buffer for p in pieces if p.owner == 0))]


@pytest.mark.parametrize("native", [True, False])
def test_a_failed_write_is_an_oserror(tmp_path, native):
    if native and not native_available():
        pytest.skip("the native writer is not built")
    path = tmp_path / "f"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # writes fail with EBADF
    try:
        with pytest.raises(OSError):
            TarAppender(fd, native).append([Piece(b"x" * 100, 0)], 1)
    finally:
        os.close(fd)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("owners,samples", [
    ((0, -1, 0), 1),  # one sample's pieces apart
    ((0,), 2),  # a sample without a piece: its checksum would be nothing computed (C left it 0)
    ((0, 2), 3),  # one skipped
    ((-1,), 1),  # framing only
])
def test_pieces_not_naming_each_sample_in_order_are_refused_before_writing(tmp_path, native, owners, samples):
    if native and not native_available():
        pytest.skip("the native writer is not built")
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(ValueError, match="samples"):
            TarAppender(fd, native).append([Piece(b"x", owner) for owner in owners], samples)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b""
