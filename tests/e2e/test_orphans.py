"""No process a producer started outlives it: SIGKILL at four moments, then a rerun finishes the same cache.

Each run carries a marker in its environment; children inherit it, so a child that survives its
parent is found in ``/proc`` even after it was reparented. The run's descendants are also
recorded from the process tree while it runs, so the check is not vacuous: while rows are
encoded the pool's workers must have been seen.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from dspark_cache.format.manifest import read_manifest
from dspark_cache.format.paths import CachePaths
from tests.support.produce import produce_args, run_produce
from tests.support.proc import assert_same_samples, producer_cmd
from tests.support.processes import MARKER, descendants, kill_marked, marked, process_stat, wait_gone
from tests.support import warm

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="walks /proc")

GONE_WITHIN_S = 10.0


def kill_and_check(
    args: list[str], log: str, crash_at: str | None = None, until=None
) -> set[tuple[int, int]]:
    """Run the producer; it is SIGKILLed at ``crash_at`` (a fault point) or once ``until(descendants)``
    holds. Returns the descendants seen; asserts that none of them (nor any process of the run) remains.

    Output goes to a file: a surviving child would hold a pipe open and hang the test instead of failing it.
    """
    run = uuid.uuid4().hex
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", MARKER: run,
           **({"DSPARK_CRASH_AT": crash_at} if crash_at else {})}
    seen: set[tuple[int, int]] = set()
    with open(log, "w") as out:
        proc = subprocess.Popen(producer_cmd(*args), env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while proc.poll() is None:
            now = descendants(proc.pid)
            seen |= now
            if until is not None and until(now):
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
        proc.wait(timeout=120)
        left = wait_gone(seen, run, GONE_WITHIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_marked(run)
    with open(log) as handle:
        tail = handle.read()[-3000:]
    assert proc.returncode == -signal.SIGKILL, tail
    assert not left, f"processes of the killed run still alive {GONE_WITHIN_S} s later: {sorted(left)}"
    return seen


@pytest.mark.slow
def test_sigkill_at_four_moments_leaves_no_process_and_a_rerun_completes(embedded, tmp_path):
    from dspark_cache.embedded.data import write_sample_data

    # 3 chunks: both workers start
    data = write_sample_data(str(tmp_path / "rows.jsonl"), num_rows=160, seed=5)
    opts = ("--seq-length", "64", "--shard-size", "40", "--batch-size", "8", "--num-workers", "2")
    out = str(tmp_path / "out")
    args = produce_args(embedded.stock, data, out, *opts)
    log = str(tmp_path / "produce.log")
    workers = kill_and_check(args, log, until=lambda now: len(now) >= 2)  # while the pool encodes rows
    assert len(workers) >= 2
    kill_and_check(args, log, crash_at="merging_plan")
    kill_and_check(args, log, crash_at="after_index:1")  # computing: one shard published, more to go
    published = len(CachePaths(out).indexed_shard_ids())
    left = read_manifest(out, allow_incomplete=True).num_shards - published
    assert left >= 2
    kill_and_check(args, log, crash_at=f"mid_shard:{left}")  # the last shard, half written
    done = warm.run(
        producer_cmd(*args),
        {**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reference = str(tmp_path / "reference")
    assert run_produce(embedded.stock, data, reference, *opts) == 0
    assert assert_same_samples(out, reference) > 0


PARENT = """
import subprocess, sys
from dspark_cache.cli.lifetime import exec_with_parent
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], preexec_fn=exec_with_parent())
print(child.pid, flush=True)
child.wait()
"""
CHILD = """
import signal, sys, time
def stop(*_):
    open(sys.argv[1], "w").write("SIGTERM")
    sys.exit(3)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[1] + ".ready", "w").close()
time.sleep(120)
"""


def test_a_program_we_start_gets_sigterm_when_we_are_sigkilled(tmp_path):
    """The rule ``dspark-produce --tui`` starts its producer with: it stops gracefully if the monitor dies."""
    note = tmp_path / "child-saw"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, str(note)], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + GONE_WITHIN_S
    while not os.path.exists(f"{note}.ready") and time.monotonic() < deadline:  # its handler is installed
        time.sleep(0.05)
    assert process_stat(child) is not None
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + GONE_WITHIN_S
    while (info := process_stat(child)) is not None and info[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert info is None or info[0] == "Z", "the child outlived its SIGKILLed parent"
    assert note.read_text() == "SIGTERM"


@pytest.mark.slow
def test_torchrun_ranks_stop_when_their_agent_is_sigkilled(embedded, tmp_path):
    """A scheduler's SIGKILL of torchrun's agent forwards nothing: each rank stops by itself (exit 3 at
    a shard boundary), none is left running, and a rerun completes the cache."""
    from tests.support.proc import BIN, published, wait_for

    out = str(tmp_path / "out")
    args = produce_args(embedded.stock, embedded.data, out, "--seq-length", "256", "--shard-size", "2",
                        "--batch-size", "2", "--dtype", "fp32", "--num-workers", "0")
    run = uuid.uuid4().hex
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", MARKER: run}
    cmd = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "dspark_cache.producer",
           *args]
    with open(tmp_path / "torchrun.log", "w") as log:
        agent = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: published(out) >= 2, timeout=240)
        ranks = marked(run) - {agent.pid}
        assert len(ranks) == 2
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 60  # the shard in flight is finished first
        while marked(run) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = marked(run)
    finally:
        for pid in marked(run):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"ranks still running 60 s after their agent was SIGKILLed: {sorted(left)}"
    states = [open(CachePaths(out).status(r)).read() for r in (0, 1)]
    assert all('"state":"stopped"' in s for s in states), states
    done = warm.run(
        producer_cmd(*args),
        {**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert read_manifest(out, allow_incomplete=True).complete
