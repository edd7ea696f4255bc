"""The batch program: the native filler and the Python one do exactly the same, errors included."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from dspark_cache.loader import fill
from dspark_cache.loader.memory import page_aligned_zeros
from dspark_cache.loader.program import BatchProgram
from dspark_cache.loader.records import (
    OP_COLUMN, SEG_COPY, SEG_COPY_COLS, SEG_WIDEN_I32, SEG_WIDEN_U8, SEGMENT, segment, segment_table,
)

EXECUTORS = ["native", "python"]
NOT_BUILT = "the native batch filler is not built: install gcc, then `rm .venv/.installed && make setup`"


def run(program: BatchProgram, executor: str, scratch_bytes: int = 1 << 20) -> fill.Failure | None:
    if executor == "native" and not fill.native_available():
        if os.environ.get("DSPARK_NATIVE") == "0":
            pytest.skip("DSPARK_NATIVE=0 and the native batch filler is not built")
        pytest.fail(NOT_BUILT)
    return fill.run(program, page_aligned_zeros(scratch_bytes), native=executor == "native")


def test_native_filler_is_built():
    if os.environ.get("DSPARK_NATIVE") == "0":
        pytest.skip("DSPARK_NATIVE=0: testing the Python filler only")
    assert fill.native_available(), NOT_BUILT


@pytest.fixture
def payload(tmp_path):
    """A file with 100 junk bytes, then a 3 MiB payload laid out like a sample's."""
    rng = np.random.default_rng(0)
    rows, row_bytes = 300, 10240  # 300 tokens of 5120 bf16 values: crosses several 1 MiB chunks
    parts = {
        "header": rng.integers(0, 256, 4096, dtype=np.uint8),
        "hidden": rng.integers(0, 256, rows * row_bytes, dtype=np.uint8),
        "fill": rng.integers(0, 256, 64, dtype=np.uint8),
        "ids": rng.integers(-2**31, 2**31, rows, dtype=np.int32),
        "mask": rng.integers(0, 2, rows, dtype=np.uint8),
    }
    blob = b"".join(p.tobytes() for p in parts.values())
    path = tmp_path / "shard.tar"
    path.write_bytes(b"J" * 100 + blob)
    fd = os.open(path, os.O_RDONLY)
    yield fd, parts, blob, rows, row_bytes
    os.close(fd)


def set_last_op(program: BatchProgram, **fields: int) -> None:
    """Overwrite fields of the program's last op (a program the public methods cannot build)."""
    last = program._ops[-1][-1]
    for name, value in fields.items():
        last[OP_COLUMN[name]] = value


def sample_program(payload, *, size=None, hidden_buf_bytes=None):
    fd, parts, blob, rows, row_bytes = payload
    col_off, col_bytes = 8192, 2048
    hidden = np.full(hidden_buf_bytes or rows * row_bytes + 64, 0xAB, dtype=np.uint8)
    last = np.full(rows * col_bytes, 0xAB, dtype=np.uint8)
    ids = np.full(rows * 8 + 16, 0xAB, dtype=np.uint8)
    mask = np.full(rows * 8, 0xAB, dtype=np.uint8)
    program = BatchProgram([hidden, last, ids, mask])
    h = 4096
    f = h + rows * row_bytes + 64
    segs = segment_table(
        [
            segment(
                SEG_COPY_COLS,
                h,
                rows * row_bytes,
                0,
                0,
                row_bytes=row_bytes,
                col_off=col_off,
                col_bytes=col_bytes,
                col_buf=1,
            ),
            segment(SEG_WIDEN_I32, f, 4 * rows, 2, 8),  # one int64 slot in: a row offset
            segment(SEG_WIDEN_U8, f + 4 * rows, rows, 3, 0),
        ]
    )
    program.sample(fd, 100, size or len(blob), segs, tag="the sample")
    return program, (hidden, last, ids, mask), (col_off, col_bytes)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_sample_lands_in_every_buffer(payload, executor):
    _, parts, _, rows, row_bytes = payload
    program, (hidden, last, ids, mask), (col_off, col_bytes) = sample_program(payload)
    assert run(program, executor) is None
    assert np.array_equal(hidden[: rows * row_bytes], parts["hidden"])
    assert (hidden[rows * row_bytes :] == 0xAB).all()  # nothing written past the segment
    want_last = parts["hidden"].reshape(rows, row_bytes)[:, col_off : col_off + col_bytes].reshape(-1)
    assert np.array_equal(last, want_last)
    assert np.array_equal(ids[8 : 8 + rows * 8].view(np.int64), parts["ids"].astype(np.int64))
    assert (ids[:8] == 0xAB).all() and (ids[8 + rows * 8 :] == 0xAB).all()
    assert np.array_equal(mask.view(np.int64), parts["mask"].astype(np.int64))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_zero_and_fill_ops(executor):
    data = np.full(4096, 7, dtype=np.uint8)
    program = BatchProgram([data])
    program.zero(0, 5, 1000)
    program.fill_int64(0, 2048, 3, -100)  # a negative pad id survives the uint64 encoding
    program.fill_int64(0, 3000, 2, 1)
    program.fills([0, 0], [3200, 3208], [1, 1], [(1 << 64) - 1, 1 << 63])  # uint64 values: their bits
    assert run(program, executor) is None
    assert (data[5:1005] == 0).all() and data[4] == 7 and data[1005] == 7
    assert data[2048:2072].view(np.int64).tolist() == [-100, -100, -100]
    assert data[3000:3016].view(np.int64).tolist() == [1, 1]
    assert data[3200:3216].view(np.int64).tolist() == [-1, -(1 << 63)]
    assert (data[2072:3000] == 7).all() and (data[3016:3200] == 7).all() and (data[3216:] == 7).all()


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_payload_without_segments_is_read_and_dropped(payload, executor):
    fd, _, blob, _, _ = payload
    data = np.full(64, 7, dtype=np.uint8)
    program = BatchProgram([data])
    program.sample(fd, 100, len(blob), np.zeros(0, SEGMENT), tag="empty")  # a zero-token sample's table
    program.sample(fd, 100, len(blob) + 1, np.zeros(0, SEGMENT), tag="past the end")
    assert run(program, executor) == fill.Failure(fill.RC_SHORT_READ, "past the end", len(blob))
    assert (data == 7).all()


