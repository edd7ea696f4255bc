"""A batch program (:mod:`.program`), run by the native filler (one call, no GIL) or, failing that, here.

The reader describes a batch as ops (records named in :mod:`.records`) over its buffers (the batch tensors' bytes): zero these
stale pad bytes, fill these int64 slots, and for every sample read ``size`` bytes at ``offset``
of ``fd`` through a segment table (:mod:`.segments`) that says where each tensor goes, hashing
the bytes as they are read where the sample's checksum is to be checked (:mod:`.verify` says
which). ``csrc/batch_fill.c`` runs the program without holding the GIL (its xxh3-64 is our own,
``format/csrc/xxh3.h``),
so a reader thread needs the GIL a few times per batch instead of several times per chunk, and
a training loop's Python rarely stalls it; :func:`run_python` runs the same program with numpy
and ``os.preadv`` where the extension is not built. Both check every write against its
buffer's bounds, refuse the same invalid programs and report failures the same way (what a
failed program left in its buffers may differ: the reader drops that batch), both dequantise
FP8 rows to the same bits (``format.sample.dequantize_rows``'s rule), and both check widened
token ids and masks against their segment's ``limit`` (the token rule,
``format.validate.token_problem``).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Iterator

import numpy as np
import xxhash

from dspark_cache.format.native import load_extension, native_wanted
from dspark_cache.format.sample import dequantize_rows, fp8_bad_codes, fp8_bad_scales
from dspark_cache.loader.program import BatchProgram
from dspark_cache.loader.records import (
    FILL_ABI, FP8_KINDS, OP_FILL_I64, OP_SAMPLE, OP_SAMPLE_MEM, OP_ZERO, SEG_COPY, SEG_COPY_COLS, SEG_DEQUANT,
    SEG_PICK,
    SEG_WIDEN_I32, SEG_WIDEN_U8, OpRecord, PickRecord, SegmentRecord,
)

RC_OK, RC_SHORT_READ, RC_CHECKSUM, RC_INVALID, RC_READ_ERROR = 0, 1, 2, 3, 4
# The FP8 rule (format.sample.fp8_bad_scales / fp8_bad_codes) broken; detail: the row (token).
RC_BAD_SCALE, RC_BAD_CODE = 5, 6
# A widened value outside its segment's [0, limit): the token rule (format.validate.token_problem) broken;
# detail: the token. The widened values are written first, so the reader names the sample by that rule.
RC_BAD_TOKEN = 7
# Failures of a rule on values, which a checked sample reports only once its checksum has passed.
_RULE_CODES = (RC_BAD_SCALE, RC_BAD_CODE, RC_BAD_TOKEN)
_FP8_CODES = {kind: code for code, kind in FP8_KINDS.items()}
_OUT_CODES = {2: "BF16", 4: "F32"}
# Bytes per read: a chunk is hashed and its final-state columns are copied while it is still in
# the core's L2 cache (512 KiB to 2 MiB on current server CPUs). 1 MiB chunks overflowed a 1 MiB
# L2 and were ~15% slower end to end than 128-512 KiB ones (BENCHMARKS.md).
CHUNK = 256 << 10
_INT32_MAX, _INT64_MAX = (1 << 31) - 1, (1 << 63) - 1
_SEG_KINDS = (SEG_COPY, SEG_COPY_COLS, SEG_WIDEN_I32, SEG_WIDEN_U8, SEG_DEQUANT, SEG_PICK)


@dataclass(frozen=True)
class Failure:
    """Why a program failed: the code, the failing op's ``tag`` and a detail (see batch_fill.c)."""

    code: int
    tag: object
    detail: int


# -- native -------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _native() -> ctypes.CDLL | None:
    lib = load_extension("dspark_cache.loader._batch_fill", "dspark_fill_abi", FILL_ABI, "batch filler")
    if lib is None:
        return None
    fn = lib.dspark_fill_batch
    p = ctypes.c_void_p
    fn.argtypes = [
        p,
        ctypes.c_uint64,
        p,
        ctypes.c_uint64,
        p,
        ctypes.c_uint64,
        p,
        p,
        ctypes.c_uint64,
        p,
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint64),
    ]
    fn.restype = ctypes.c_int
    return lib


def native_available() -> bool:
    """True when the C batch filler is built and loads."""
    return _native() is not None


def use_native_default() -> bool:
    """The native filler unless it is missing or ``DSPARK_NATIVE=0`` asks for the Python one."""
    return native_wanted() and native_available()


def run(program: BatchProgram, scratch: np.ndarray, *, native: bool) -> Failure | None:
    """Run ``program``; ``scratch`` holds payload bytes that go nowhere (header, fill, ids)."""
    return (run_native if native else run_python)(program, scratch)


