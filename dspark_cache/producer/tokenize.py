"""Row -> (input_ids, loss_mask), in process or across worker processes, in input order."""

from __future__ import annotations

import collections
import itertools
import multiprocessing
from typing import Callable, Iterable, Iterator

import numpy as np

from dspark_cache.producer.chat import EncodedRow
from dspark_cache.producer.inputs import RawRow
from dspark_cache.producer.messages import InvalidRow

Encode = Callable[[RawRow], EncodedRow]
Result = EncodedRow | InvalidRow
_CHUNK = 64
_worker_encode: Encode | None = None  # set in the parent before forking the pool


def _encode_one(encode: Encode, row: RawRow) -> Result:
    try:
        if row.error is not None:
            return row.error
        return encode(row)
    except InvalidRow as exc:
        return exc


def _to_wire(result: Result) -> tuple:
    # Plain tuples cross the process boundary (InvalidRow's constructor is not pickle-friendly).
    if isinstance(result, InvalidRow):
        return ("invalid", result.reason, result.detail)
    return ("ok", result.input_ids, result.loss_mask, result.full_length)


def _from_wire(wire: tuple) -> Result:
    if wire[0] == "invalid":
        return InvalidRow(wire[1], wire[2])
    return EncodedRow(np.asarray(wire[1]), np.asarray(wire[2]), wire[3])


def _encode_chunk(rows: list[RawRow]) -> list[tuple]:
    assert _worker_encode is not None
    return [_to_wire(_encode_one(_worker_encode, row)) for row in rows]


def encode_rows(rows: Iterable[RawRow], encode: Encode, num_workers: int = 0) -> Iterator[tuple[RawRow, Result]]:
    """Encode rows in order; ``num_workers > 1`` spreads chunks over forked processes.

    Forking is safe here: it happens before the target model is loaded or any device is used.
    """
    if num_workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for row in rows:
            yield row, _encode_one(encode, row)
        return
    global _worker_encode
    _worker_encode = encode
    chunks = iter(lambda it=iter(rows): list(itertools.islice(it, _CHUNK)), [])
    with multiprocessing.get_context("fork").Pool(num_workers) as pool:
        pending = (chunk for chunk in chunks)
        buffered: collections.deque[list[RawRow]] = collections.deque()

        def feed() -> Iterator[list[RawRow]]:
            for chunk in pending:
                buffered.append(chunk)
                yield chunk

        for results in pool.imap(_encode_chunk, feed()):
            chunk = buffered.popleft()
            for row, wire in zip(chunk, results):
                yield row, _from_wire(wire)
    _worker_encode = None
