"""Batch memory bookkeeping: only pad slots an earlier batch wrote are zeroed, and that is enough."""

from __future__ import annotations

import numpy as np
import torch

from dspark_cache.loader import fill
from dspark_cache.loader.memory import BatchMemory, Field, Slab, page_aligned_zeros
from dspark_cache.loader.program import BatchProgram

FIELDS = (Field("hidden", 3, torch.bfloat16, True), Field("ids", 1, torch.int64, False, scalar=True))


def zero_claimed(slab: Slab, ranges: list[tuple[int, int]]) -> None:
    """Zero what claim asked for, through a batch program (as the reader does)."""
    names = [f.name for f in slab.fields]
    program = BatchProgram(
        [slab.field_bytes(name, t.nbytes) for name, t in slab.views(1, slab.capacity).items()]
    )
    for name, offset, nbytes in slab.zero_spans(ranges):
        program.zero(names.index(name), offset, nbytes)
    assert fill.run(program, page_aligned_zeros(4096), native=fill.use_native_default()) is None


def test_claimed_zeroing_leaves_every_pad_slot_zero():
    rng = np.random.default_rng(0)
    slab = Slab(FIELDS, 4 * 16, pinned=False)
    for _ in range(300):
        rows = int(rng.integers(1, 5))
        width = int(rng.integers(1, 17))
        lengths = rng.integers(0, width + 1, rows).tolist()
        zero_claimed(slab, slab.claim(width, lengths))
        view = slab.views(rows, width)["hidden"]
        for row, n in enumerate(lengths):  # a sample writes non-zero data in its own slots
            view[row, :n] = float(rng.integers(1, 9))
        for row, n in enumerate(lengths):
            assert not view[row, n:].any()
            assert view[row, :n].all()


def test_claim_zeroes_only_what_was_written():
    slab = Slab(FIELDS, 2 * 8, pinned=False)
    assert slab.claim(8, [8, 3]) == []  # fresh memory is zeros: nothing to zero
    # The first batch wrote slots 0-7 and 8-10. Width 5 moves the rows: row 0 pads slots 2-4
    # (written), row 1 holds slots 5-8 and pads slot 9 (written by the first batch's row 1).
    assert slab.claim(5, [2, 4]) == [(2, 5), (9, 10)]
    # Slot 10 (beyond the 10 slots of the second batch) still holds the first batch's data;
    # rows 0 and 1 span first-to-last written pad slot (clean slots inside are zeroed too).
    assert slab.claim(8, [1, 1]) == [(1, 8), (10, 11)]


def test_slab_is_recycled_only_when_nothing_outside_holds_it():
    memory = BatchMemory(FIELDS, 16, pinned=False, keep=2)
    first = memory.take(2, 8)
    held = first.views(2, 8)["ids"][1]  # a view of one row is enough to hold the slab
    second = memory.take(2, 8)
    assert second is not first
    in_flight = second.views(2, 8)
    third = memory.take(2, 8)  # both kept slabs are busy: a new one, not an overwrite
    assert third is not first and third is not second
    assert memory.take(2, 8) is third  # nothing views the third: it is recycled at once
    # The pool keeps 2 slabs: the third took the held one's place, so once released the held
    # one is freed, never handed out again (memory stays bounded whatever training keeps).
    del held
    assert memory.take(2, 8) is third
    del in_flight
    assert memory.take(2, 8) in (second, third)


def test_the_idle_slab_with_the_fewest_stale_pads_is_recycled():
    memory = BatchMemory(FIELDS, 2 * 8, pinned=False, keep=2)
    long_rows, held, _ = memory.checkout(2, 8, [8, 8])
    short_rows, batch, _ = memory.checkout(2, 8, [2, 2])  # the first is held: another slab
    assert long_rows is not short_rows
    del held, batch  # both idle now
    # A batch of two 3-token rows: the slab that held 2-token rows has nothing to zero.
    slab, batch, zero = memory.checkout(2, 8, [3, 3])
    assert slab is short_rows and zero == []
    del batch
    # Rows of 1 token now: that slab has 2 stale pad slots (3-token rows), the other 14.
    slab, _, zero = memory.checkout(2, 8, [1, 1])
    assert slab is short_rows and zero == [(1, 3), (9, 11)]
    assert long_rows.stale(8, [1, 1]) == [(1, 8), (9, 16)]


def test_batch_memory_is_allocated_off_the_training_thread(small_cache, monkeypatch):
    import threading

    import dspark_cache
    from dspark_cache.loader import memory

    made_on: list[str] = []
    original = memory.Slab.__init__

    def recording(self, *args, **kwargs):
        made_on.append(threading.current_thread().name)
        original(self, *args, **kwargs)

    monkeypatch.setattr(memory.Slab, "__init__", recording)
    for _ in dspark_cache.build_dataloader(small_cache, 3, seed=1, num_workers=2):
        pass
    assert made_on and all(name.startswith("dspark-read") for name in made_on), made_on


def _slabs_of(loader) -> list:
    import weakref

    return [weakref.ref(slab) for slab in loader.reader.memory._pool]


def test_a_dropped_loader_frees_its_batch_memory_without_a_garbage_collection(small_cache):
    """No reference cycle through the loader: its slabs go with its last reference, not at the next
    full collection (which may not come for a long time, holding hundreds of MB)."""
    import gc

    import dspark_cache

    gc.disable()
    try:
        loader = dspark_cache.build_dataloader(small_cache, 3, seed=1, num_workers=2)
        assert len(loader.dataset) > 0 and loader.sampler is loader  # NeMo's attributes still there
        for batch in loader:
            pass
        slabs = _slabs_of(loader)
        loader.close()
        del loader, batch
        assert slabs and all(ref() is None for ref in slabs)
    finally:
        gc.enable()


def test_close_frees_the_batch_memory_but_never_a_batch_training_holds(small_cache):
    import dspark_cache

    loader = dspark_cache.build_dataloader(small_cache, 3, seed=1, num_workers=2)
    batches = list(loader)
    kept = batches[0]["target_hidden_states"].clone()
    slabs = _slabs_of(loader)
    loader.close()  # the loader object lives on: its memory must not
    held = {id(ref()) for ref in slabs if ref() is not None}
    assert len(held) <= len(batches)  # only slabs that a batch in ``batches`` still views
    assert torch.equal(batches[0]["target_hidden_states"], kept)
    del batches
    assert all(ref() is None for ref in slabs)