def run_native(program: BatchProgram, scratch: np.ndarray) -> Failure | None:
    lib = _native()
    if lib is None:
        raise RuntimeError(
            "the native batch filler is not built, or was built from other sources; rebuild it: "
            "`pip install -e .` in the checkout, with a C compiler"
        )
    ops, segs = program.arrays()
    picks = np.ascontiguousarray(program.picks)
    bases = np.array([b.ctypes.data for b in program.buffers], dtype=np.uint64)
    sizes = np.array([b.nbytes for b in program.buffers], dtype=np.uint64)
    fail, detail = ctypes.c_uint64(), ctypes.c_uint64()
    code = lib.dspark_fill_batch(
        ops.ctypes.data,
        len(ops),
        segs.ctypes.data,
        len(segs),
        picks.ctypes.data,
        len(picks),
        bases.ctypes.data,
        sizes.ctypes.data,
        len(bases),
        scratch.ctypes.data,
        scratch.nbytes,
        CHUNK,
        ctypes.byref(fail),
        ctypes.byref(detail),
    )
    return None if code == RC_OK else Failure(code, program.tag(fail.value), detail.value)


# -- Python ---------------------------------------------------------------------------------------


class _Stop(Exception):
    def __init__(self, code: int, detail: int = 0) -> None:
        self.code, self.detail = code, detail


def _span(buffers: list[np.ndarray], buf: int, offset: int, nbytes: int) -> np.ndarray:
    if buf >= len(buffers) or offset + nbytes > buffers[buf].nbytes:
        raise _Stop(RC_INVALID)
    return buffers[buf][offset : offset + nbytes]


def run_python(program: BatchProgram, scratch: np.ndarray) -> Failure | None:
    """The same program in Python (numpy copies and ``os.preadv``; they release the GIL)."""
    ops, segs = program.arrays()
    bufs = program.buffers
    picks = [PickRecord._make(p) for p in program.picks.tolist()]
    for index, op in enumerate(map(OpRecord._make, ops.tolist())):
        try:
            if op.kind == OP_ZERO:
                _span(bufs, op.target, op.offset, op.count)[:] = 0
            elif op.kind == OP_FILL_I64:
                value = op.value - (1 << 64) if op.value >> 63 else op.value  # two's complement
                _span(bufs, op.target, op.offset, 8 * op.count).view(np.int64)[:] = value
            elif op.kind in (OP_SAMPLE, OP_SAMPLE_MEM):
                # As C refuses them: segments outside the table, an unknown check, a descriptor that is
                # not one, a payload past the largest file offset (or outside its buffer), no scratch.
                mem = _span(bufs, op.target, op.offset, op.count) if op.kind == OP_SAMPLE_MEM else None
                if (op.seg_first > len(segs) or op.seg_count > len(segs) - op.seg_first or op.check > 1
                        or (mem is None and (op.target > _INT32_MAX or op.offset > _INT64_MAX - op.count))
                        or not scratch.nbytes):
                    raise _Stop(RC_INVALID)
                chosen = segs[op.seg_first : op.seg_first + op.seg_count].tolist()
                read = _SampleRead(bufs, scratch, picks, op.target, op.offset, op.count, op.check, mem)
                try:
                    read.run(map(SegmentRecord._make, chosen))
                except _Stop as stop:
                    if not (op.check and stop.code in _RULE_CODES):
                        raise
                    # damaged bytes are named as such, not by the rule they happen to break
                    read.gap(op.count)
                    raise _Stop(RC_CHECKSUM) if read.hasher.intdigest() != op.value else stop
                if op.check and read.hasher.intdigest() != op.value:
                    raise _Stop(RC_CHECKSUM)
            else:
                raise _Stop(RC_INVALID)
        except _Stop as stop:
            return Failure(stop.code, program.tag(index), stop.detail)
    return None


def _check_fp8(codes: np.ndarray, scales: np.ndarray, code: str, group: int, runs: list[tuple[int, int]],
               first: int) -> None:
    """The FP8 rule on a chunk of rows, for groups ``[g0, g0 + ng)`` of each run: stops where the C
    filler does (the first bad row; in it, the runs and groups in order, a scale before its codes)."""
    found = []
    for g0, ng in runs:
        bad_scale = fp8_bad_scales(scales[:, g0 : g0 + ng], code)
        bad = bad_scale | fp8_bad_codes(codes[:, g0 * group : (g0 + ng) * group], code).reshape(
            -1, ng, group
        ).any(2)
        found.append((bad_scale, bad))
    rows = [int(np.argmax(bad.any(1))) for _, bad in found if bad.any()]
    if not rows:
        return
    row = min(rows)
    for bad_scale, bad in found:
        if bad[row].any():
            k = int(np.argmax(bad[row]))
            raise _Stop(RC_BAD_SCALE if bad_scale[row, k] else RC_BAD_CODE, first + row)


