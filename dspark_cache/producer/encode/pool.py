"""Run the row encoder over every input row, in input order: in process, or across forked worker processes.

A row whose content cannot be encoded becomes an :class:`InvalidRow` result rather than an
exception, so that one bad row cannot abort a pool of workers; the planner applies the
``--on-invalid`` policy. That includes a tokenizer's Rust panic (``pyo3_runtime.PanicException``,
a ``BaseException`` whose class no other process can import, so it must not leave a worker as an
exception). A bad chat template or running out of memory still raises.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Iterator

from dspark_cache.cli.lifetime import die_with_parent
from dspark_cache.producer.encode.chat import EncodedRow
from dspark_cache.producer.encode.template import ChatTemplateError
from dspark_cache.producer.inputs.rows import InvalidRow, RawRow

Encode = Callable[[RawRow], EncodedRow]
Result = EncodedRow | InvalidRow
_CHUNK = 64
_AHEAD = 4  # chunks in flight per worker: enough to keep every worker busy
_REAP_S = 5.0  # how long to wait for a killed worker to be reaped
_worker_encode: Encode | None = None  # set in the parent before forking the pool


class WorkerDiedError(RuntimeError):
    """An encoding worker process ended abruptly (a signal, the OOM killer, a native abort)."""


def is_rust_panic(exc: BaseException) -> bool:
    """A panic inside a Rust extension (tokenizers, safetensors): each defines its own class, same name."""
    return type(exc).__name__ == "PanicException" and type(exc).__module__ == "pyo3_runtime"


def _clipped(exc: BaseException) -> str:
    detail = f"{type(exc).__name__}: {exc}"
    return f"{detail[:300]}{'...' if len(detail) > 300 else ''}"


def _encode_one(encode: Encode, row: RawRow) -> Result:
    """A row's sample, or why it is invalid: whatever a row holds, it never aborts the run."""
    try:
        if row.error is not None:
            return row.error
        return encode(row)
    except InvalidRow as exc:
        return exc
    except RecursionError:
        return InvalidRow("nested too deeply", "the row is nested too deeply to render")
    except ChatTemplateError:
        raise
    except MemoryError:  # not the row's fault alone, and a bare MemoryError says nothing
        raise MemoryError(
            f"out of memory while encoding the row at {row.where}; lower --num-workers (each worker "
            "holds its rows) or --max-row-bytes, or free memory, then rerun"
        ) from None
    except Exception as exc:  # the template or tokenizer refused this row's content
        return InvalidRow(
            "cannot encode", f"the chat template or tokenizer failed on this row ({_clipped(exc)})"
        )
    except BaseException as exc:
        if not is_rust_panic(exc):
            raise
        return InvalidRow(
            "tokenizer panic", f"the tokenizer crashed (a Rust panic) on this row ({_clipped(exc)})"
        )


def _worker_init(parent: int) -> None:
    # Workers inherit the parent's graceful-stop handlers; they must die on SIGTERM (that is
    # how the pool ends them) and leave SIGINT to the parent. A worker waits on a pipe it holds
    # both ends of, so it would never notice a parent killed outright: the kernel ends it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)


def _encode_chunk(rows: list[RawRow]) -> list[Result]:
    assert _worker_encode is not None
    return [_encode_one(_worker_encode, row) for row in rows]


def _results(rows: list[RawRow], future: Future) -> Iterator[tuple[RawRow, Result]]:
    try:
        return zip(rows, future.result())
    except BrokenProcessPool:
        raise WorkerDiedError(
            f"an encoding worker process died on a row from {rows[0].where} on (killed by a signal, out of memory, "
            "or a tokenizer that aborted the process); rerun with --num-workers 0 to find the row (its error then "
            "names it), or with fewer --num-workers if memory ran out"
        ) from None


def encode_rows(
    rows: Iterable[RawRow], encode: Encode, num_workers: int = 0
) -> Iterator[tuple[RawRow, Result]]:
    """Encode rows in order; ``num_workers > 1`` spreads chunks over forked processes.

    Forking is safe here: it happens before the target model is loaded or any device is used.
    """
    if num_workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for row in rows:
            yield row, _encode_one(encode, row)
        return
    global _worker_encode
    _worker_encode = encode
    # Chunks are read as the workers need them, a few per worker ahead: never the whole input
    # (parsed rows) in memory at once.
    chunks = iter(lambda it=iter(rows): list(itertools.islice(it, _CHUNK)), [])
    window = num_workers * _AHEAD
    # ProcessPoolExecutor, not Pool: a worker that dies raises BrokenProcessPool instead of
    # leaving the planner waiting forever for a lost chunk.
    context = multiprocessing.get_context("fork")
    pool = ProcessPoolExecutor(
        num_workers, mp_context=context, initializer=_worker_init, initargs=(os.getpid(),)
    )
    try:
        pending: deque[tuple[list[RawRow], Future]] = deque()
        for chunk in chunks:
            pending.append((chunk, pool.submit(_encode_chunk, chunk)))
            if len(pending) >= window:
                yield from _results(*pending.popleft())
        while pending:
            yield from _results(*pending.popleft())
    # an interrupt, a closed generator, a failed row: the chunks in flight are not wanted
    except BaseException:
        _abandon(pool)
        raise
    else:
        pool.shutdown(wait=True)
    finally:
        _worker_encode = None


def _abandon(pool: ProcessPoolExecutor) -> None:
    """End the pool's workers now, not once they have drained the queue.

    ``shutdown(wait=True)`` (what ``with`` does) waits for every chunk in flight; left to it, the
    second Ctrl-C of two hung the process at exit, in multiprocessing's join of workers idle on
    the call queue (issue 23, item 21). Workers
    hold nothing worth saving, so they are killed (SIGKILL) and reaped. ``kill_workers`` is public
    from Python 3.14; before it the executor's ``_processes`` (pid to ``multiprocessing.Process``)
    is the only way to reach them, read before ``shutdown`` forgets it.
    """
    processes = list((getattr(pool, "_processes", None) or {}).values())
    kill = getattr(pool, "kill_workers", None)
    # Python 3.14 on: shutdown(wait=False, cancel_futures=True), then SIGKILL each worker
    if kill is not None:
        kill()
    else:
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.exitcode is None:
                process.kill()
    for process in processes:
        process.join(timeout=_REAP_S)
    # The executor's manager thread closes its wake-up pipe as it winds down; if the interpreter
    # exits meanwhile, concurrent.futures' exit hook (Python < 3.12) can write to the pipe as it
    # closes and print a traceback after our one-line message. Let the thread finish first.
    manager = getattr(pool, "_executor_manager_thread", None)
    if manager is not None:
        manager.join(timeout=_REAP_S)
