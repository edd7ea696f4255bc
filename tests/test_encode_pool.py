"""The encoding pool reads the input as its workers need it: never every parsed row at once."""

from __future__ import annotations

from dspark_cache.producer import encode_pool
from dspark_cache.producer.chat import EncodedRow
from dspark_cache.producer.inputs import RawRow


def _encode(row: RawRow) -> EncodedRow:
    import numpy as np

    n = 3 + row.index % 5
    return EncodedRow(np.full(n, row.index, np.int32), np.ones(n, np.uint8), n)


def test_rows_are_read_a_few_chunks_ahead_and_results_keep_input_order():
    pulled = []

    def rows():
        for i in range(5000):
            pulled.append(i)
            yield RawRow(i, f"data.jsonl:{i + 1}")

    results = encode_pool.encode_rows(rows(), _encode, num_workers=2)
    first_row, first = next(results)
    ahead = 2 * encode_pool._AHEAD * encode_pool._CHUNK
    assert first_row.index == 0 and int(first.input_ids[0]) == 0
    assert len(pulled) <= ahead + encode_pool._CHUNK  # not the whole input
    rest = list(results)
    assert [row.index for row, _ in rest] == list(range(1, 5000))
    assert all(int(result.input_ids[0]) == row.index for row, result in rest)


def _encode_or_die(row: RawRow) -> EncodedRow:
    import os
    import signal

    if row.index == 100:
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a native abort would end the worker
    return _encode(row)


def test_a_worker_that_dies_names_its_rows_and_what_to_do(monkeypatch):
    import pytest

    rows = (RawRow(i, f"data.jsonl:{i + 1}") for i in range(300))
    with pytest.raises(encode_pool.WorkerDiedError) as caught:
        list(encode_pool.encode_rows(rows, _encode_or_die, num_workers=2))
    message = str(caught.value)
    # The first chunk not yet returned: the killing row's (rows 65-128) or, if it was still running, the one before.
    assert ("from data.jsonl:65 on" in message or "from data.jsonl:1 on" in message), message
    assert "--num-workers 0" in message


def _encode_or_run_out(row: RawRow) -> EncodedRow:
    if row.index == 70:
        raise MemoryError()  # what a failed allocation raises: no text at all
    return _encode(row)


def test_running_out_of_memory_on_a_row_says_where_and_what_to_do():
    import pytest

    for workers in (0, 2):
        rows = (RawRow(i, f"data.jsonl:{i + 1}") for i in range(200))
        with pytest.raises(MemoryError, match=r"out of memory while encoding the row at data\.jsonl:71; lower "):
            list(encode_pool.encode_rows(rows, _encode_or_run_out, num_workers=workers))