@pytest.mark.parametrize("executor", EXECUTORS)
def test_payload_past_the_end_of_the_file_is_a_short_read(payload, executor):
    _, _, blob, _, _ = payload
    program, *_ = sample_program(payload, size=len(blob) + 5000)
    failure = run(program, executor)
    assert failure == fill.Failure(fill.RC_SHORT_READ, "the sample", len(blob))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_segment_too_large_for_its_buffer_writes_nothing_past_it(payload, executor):
    _, _, _, rows, row_bytes = payload
    program, (hidden, *_), _ = sample_program(payload, hidden_buf_bytes=rows * row_bytes - 1)
    assert run(program, executor) == fill.Failure(fill.RC_INVALID, "the sample", 0)
    assert (hidden == 0xAB).all()
    program = BatchProgram([np.zeros(64, dtype=np.uint8)])
    program.zero(0, 60, 8)
    assert run(program, executor).code == fill.RC_INVALID


@pytest.mark.parametrize("executor", EXECUTORS)
def test_ids_larger_than_scratch_are_refused(payload, executor):
    program, *_ = sample_program(payload)
    assert run(program, executor, scratch_bytes=1024).code == fill.RC_INVALID


@pytest.mark.parametrize("executor", EXECUTORS)
def test_read_error_reports_errno(tmp_path, executor):
    fd = os.open(tmp_path, os.O_RDONLY)  # reading a directory fails with EISDIR
    try:
        program = BatchProgram([np.zeros(64, dtype=np.uint8)])
        program.sample(fd, 0, 64, segment_table([segment(SEG_COPY, 0, 64, 0, 0)]), tag=3)
        assert run(program, executor) == fill.Failure(fill.RC_READ_ERROR, 3, errno.EISDIR)
    finally:
        os.close(fd)


def test_records_match_the_c_layout():
    """records.OP / SEGMENT are csrc/batch_fill.c's op_t / segment_t: named uint64 fields, in order."""
    from dspark_cache.loader import records

    assert (
        records.OP.names == records.OpRecord._fields
        and records.SEGMENT.names == records.SegmentRecord._fields
    )
    assert (
        {records.OP[n].str for n in records.OP.names}
        == {records.SEGMENT[n].str for n in records.SEGMENT.names}
        == {"<u8"}
    )
    source = open(os.path.join(os.path.dirname(fill.__file__), "csrc", "batch_fill.c")).read()
    assert f"uint64_t {', '.join(records.OP.names)};" in source
    assert f"uint64_t {', '.join(records.SEGMENT.names)};" in source


