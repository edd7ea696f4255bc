"""Uploading a staged tar with obstore: from an open file (read through Python) against from its path.

    python bench/object_store_upload.py

A 200 MiB file of random bytes on /dev/shm, put to moto's S3 server (a process on this machine) as
``ObjectStore.upload`` puts a large tar (multipart, 16 MiB parts, 8 in flight), alternating the two
ways, 3 times each. Printed per run: wall seconds, this process's CPU seconds, and how fast a Python
thread spinning beside the upload ran (millions of loop steps a second: the GIL left to the rest of
the producer, whose main thread copies batches while shards upload).
"""

from __future__ import annotations

import os
import pathlib
import resource
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import obstore  # noqa: E402
import obstore.store  # noqa: E402

from tests.support.s3server import S3Server  # noqa: E402

SIZE = 200 << 20


def _spin(stop: threading.Event, out: list[int]) -> None:
    n = 0
    while not stop.is_set():
        for _ in range(1000):
            n += 1
    out.append(n)


def upload(store, path: str, kind: str) -> tuple[float, float, float]:
    """(wall s, CPU s, spinner's million steps a second) of one put from an open file or from the path."""
    stop, out = threading.Event(), []
    spinner = threading.Thread(target=_spin, args=(stop, out))
    spinner.start()
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if kind == "file":
        with open(path, "rb") as handle:
            obstore.put(store, "k", handle, use_multipart=True, chunk_size=16 << 20, max_concurrency=8)
    else:
        obstore.put(
            store, "k", pathlib.Path(path), use_multipart=True, chunk_size=16 << 20, max_concurrency=8
        )
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    stop.set()
    spinner.join()
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu, out[0] / wall / 1e6


def main() -> None:
    path = "/dev/shm/dspark-upload-bench.bin"
    with S3Server() as server:
        server.make_bucket("upload-bench")
        os.environ.update(server.env())
        store = obstore.store.from_url("s3://upload-bench", config={"endpoint": server.endpoint},
                                       client_options={"allow_http": True})
        with open(path, "wb") as handle:
            handle.write(os.urandom(SIZE))
        try:
            for _ in range(3):
                for kind in ("file", "path"):
                    wall, cpu, spins = upload(store, path, kind)
                    print(
                        f"{kind:4}: wall {wall:.2f} s, CPU {cpu:.2f} s, spinner {spins:.1f} M steps/s",
                        flush=True,
                    )
        finally:
            os.unlink(path)


if __name__ == "__main__":
    main()