class _SampleRead:
    """One payload, in file order: bytes outside every segment are read to scratch and dropped;
    with ``check``, every byte read is hashed (xxhash hashes a large buffer without the GIL)."""

    def __init__(
        self,
        bufs: list[np.ndarray],
        scratch: np.ndarray,
        picks: list[PickRecord],
        fd: int,
        offset: int,
        size: int,
        check: int,
        mem: np.ndarray | None = None,
    ) -> None:
        self.bufs, self.scratch, self.picks, self.fd, self.offset, self.size = (
            bufs,
            scratch,
            picks,
            fd,
            offset,
            size,
        )
        self.mem = mem  # OP_SAMPLE_MEM: the payload's bytes, read from here instead of the file
        self.hasher = xxhash.xxh3_64() if check else None
        self.pos = 0

    def run(self, segs: Iterable[SegmentRecord]) -> None:
        for seg in segs:
            if seg.src_off < self.pos or seg.src_off + seg.len > self.size or seg.kind not in _SEG_KINDS:
                raise _Stop(RC_INVALID)
            if seg.pick_count and seg.kind not in (SEG_PICK, SEG_DEQUANT):
                raise _Stop(RC_INVALID)
            self.gap(seg.src_off)
            if seg.kind in (SEG_COPY, SEG_COPY_COLS):
                self.copy(seg)
            elif seg.kind == SEG_PICK:
                self.pick(seg)
            elif seg.kind == SEG_DEQUANT:
                self.dequant(seg)
            else:
                self.widen(seg)
        self.gap(self.size)

    def copy(self, seg: SegmentRecord) -> None:
        cols = None
        if seg.kind == SEG_COPY_COLS:
            if not seg.row_bytes or seg.len % seg.row_bytes or seg.col_off + seg.col_bytes > seg.row_bytes:
                raise _Stop(RC_INVALID)
            rows = seg.len // seg.row_bytes
            cols = _span(self.bufs, seg.col_buf, seg.col_dst, rows * seg.col_bytes).reshape(-1, seg.col_bytes)
        self.rows(
            _span(self.bufs, seg.buf, seg.off, seg.len), seg.row_bytes, seg.col_off, seg.col_bytes, cols
        )

    def chosen(self, seg: SegmentRecord, rows: int, unit_out: int = 1) -> list[tuple[PickRecord, np.ndarray]]:
        """The segment's picks, each with its destination as ``[rows, stride]`` bytes; checked as C checks them
        (``unit_out``: output bytes per stored byte of a pick's range, for its bounds)."""
        if (
            seg.pick_first > len(self.picks)
            or seg.pick_count > len(self.picks) - seg.pick_first
            or not seg.row_bytes
        ):
            raise _Stop(RC_INVALID)
        out = []
        for p in self.picks[seg.pick_first : seg.pick_first + seg.pick_count]:
            if (
                p.src + p.len > seg.row_bytes
                or not p.stride
                or p.dst + p.len * unit_out > p.stride
                or p.to_col > 1
            ):
                raise _Stop(RC_INVALID)
            buf, off = (seg.col_buf, seg.col_dst) if p.to_col else (seg.buf, seg.off)
            out.append((p, _span(self.bufs, buf, off, rows * p.stride).reshape(rows, p.stride)))
        return out

    def whole_rows(self, row_bytes: int, rows: int) -> Iterator[tuple[int, np.ndarray]]:
        """``(first row, [n, row_bytes] bytes)`` of a segment's rows, read through scratch a chunk of
        whole rows at a time (one row when a row is larger than a chunk)."""
        step = max(1, CHUNK // row_bytes)
        if step * row_bytes > self.scratch.nbytes:
            raise _Stop(RC_INVALID)
        for first in range(0, rows, step):
            n = min(step, rows - first)
            yield first, self.read_into(self.scratch[: n * row_bytes]).reshape(n, row_bytes)

    def pick(self, seg: SegmentRecord) -> None:
        """Whole rows through scratch; the picks' columns of each go to their places."""
        row_bytes = seg.row_bytes
        if not row_bytes or seg.len % row_bytes:
            raise _Stop(RC_INVALID)
        rows = seg.len // row_bytes
        chosen = self.chosen(seg, rows)
        for first, piece in self.whole_rows(row_bytes, rows):
            for p, dst in chosen:
                dst[first : first + len(piece), p.dst : p.dst + p.len] = piece[:, p.src : p.src + p.len]

    def dequant(self, seg: SegmentRecord) -> None:
        """Float8 rows through scratch, whole rows per chunk, into bf16/float32 rows (and columns);
        with picks, only the picked groups, each pick into its place."""
        in_row, group, out_size = seg.row_bytes, seg.group, seg.out_size
        code, out_code = _FP8_CODES.get(seg.fp8_kind), _OUT_CODES.get(out_size)
        if code is None or out_code is None or not in_row or not group or in_row % group or seg.len % in_row:
            raise _Stop(RC_INVALID)
        rows, groups, out_row = seg.len // in_row, in_row // group, in_row * out_size
        scales = _span(self.bufs, seg.scale_buf, seg.scale_off, rows * groups * 4).view(np.float32)
        scales = scales.reshape(rows, groups)
        cols = None
        if seg.pick_count:  # runs: (first group, groups, destination rows, byte offset in them)
            chosen = self.chosen(seg, rows, out_size)
            if any(p.src % group or p.len % group for p, _ in chosen):
                raise _Stop(RC_INVALID)
            runs = [(p.src // group, p.len // group, dst, p.dst) for p, dst in chosen]
        else:
            runs = [(0, groups, _span(self.bufs, seg.buf, seg.off, rows * out_row).reshape(rows, out_row), 0)]
            if seg.col_bytes:
                if seg.col_off + seg.col_bytes > out_row:
                    raise _Stop(RC_INVALID)
                cols = _span(self.bufs, seg.col_buf, seg.col_dst, rows * seg.col_bytes).reshape(
                    rows, seg.col_bytes
                )
        for first, piece in self.whole_rows(in_row, rows):
            n = len(piece)
            part = scales[first : first + n]
            _check_fp8(piece, part, code, group, [(g0, ng) for g0, ng, _, _ in runs], first)
            for g0, ng, dst, at in runs:
                codes = piece[:, g0 * group : (g0 + ng) * group]
                out = (
                    dequantize_rows(codes, part[:, g0 : g0 + ng], code, out_code)
                    .view(np.uint8)
                    .reshape(n, -1)
                )
                dst[first : first + n, at : at + out.shape[1]] = out
                if cols is not None:
                    cols[first : first + n] = out[:, seg.col_off : seg.col_off + seg.col_bytes]

    def widen(self, seg: SegmentRecord) -> None:
        item = 4 if seg.kind == SEG_WIDEN_I32 else 1
        if seg.len % item or seg.len > self.scratch.nbytes or seg.off % 8:
            raise _Stop(RC_INVALID)
        data = self.read_into(self.scratch[: seg.len])
        dst = _span(self.bufs, seg.buf, seg.off, seg.len // item * 8).view(np.int64)
        dst[:] = data.view(np.int32 if item == 4 else np.uint8)
        values = dst.view(np.uint64)  # as unsigned, a negative id is out of range too: one bound, as in C
        if seg.limit and values.size and int(values.max()) >= seg.limit:
            raise _Stop(RC_BAD_TOKEN, int(np.argmax(values >= np.uint64(seg.limit))))

    def rows(
        self, dst: np.ndarray, row_bytes: int, col_off: int, col_bytes: int, cols: np.ndarray | None
    ) -> None:
        step = max(row_bytes, CHUNK // row_bytes * row_bytes) if cols is not None else CHUNK
        for done in range(0, dst.nbytes, step):
            piece = self.read_into(dst[done : done + step])
            if cols is not None:  # copied while the chunk is still in the CPU cache
                first = done // row_bytes
                part = piece.reshape(-1, row_bytes)[:, col_off : col_off + col_bytes]
                cols[first : first + len(part)] = part

    def gap(self, end: int) -> None:
        while self.pos < end:
            self.read_into(self.scratch[: min(CHUNK, end - self.pos, self.scratch.nbytes)])

    def read_into(self, dst: np.ndarray) -> np.ndarray:
        view, got = memoryview(dst), 0
        if self.mem is not None:
            dst[:] = self.mem[self.pos : self.pos + len(dst)]
            got = len(dst)
        while got < len(view):
            try:
                n = os.preadv(self.fd, [view[got:]], self.offset + self.pos + got)
            except OSError as err:
                raise _Stop(RC_READ_ERROR, err.errno or 0) from err
            if n == 0:
                raise _Stop(RC_SHORT_READ, self.pos + got)
            got += n
        self.pos += got
        if self.hasher is not None:
            self.hasher.update(dst)
        return dst