# -- checksums while reading ---------------------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_checked_sample_is_hashed_as_it_is_read(payload, executor):
    import xxhash

    _, parts, blob, rows, row_bytes = payload
    want = xxhash.xxh3_64_intdigest(blob)
    for xxh3, expect in ((want, None), (want ^ 1, fill.Failure(fill.RC_CHECKSUM, "the sample", 0))):
        program, (hidden, *_), _ = sample_program(payload)
        set_last_op(program, value=xxh3, check=1)
        assert run(program, executor) == expect
        assert np.array_equal(hidden[: rows * row_bytes], parts["hidden"])  # the bytes still land
    program, *_ = sample_program(payload, size=len(blob) + 7)  # hashing does not hide a short read
    set_last_op(program, value=want, check=1)
    assert run(program, executor) == fill.Failure(fill.RC_SHORT_READ, "the sample", len(blob))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_damaged_bytes_are_a_checksum_failure_before_a_broken_rule(tmp_path, executor):
    """A token id out of range fails the token rule; if the sample's checksum fails as well, its
    bytes are damaged, and that is what a checked read reports."""
    import xxhash

    ids = np.arange(64, dtype=np.int32)
    blob = bytearray(b"H" * 128 + ids.tobytes() + b"T" * 300)
    good = xxhash.xxh3_64_intdigest(bytes(blob))
    blob[128 + 4 * 10 : 128 + 4 * 11] = np.int32(10**6).tobytes()  # token 10 out of range
    path = tmp_path / "s"
    path.write_bytes(bytes(blob))
    fd = os.open(path, os.O_RDONLY)
    try:
        for xxh3, code in (
            (good, fill.RC_CHECKSUM),
            (xxhash.xxh3_64_intdigest(bytes(blob)), fill.RC_BAD_TOKEN),
            (None, fill.RC_BAD_TOKEN),
        ):
            program = BatchProgram([np.zeros(64 * 8, dtype=np.uint8)])
            program.sample(
                fd,
                0,
                len(blob),
                segment_table([segment(SEG_WIDEN_I32, 128, 256, 0, 0, limit=1000)]),
                tag=0,
                xxh3=xxh3,
            )
            failure = run(program, executor)
            assert failure.code == code
            assert failure.detail == (0 if code == fill.RC_CHECKSUM else 10)
    finally:
        os.close(fd)


