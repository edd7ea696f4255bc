"""Read each sample once, by offset, straight into its row of a batch buffer.

A sample's ``target_hidden_states`` lie contiguously in the shard, page-aligned, exactly as a
batch row wants them, so they are read straight into the batch (pinned memory where CUDA
exists): the only host copy. A sample's checksum is computed as its bytes are read, the first
time this process reads the sample (or every time, ``verify="always"``: :mod:`.verify`), and a
mismatch fails the batch; its header is compared with its index entry after every fill. A batch
is described as a program (:mod:`.program`) that the native filler (:mod:`.fill`) runs in one call without the GIL; reader threads work on
different prefetched batches. Batch memory comes from :mod:`.memory` (recycled, zeroed only
where needed). FP8 caches are dequantised by the filler as their rows are read (to bf16 by
default), or handed out raw with their scales (:func:`resolve_out_code`). Training may take a
subset of the cache's layers in its own order (``BatchLayout.layer_ids``; see :mod:`.segments`).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from dspark_cache.format.codec import CodecError, decode_data
from dspark_cache.format.errors import CacheError, CorruptShardError
from dspark_cache.format.geometry import SampleShape
from dspark_cache.format.layers import layer_positions
from dspark_cache.format.sample import (
    ATTENTION_MASK, CACHE_DTYPES, HIDDEN, HIDDEN_SCALE, INPUT_IDS, LAST_HIDDEN, LAST_HIDDEN_SCALE, LOSS_MASK,
    TORCH_NAMES, fp8_bad_scales, fp8_code_reason, fp8_scale_reason,
)
from dspark_cache.format.schema import Manifest, SampleEntry
from dspark_cache.format.validate import MAX_HEADER, check_header, token_problem
from dspark_cache.loader import fill, verify
from dspark_cache.loader.memory import BatchMemory, Field, Slab, page_aligned_zeros
from dspark_cache.loader.order import RankBatch
from dspark_cache.loader.program import BatchProgram
from dspark_cache.loader.segments import BUFFERS, RowTemplate, layer_picks, place_rows, row_template
from dspark_cache.loader.tensors import torch_dtype
from dspark_cache.storage.cache import CacheDir


# A batch row: its index in the batch, the shard, the entry's position in the shard's index, the entry.
Row = tuple[int, int, int, SampleEntry]


_DEQUANT_CODES = ("BF16", "F32")  # what FP8 states can be handed out as
_CODE_OF_TORCH = {name: code for code, name in TORCH_NAMES.items()}
_EMPTY = np.zeros(0, dtype=np.uint8)  # a program buffer no segment of this cache writes
# A reader thread decodes a compressed cache's samples into an arena of about this many bytes (or one
# sample's, if larger), a group of a batch's rows at a time.
DECODE_ARENA = 256 << 20


def resolve_out_code(shape: SampleShape, dtype: object = None) -> str | None:
    """The code an FP8 cache's states are dequantised to, or ``None`` to hand out what is stored.

    ``dtype``: ``None`` (an FP8 cache gives bf16, any other its stored dtype), a cache dtype name
    (``"bf16"``, ``"fp32"``, ``"fp8"``...), a torch dtype, or ``"raw"`` (as stored: FP8 states with
    their scales, for :func:`dspark_cache.dequantize` on the GPU). Only FP8 caches convert.
    """
    if dtype is None:
        return "BF16" if shape.fp8 else None
    if dtype == "raw":
        return None
    code = (
        CACHE_DTYPES.get(dtype)
        if isinstance(dtype, str)
        else _CODE_OF_TORCH.get(str(dtype).removeprefix("torch."))
    )
    if code is None:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(CACHE_DTYPES)}, 'raw' or their torch dtypes")
    if code == shape.dtype:
        return None
    if shape.fp8 and code in _DEQUANT_CODES:
        return code
    if shape.fp8:
        raise ValueError(f"dtype {dtype!r}: an FP8 cache is handed out as bf16 or fp32 (dequantised), or raw")
    raise ValueError(
        f"dtype {dtype!r}: this cache stores {shape.dtype} and is handed out as stored; only FP8 "
        "caches are converted while read (convert on the device instead: batch[key].to(dtype))"
    )


@dataclass(frozen=True)
class BatchLayout:
    """A batch: its samples' geometry (the format's one :class:`SampleShape`) plus its padding,
    the target's vocabulary (every token id below it, checked as ids are read), for FP8 caches
    the dtype the states are dequantised to (``None``: raw, with scales), and the layers handed
    out (``layer_ids``: a subset of the stored ones in the caller's order; ``None``: all, as stored)."""

    shape: SampleShape
    seq_length: int
    pad_token_id: int
    vocab_size: int
    out_code: str | None = None
    layer_ids: tuple[int, ...] | None = None
    # The stored positions of the layers handed out (None: all, as stored); set from layer_ids.
    select: tuple[int, ...] | None = field(init=False, default=None, compare=False)

    def __post_init__(self) -> None:
        if self.layer_ids is not None:
            ids = tuple(int(i) for i in self.layer_ids)
            select = layer_positions(self.shape.layer_ids, ids)  # raises, naming what the cache lacks
            identity = ids == self.shape.layer_ids
            object.__setattr__(self, "layer_ids", None if identity else ids)
            object.__setattr__(self, "select", None if identity else select)

    @classmethod
    def from_manifest(
        cls,
        m: Manifest,
        dtype: object = None,
        layer_ids: "tuple[int, ...] | list[int] | None" = None,
        where: str = "the cache",
    ) -> "BatchLayout":
        """The batches of the cache that ``m`` describes (``where``: its name in errors), states as
        ``dtype`` (:func:`resolve_out_code`), of the layers ``layer_ids`` (default: all the cache holds)."""
        shape = SampleShape.from_manifest(m)
        if layer_ids is not None:
            layer_positions(shape.layer_ids, layer_ids, where)
        return cls(shape, m.seq_length, m.pad_token_id, m.target_vocab_size, resolve_out_code(shape, dtype),
                   None if layer_ids is None else tuple(layer_ids))

    @property
    def delivered_layer_ids(self) -> tuple[int, ...]:
        """The layer ids of the hidden states handed out, in their order."""
        return self.shape.layer_ids if self.layer_ids is None else self.layer_ids

    @property
    def hidden_dim(self) -> int:
        """Columns of the hidden states handed out per token."""
        return len(self.delivered_layer_ids) * self.shape.hidden_size

    @property
    def picks(self) -> np.ndarray:
        """The pick table of a batch program of this layout (empty without a subset)."""
        return layer_picks(self.shape, self.out_code, self.select).table

    @property
    def states_code(self) -> str:
        """The dtype code of the states handed out."""
        return self.out_code or self.shape.dtype

    @property
    def raw_scales(self) -> bool:
        """FP8 states handed out as stored: their scales go with them."""
        return self.shape.fp8 and self.out_code is None

    def template(self, length: int) -> RowTemplate:
        """Where a sample of ``length`` tokens goes in its batch row (cached per length)."""
        return row_template(length, self.shape, self.out_code, vocab_size=self.vocab_size, select=self.select)


def batch_fields(layouts: "list[BatchLayout]", nemo_keys_only: bool) -> tuple[Field, ...]:
    """The batch memory's fields for batches whose rows come from caches of these layouts (one
    cache, or a mixture's, which hand out the same states: dtype and hidden dimension)."""
    first = layouts[0]
    # Per-token int64 fields are rewritten whole for every batch (a few bytes per token).
    dtype = torch_dtype(first.states_code)
    fields = [Field(HIDDEN, first.hidden_dim, dtype, True),
              Field(LAST_HIDDEN, first.shape.hidden_size, dtype, True),
              *(Field(name, 1, torch.int64, False, scalar=True) for name in (INPUT_IDS, LOSS_MASK))]
    fp8 = [lay for lay in layouts if lay.shape.fp8]
    if fp8:  # read before the rows they scale; zero-padded only when handed out
        # Handed out: the delivered layers' scales; kept for the filler: every stored layer's.
        scales = max(len(lay.delivered_layer_ids if lay.raw_scales else lay.shape.layer_ids) for lay in fp8)
        fields += [Field(HIDDEN_SCALE, scales, torch.float32, first.raw_scales),
                   Field(LAST_HIDDEN_SCALE, 1, torch.float32, first.raw_scales)]
    if not nemo_keys_only:
        fields.append(Field(ATTENTION_MASK, 1, torch.int64, False, scalar=True))
    return tuple(fields)


class PendingBatch:
    """A batch whose samples are being read by the pool; ``result()`` waits and returns it."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def result(self) -> dict[str, torch.Tensor]:
        return self.future.result()  # re-raises a checksum or read error, naming shard and sample


class BatchReader:
    """Turns a rank's batches (:class:`~.order.RankBatch`) into tensors with NeMo's keys (plus our extras)."""

    def __init__(self, cache: CacheDir, layout: BatchLayout, *, batch_size: int, num_threads: int,
                 pad_to: str, pin_memory: bool, nemo_keys_only: bool = False, keep: int = 4,
                 native: bool | None = None, verify_mode: str = "once") -> None:
        if pad_to not in ("seq_length", "longest"):
            raise ValueError(f"pad_to must be 'seq_length' or 'longest', not {pad_to!r}")
        self.cache = cache
        self.layout = layout
        self.shape = layout.shape
        self.pad_to = pad_to
        self.pool = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="dspark-read")
        fields = batch_fields([layout], nemo_keys_only)
        self.extras = not nemo_keys_only
        # Program buffer i: segments.BUFFERS (the scales' empty when not FP8), then the mask.
        self.buffer_names = BUFFERS + (() if nemo_keys_only else (ATTENTION_MASK,))
        self.header_buffer = len(self.buffer_names)  # then each row's sample header, checked after the fill
        self.batch_size = batch_size
        self.native = fill.use_native_default() if native is None else native
        self._local = threading.local()
        self.verified = verify.VerifiedSamples(verify_mode)
        self.memory = BatchMemory(fields, batch_size * layout.seq_length, pinned=pin_memory, keep=keep)

    def submit(self, batch: RankBatch) -> PendingBatch:
        entries = [self.cache.require(ref.shard_id).samples[ref.entry] for ref in batch.refs]
        lengths = [e.length for e in entries]
        width = self.layout.seq_length if self.pad_to == "seq_length" else max(lengths)
        for ref, entry in zip(batch.refs, entries):
            if entry.length > self.layout.seq_length:
                raise CorruptShardError(self.cache.paths.shard_tar(ref.shard_id),
                                        f"{entry.length} tokens, more than the manifest's seq_length "
                                        f"{self.layout.seq_length}", entry.sample_id)
        # Batch memory is checked out by the reader thread (a new slab, pinned or not, is never
        # allocated on the training thread); pinned slabs are fenced on the training thread's
        # stream, captured here.
        stream = torch.cuda.current_stream() if self.memory.pinned else None
        rows = [
            (row, ref.shard_id, ref.entry, entry) for row, (ref, entry) in enumerate(zip(batch.refs, entries))
        ]
        # One task per batch: threads work on different (prefetched) batches, and a batch costs
        # one hand-over between threads instead of one per sample.
        return PendingBatch(self.pool.submit(self._read, rows, width, stream, batch.repeat))

    def _read(self, rows: list[Row], width: int, stream: "torch.cuda.Stream | None",
              repeat: list[bool]) -> dict[str, torch.Tensor]:
        """On a reader thread: check out memory, fill the batch, add the extras."""
        slab, buffers, zero = self.memory.checkout(len(rows), width, [r[3].length for r in rows], stream)
        self._fill(slab, zero, buffers, rows)
        if self.shape.fp8:
            buffers = self._fp8_keys(buffers)
        if not self.extras:
            return buffers
        extra = {
            "sample_ids": torch.tensor([r[3].sample_id for r in rows], dtype=torch.int64),
            "is_repeat": torch.tensor(repeat, dtype=torch.bool),
        }
        if self.memory.pinned:  # else their non_blocking copies to the GPU would be synchronous
            extra = {name: t.pin_memory() for name, t in extra.items()}
        return {**buffers, **extra}

    def _fp8_keys(self, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Raw FP8 batches keep their scales (the final state's as ``[B, S, 1]``, broadcastable);
        dequantised ones drop them."""
        if not self.layout.raw_scales:
            return {name: t for name, t in buffers.items() if name not in (HIDDEN_SCALE, LAST_HIDDEN_SCALE)}
        return buffers

    def fill_rows(self, slab: Slab, zero: list[tuple[int, int]], buffers: dict[str, torch.Tensor],
                  rows: list[Row]) -> None:
        """Read ``rows`` of this cache into their rows of a batch checked out elsewhere (a mixture's
        batch: each source fills its rows; ``zero``: the stale pads to clear, given to one of them)."""
        self._fill(slab, zero, buffers, rows)

    def share_thread_buffers(self, local: threading.local) -> None:
        """Use ``local``'s scratch and header buffers (a mixture's sources, one set per thread); the
        caller sizes its ``scratch`` for the largest of their rows (:meth:`scratch_bytes`)."""
        self._local = local

    def scratch_bytes(self) -> int:
        """Bytes of this reader's scratch: a chunk, the ids of a row, one whole stored row."""
        return max(fill.CHUNK, 4 * self.layout.seq_length, self.shape.hidden_dim * self.shape.itemsize)

    def _fill(self, slab: Slab, zero: list[tuple[int, int]], buffers: dict[str, torch.Tensor],
              rows: list[Row]) -> None:
        shards = {shard_id for _, shard_id, _, _ in rows}
        fds = self.cache.pin(shards)  # no descriptor of this batch is closed before it has run
        try:
            identity = {shard_id: self.cache.identity(shard_id) for shard_id in shards}
            count = {shard_id: self.cache.require(shard_id).num_samples for shard_id in shards}
            unchecked = [r for r in rows if self.verified.needed(r[1], identity[r[1]], count[r[1]], r[2])]
            if self.shape.compressed:
                self._fill_decoded(slab, zero, buffers, rows, fds, {r[0] for r in unchecked})
            else:
                program = self._program(slab, zero, buffers, rows, fds, {r[0] for r in unchecked})
                failure = fill.run(program, self._scratch(), native=self.native)
                if failure is not None:
                    self._raise(failure, rows, buffers)
            self._check_headers(rows)
            if self.layout.raw_scales:
                self._check_raw_scales(buffers, rows)
            for _, shard_id, k, _ in unchecked:  # while pinned: these descriptors are the files checked
                self.verified.mark(shard_id, identity[shard_id], count[shard_id], k)
        finally:
            self.cache.unpin(shards)

    def _fill_decoded(self, slab: Slab, zero: list[tuple[int, int]], buffers: dict[str, torch.Tensor],
                      rows: list[Row], fds: dict[int, int], check: set[int]) -> None:
        """A compressed cache's batch: each sample's stored bytes read whole (hashed when in ``check``),
        its header checked and its frame decoded here, on this reader thread (zstd and numpy release
        the GIL), into a per-thread arena; the same program then runs from there. Rows go in groups
        whose decoded bytes fit :data:`DECODE_ARENA`, so the arena stays bounded whatever the batch."""
        group: list[Row] = []
        held = 0
        first = True
        for row in [*rows, None]:
            need = 0 if row is None else self._decoded_size(row[3])
            if group and (row is None or held + need > DECODE_ARENA):
                arena, offsets, sizes = self._decode(group, fds, check, held)
                program = self._program(slab, zero if first else [], buffers, group, fds, set(),
                                        decoded=(arena, offsets, sizes))
                failure = fill.run(program, self._scratch(), native=self.native)
                if failure is not None:
                    self._raise(failure, rows, buffers)
                group, held, first = [], 0, False
            if row is not None:
                group.append(row)
                held += need

    def _decoded_size(self, entry: SampleEntry) -> int:
        """Arena bytes of a decoded sample: its header, its data section, up to 64-byte alignment."""
        header = self.shape.header_size(entry.length, entry.sample_id, entry.offset, entry.size)
        return header + self.shape.data_size(entry.length) + 63 & ~63

    def _decode(self, group: list[Row], fds: dict[int, int], check: set[int],
                total: int) -> tuple[np.ndarray, list[int], list[int]]:
        """Read, check and decode ``group``'s samples into this thread's arena; returns it, and each
        sample's offset and decoded size there. A sample that fails is named as corrupt."""
        arena = getattr(self._local, "arena", None)
        if arena is None or arena.nbytes < total:
            arena = self._local.arena = np.empty(max(total, 1 << 20), dtype=np.uint8)
        largest = max(entry.size for _, _, _, entry in group)
        stored = getattr(self._local, "stored", None)
        if stored is None or stored.nbytes < largest:
            stored = self._local.stored = np.empty(max(largest, 1 << 20), dtype=np.uint8)
        offsets, sizes, at = [], [], 0
        for row, shard_id, _, entry in group:
            path = self.cache.paths.shard_tar(shard_id)
            blob = stored[: entry.size]
            got = os.preadv(fds[shard_id], [blob], entry.offset)
            if got != entry.size:
                raise CorruptShardError(path, f"short read ({got} of {entry.size} bytes)", entry.sample_id)
            if row in check and xxhash.xxh3_64_intdigest(blob) != entry.xxh3:
                raise CorruptShardError(path, "checksum mismatch", entry.sample_id)
            header = self.shape.header_size(entry.length, entry.sample_id, entry.offset, entry.size)
            check_header(blob[:header], entry, self.shape, path)
            data_size = self.shape.data_size(entry.length)
            arena[at : at + header] = blob[:header]
            placed, itemsizes = self.shape.placed(entry.length), self.shape.itemsizes(entry.length)
            try:
                decode_data(blob[header:], placed, itemsizes, arena[at + header : at + header + data_size])
            except CodecError as exc:
                raise CorruptShardError(path, f"undecodable compressed sample ({exc})",
                                        entry.sample_id) from None
            offsets.append(at)
            sizes.append(header + data_size)
            at += self._decoded_size(entry)
        return arena, offsets, sizes

    def _program(self, slab: Slab, zero: list[tuple[int, int]], buffers: dict[str, torch.Tensor],
                 rows: list[Row], fds: dict[int, int], check: set[int],
                 decoded: tuple[np.ndarray, list[int], list[int]] | None = None) -> BatchProgram:
        """Zero the stale pads, read every row (hashing those in ``check``), then give the per-token
        fields their pads: a few array operations per batch, whatever its size (:func:`place_rows`).
        ``decoded``: the rows are decoded samples, in this buffer at these offsets and sizes."""
        lay = self.layout
        index = {name: i for i, name in enumerate(self.buffer_names)}
        program = BatchProgram([slab.field_bytes(name, buffers[name].nbytes) if name in buffers else _EMPTY
                                     for name in self.buffer_names] + [self._headers()]
                               + ([] if decoded is None else [decoded[0]]), lay.picks)
        spans = slab.zero_spans(zero)
        if spans:
            program.zeros([index[name] for name, _, _ in spans], [offset for _, offset, _ in spans],
                          [nbytes for _, _, nbytes in spans])
        width = buffers[INPUT_IDS].shape[1]
        stride = np.array([buffers[name].nbytes // buffers[name].shape[0] if name in buffers else 0
                           for name in BUFFERS], dtype=np.uint64)  # bytes per row
        entries = [entry for _, _, _, entry in rows]
        templates = [lay.template(entry.length) for entry in entries]
        stored = [entry.size for entry in entries] if decoded is None else decoded[2]
        sizes = np.array(stored, dtype=np.uint64)
        headers = sizes - np.array([t.data_size for t in templates], dtype=np.uint64)
        row_ids = np.array([row for row, _, _, _ in rows], dtype=np.int64)
        segs, counts = place_rows(templates, headers, row_ids, stride, self.header_buffer, MAX_HEADER)
        if decoded is None:
            program.samples([fds[shard_id] for _, shard_id, _, _ in rows],
                            [entry.offset for entry in entries], sizes, segs, counts, row_ids.tolist(),
                            [entry.xxh3 if row in check else None for row, _, _, entry in rows])
        else:
            program.samples_in(self.header_buffer + 1, decoded[1], sizes, segs, counts, row_ids.tolist())
        lengths = np.array([entry.length for entry in entries], dtype=np.int64)
        starts, pads = (row_ids * width + lengths) * 8, width - lengths
        program.fills([index[INPUT_IDS]] * len(rows), starts, pads, lay.pad_token_id)
        program.fills([index[LOSS_MASK]] * len(rows), starts, pads, 0)
        if ATTENTION_MASK in index:
            program.fills([index[ATTENTION_MASK]] * len(rows), row_ids * width * 8, lengths, 1)
            program.fills([index[ATTENTION_MASK]] * len(rows), starts, pads, 0)
        return program

    def _headers(self) -> np.ndarray:
        """This thread's buffer for the headers of one batch (``MAX_HEADER`` bytes per row)."""
        headers = getattr(self._local, "headers", None)
        if headers is None or len(headers) < self.batch_size * MAX_HEADER:
            headers = self._local.headers = np.zeros(self.batch_size * MAX_HEADER, dtype=np.uint8)
        return headers

    def _check_headers(self, rows: list[Row]) -> None:
        """Each header read must be the one the writer derives from the index entry: a checksum
        proves the bytes, this proves the index describes them (length, id, shape)."""
        headers = self._headers()
        for row, shard_id, _, entry in rows:
            header = self.shape.header_size(entry.length, entry.sample_id, entry.offset, entry.size)
            actual = headers[row * MAX_HEADER : row * MAX_HEADER + header]
            check_header(actual, entry, self.shape, self.cache.paths.shard_tar(shard_id))

    def _check_raw_scales(self, buffers: dict[str, torch.Tensor], rows: list[Row]) -> None:
        """Raw FP8 batches skip the filler's dequantisation, not the FP8 rule on their scales (a few bytes
        per token); their codes are checked where they are decoded (``dspark_cache.dequantize``)."""
        for name in (HIDDEN_SCALE, LAST_HIDDEN_SCALE):
            scales = buffers[name].numpy()
            for row, shard_id, _, entry in rows:
                bad = fp8_bad_scales(scales[row, : entry.length], self.shape.dtype)
                if bad.any():
                    token = int(np.argwhere(bad)[0][0])
                    raise CorruptShardError(self.cache.paths.shard_tar(shard_id), fp8_scale_reason(token),
                                            entry.sample_id)

    def _scratch(self) -> np.ndarray:
        """This thread's buffer for bytes that go nowhere (header, fill) and for ids to widen."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            # Also one whole stored row, which the filler dequantises or picks layers from here.
            scratch = self._local.scratch = page_aligned_zeros(self.scratch_bytes())
        return scratch

    def _raise(self, failure: fill.Failure, rows: list[Row], buffers: dict[str, torch.Tensor]) -> None:
        where = "a zero or fill op"  # only a bug in the program can make one of those fail
        if failure.tag is not None:
            # The tag is the batch row (a mixture's source fills some rows only: not a position in rows).
            _, shard_id, _, entry = next(r for r in rows if r[0] == failure.tag)
            path = self.cache.paths.shard_tar(shard_id)
            where = f"sample {entry.sample_id} of {path}"
            if failure.code == fill.RC_CHECKSUM:
                raise CorruptShardError(path, "checksum mismatch", entry.sample_id)
            if failure.code == fill.RC_SHORT_READ:
                raise CorruptShardError(
                    path, f"short read ({failure.detail} of {entry.size} bytes)", entry.sample_id
                )
            if failure.code == fill.RC_BAD_SCALE:
                raise CorruptShardError(path, fp8_scale_reason(failure.detail), entry.sample_id)
            if failure.code == fill.RC_BAD_CODE:
                raise CorruptShardError(path, fp8_code_reason(failure.detail), entry.sample_id)
            if failure.code == fill.RC_BAD_TOKEN:
                raise CorruptShardError(
                    path,
                    self._token_reason(buffers, failure.tag, entry.length, failure.detail),
                    entry.sample_id,
                )
            if failure.code == fill.RC_READ_ERROR:
                raise OSError(
                    failure.detail,
                    f"{os.strerror(failure.detail)} while reading sample {entry.sample_id}",
                    str(path),
                )
        raise CacheError(f"internal error: the batch program is invalid at {where}; please report it "
                         "(DSPARK_NATIVE=0 switches to the Python filler meanwhile)")

    def _token_reason(self, buffers: dict[str, torch.Tensor], row: int, length: int, token: int) -> str:
        """The token rule's own words for a row the filler refused: it wrote the widened ids (and, when
        they pass, the mask) before it stopped, and the rule judges ids first, as the fillers do, so
        a mask left from an earlier batch is never judged."""
        ids, mask = (buffers[name][row, :length].numpy() for name in (INPUT_IDS, LOSS_MASK))
        problem = token_problem(ids, mask, self.layout.vocab_size)
        return problem or f"a token id or loss mask value at token {token} is out of range"

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.memory.release()
