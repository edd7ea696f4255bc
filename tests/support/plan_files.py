"""A saved plan (``plan/``) as a forger edits it, and a bound on how long reading one may take."""

from __future__ import annotations

import json
import signal
from contextlib import contextmanager

import numpy as np
import xxhash

from dspark_cache.format.paths import CachePaths


class Overran(BaseException):
    """Not an ``Exception`` (nor an ``OSError``, as ``TimeoutError`` is): no handler of the code under
    test can take it for a failure of its own and carry on."""


@contextmanager
def deadline(seconds: float):
    """Fail the test if the block runs longer than ``seconds``."""
    def expire(*_):
        raise Overran(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _data_xxh3(path: str) -> tuple[int, str]:
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    with open(path, "rb") as handle:
        handle.seek(array.offset)
        return int(array.shape[0]), xxhash.xxh3_64_hexdigest(handle.read())


def rechecksum(paths: CachePaths) -> None:
    """Make every checksum of a saved plan match its (mutated) content, as a forger would."""
    parts = range(len(json.load(open(paths.plan_header))["parts"]))
    for part in parts:
        path = paths.plan_part_header(part)
        header = json.load(open(path))
        for kind in header["arrays"]:
            length, digest = _data_xxh3(paths.plan_part(part, kind))
            header["arrays"][kind] = {"length": length, "xxh3_64": digest}
        header["tokens"] = header["arrays"]["ids"]["length"]
        open(path, "w").write(json.dumps(header))
    path = paths.plan_header
    header = json.load(open(path))
    for name in header["arrays"]:
        length, digest = _data_xxh3(paths.plan_array(name))
        header["arrays"][name] = {"length": length, "xxh3_64": digest}
    raws = [open(paths.plan_part_header(part), "rb").read() for part in parts]
    header["parts"] = [{"length": len(raw), "xxh3_64": xxhash.xxh3_64_hexdigest(raw)} for raw in raws]
    open(path, "w").write(json.dumps(header))