# -- picks: a subset of each row's layers ----------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
def test_picks_hand_out_chosen_columns_in_the_callers_order(tmp_path, executor):
    from dspark_cache.loader.records import SEG_PICK, PickRecord, pick_table

    rng = np.random.default_rng(1)
    rows, layer, layers = 700, 96, 5  # rows straddle the 256 KiB chunks
    stored = rng.integers(0, 256, (rows, layers * layer), dtype=np.uint8)
    path = tmp_path / "s"
    path.write_bytes(b"h" * 64 + stored.tobytes())
    chosen = [3, 0, 4]
    picks = pick_table(
        [PickRecord(k * layer, layer, 0, j * layer, len(chosen) * layer) for j, k in enumerate(chosen)]
        + [PickRecord((layers - 1) * layer, layer, 1, 0, layer)]
    )
    hidden = np.full(rows * len(chosen) * layer + 32, 0xAB, dtype=np.uint8)
    last = np.full(rows * layer, 0xAB, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        program = BatchProgram([hidden, last], picks)
        program.sample(fd, 0, 64 + stored.nbytes, segment_table([segment(
            SEG_PICK, 64, stored.nbytes, 0, 0, row_bytes=layers * layer, col_buf=1, pick_count=4)]), tag=0)
        assert run(program, executor) is None
        by_layer = stored.reshape(rows, layers, layer)
        assert np.array_equal(hidden[:-32].reshape(rows, len(chosen), layer), by_layer[:, chosen])
        assert (hidden[-32:] == 0xAB).all()
        assert np.array_equal(last.reshape(rows, layer), by_layer[:, -1])
        # A pick reaching past its row, or its destination row, is refused before anything is written.
        for bad in (PickRecord(4 * layer, layer + 1, 0, 0, layer * 3), PickRecord(0, layer, 0, 1, layer)):
            hidden[:] = 0xAB
            program = BatchProgram([hidden, last], pick_table([bad]))
            program.sample(
                fd,
                0,
                64 + stored.nbytes,
                segment_table(
                    [
                        segment(
                            SEG_PICK,
                            64,
                            stored.nbytes,
                            0,
                            0,
                            row_bytes=layers * layer,
                            col_buf=1,
                            pick_count=1,
                        )
                    ]
                ),
                tag=0,
            )
            assert run(program, executor).code == fill.RC_INVALID
            assert (hidden == 0xAB).all()
    finally:
        os.close(fd)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_picked_fp8_layers_stop_at_the_first_bad_row_in_both_fillers(tmp_path, executor):
    """Layer 2 breaks the FP8 rule at row 5 (a NaN code), layer 0 at row 2 (a zero scale): the
    first bad row wins, whichever pick it lies in; unpicked layers are not judged."""
    from dspark_cache.loader.records import FP8_KINDS, SEG_DEQUANT, PickRecord, pick_table

    rows, group, layers = 9, 16, 3
    codes = np.full((rows, layers * group), 0x38, dtype=np.uint8)  # 1.0 in e4m3
    codes[5, 2 * group + 3] = 0x7F  # NaN code in layer 2
    codes[1, 1 * group] = 0x7F  # in layer 1, which is not picked
    scales = np.ones((rows, layers), dtype=np.float32)
    path = tmp_path / "s"
    path.write_bytes(codes.tobytes())
    picks = pick_table(
        [PickRecord(2 * group, group, 0, 0, 2 * group * 2), PickRecord(0, group, 0, group * 2, 2 * group * 2)]
    )
    fd = os.open(path, os.O_RDONLY)
    try:
        for bad_scale_row, expect in (
            (None, (fill.RC_BAD_CODE, 5)),
            (2, (fill.RC_BAD_SCALE, 2)),
            (7, (fill.RC_BAD_CODE, 5)),
        ):
            s = scales.copy()
            if bad_scale_row is not None:
                s[bad_scale_row, 0] = 0.0
            out = np.zeros(rows * 2 * group * 2, dtype=np.uint8)
            program = BatchProgram([out, s.view(np.uint8).reshape(-1).copy()], picks)
            program.sample(
                fd,
                0,
                codes.nbytes,
                segment_table(
                    [
                        segment(
                            SEG_DEQUANT,
                            0,
                            codes.nbytes,
                            0,
                            0,
                            row_bytes=layers * group,
                            scale_buf=1,
                            group=group,
                            out_size=2,
                            fp8_kind=FP8_KINDS["F8_E4M3"],
                            pick_count=2,
                        )
                    ]
                ),
                tag=0,
            )
            failure = run(program, executor)
            assert (failure.code, failure.detail) == expect
    finally:
        os.close(fd)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_both_fillers_refuse_the_same_hostile_programs(tmp_path, executor):
    """Programs no reader makes: each is RC_INVALID in both fillers, nothing written, nothing hangs."""
    from dspark_cache.loader.records import SEG_DEQUANT, FP8_KINDS

    path = tmp_path / "s"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDONLY)
    huge = (1 << 62) + 4
    cases = {
        "unknown kind": dict(segs=[segment(9, 0, 64, 0, 0)]),
        "picks on a copy": dict(segs=[segment(SEG_COPY, 0, 64, 0, 0, pick_count=1)]),
        "check 2": dict(segs=[segment(SEG_COPY, 0, 64, 0, 0)], check=2),
        "segments past the table": dict(segs=[segment(SEG_COPY, 0, 64, 0, 0)], seg_count=2),
        "no scratch": dict(segs=[segment(SEG_COPY, 8, 64, 0, 0)], scratch=0),
        "not a descriptor": dict(segs=[segment(SEG_COPY, 0, 64, 0, 0)], fd=1 << 40),
        "sizes that wrap": dict(
            size=huge,
            segs=[
                segment(
                    SEG_DEQUANT,
                    0,
                    huge,
                    0,
                    0,
                    row_bytes=4,
                    scale_buf=1,
                    group=1,
                    out_size=4,
                    fp8_kind=FP8_KINDS["F8_E4M3"],
                )
            ],
        ),
    }
    try:
        for name, case in cases.items():
            out = np.full(16, 0xAB, dtype=np.uint8)
            program = BatchProgram([out, np.ones(16, dtype=np.uint8)])
            program.sample(
                case.get("fd", fd), 0, case.get("size", 4096), segment_table(case["segs"]), tag=name
            )
            set_last_op(
                program, check=case.get("check", 0), seg_count=case.get("seg_count", len(case["segs"]))
            )
            failure = run(program, executor, scratch_bytes=case.get("scratch", 1 << 20))
            assert failure == fill.Failure(fill.RC_INVALID, name, 0), name
            assert (out == 0xAB).all(), name
    finally:
        os.close(fd)


def test_a_native_library_built_from_other_sources_is_not_called(monkeypatch, caplog):
    """A library left from an older build reads the records another way: refused, named, never called."""
    from dspark_cache.loader import records

    if not fill.native_available():
        pytest.skip("the native batch filler is not built")
    assert fill._native().dspark_fill_abi() == records.FILL_ABI
    monkeypatch.setattr(fill, "FILL_ABI", records.FILL_ABI + 1)
    fill._native.cache_clear()
    try:
        assert fill._native() is None
        assert "built from other sources" in caplog.text and "pip install -e ." in caplog.text
    finally:
        monkeypatch.undo()
        fill._native.cache_clear()
    assert fill.native_available()
