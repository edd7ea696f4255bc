"""The encoding pool reads the input as its workers need it: never every parsed row at once."""

from __future__ import annotations

import pytest

from dspark_cache.producer.encode import pool as encode_pool
from dspark_cache.producer.encode.chat import EncodedRow
from dspark_cache.producer.inputs.rows import RawRow


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
        with pytest.raises(
            MemoryError, match=r"out of memory while encoding the row at data\.jsonl:71; lower "
        ):
            list(encode_pool.encode_rows(rows, _encode_or_run_out, num_workers=workers))


@pytest.mark.slow
def test_two_interrupts_while_workers_encode_exit_3_at_once_and_leave_no_worker(embedded, tmp_path):
    """The second Ctrl-C of two, while the pool encodes rows: exit 3 in seconds, every worker gone.

    Left to ``shutdown(wait=True)`` the process hung at exit, joining workers idle on the call queue.
    Output goes to a file: a surviving worker would hold a pipe open and hang the test instead of failing it.
    """
    import os
    import signal
    import subprocess
    import sys
    import time
    import uuid

    from dspark_cache.embedded.data import write_sample_data
    from tests.support.produce import produce_args
    from tests.support.proc import producer_cmd
    from tests.support.processes import MARKER, alive, descendants, kill_marked, wait_gone

    if not sys.platform.startswith("linux"):
        pytest.skip("walks /proc")
    # encoding lasts many seconds
    data = write_sample_data(str(tmp_path / "big.jsonl"), num_rows=4000, seed=5)
    args = produce_args(embedded.stock, data, str(tmp_path / "out"), "--num-workers", "2")
    run = uuid.uuid4().hex
    log = str(tmp_path / "produce.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            producer_cmd(*args),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", MARKER: run},
        )
    try:
        deadline = time.monotonic() + 120
        while (
            len(workers := descendants(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        assert len(workers) >= 2, "the pool's workers never started"
        time.sleep(0.5)  # rows are being encoded
        assert alive(workers) and proc.poll() is None, "encoding ended before the signals"
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            code = None
        left = wait_gone(workers, run, 5)
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_marked(run)
    with open(log) as handle:
        text = handle.read()
    assert code == 3, f"exit {code} (None: still running 15 s after the second SIGINT):\n{text[-3000:]}"
    assert not left, f"processes of the interrupted run still alive: {sorted(left)}"
    assert text.count("dspark-produce: aborted; rerun the same command to resume") == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
