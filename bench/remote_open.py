"""Opening a remote cache of many shards: index copies one at a time against several in flight.

    python bench/remote_open.py                      # 2,000 shards of one sample each, H=64
    python bench/remote_open.py --shards 5000 --repeat 5

Opening a cache on object storage copies every shard's index to the node (``NodeMirror.refresh_listing``):
a real training cache has thousands of shards, so that is thousands of GETs before the first batch.
This writes a synthetic cache with bench/loader.py's ``make_cache`` (one short sample a shard: the
index GETs, not the bytes, are what is timed), uploads it to moto's S3 server (a process of its own
on this machine), then, interleaved per repetition, opens it with ``CacheDir(s3://...)`` into an
empty local_cache_dir with the index copies in flight set to 1 (before this change) and to the
mirror's default. Medians of --repeat, and their ratio. moto answers from this machine in about a
millisecond; a real store's round trip is 10-50 ms, where the serial open takes that much longer
per shard and the ratio grows toward the number in flight.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from loader import make_cache  # noqa: E402  (bench/loader.py)

from dspark_cache.storage.backing import StorageOptions  # noqa: E402
from dspark_cache.storage.cache import CacheDir  # noqa: E402
from dspark_cache.storage.remote import copies  # noqa: E402
from tests.support.remote import upload_cache  # noqa: E402
from tests.support.s3server import S3Server  # noqa: E402


def open_seconds(url: str, options: dict, node: str, in_flight: int) -> float:
    copies._SMALL_IN_FLIGHT = in_flight
    t = time.perf_counter()
    cache = CacheDir(url, storage=StorageOptions(options, node))
    seconds = time.perf_counter() - t
    assert len(cache.indexed_ids()) > 0
    cache.close()
    shutil.rmtree(node, ignore_errors=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    default = copies._SMALL_IN_FLIGHT
    with tempfile.TemporaryDirectory() as work, S3Server() as server:
        root, _ = make_cache(os.path.join(work, "cache"), args.shards, 64, 256, 1, seed=0)
        os.environ.update(server.env())
        server.make_bucket("bench")
        url, options = "s3://bench/open", {"endpoint": server.endpoint}
        upload_cache(root, url, storage_options=options)
        runs: dict[int, list[float]] = {1: [], default: []}
        for rep in range(args.repeat):
            for n in runs:
                runs[n].append(open_seconds(url, options, os.path.join(work, f"node-{n}-{rep}"), n))
        serial, parallel = statistics.median(runs[1]), statistics.median(runs[default])
        print(f"open of {args.shards} shards from moto: 1 in flight {serial:.2f} s, {default} in flight "
              f"{parallel:.2f} s (medians of {args.repeat}); ratio {serial / parallel:.2f}x")
        print({n: [round(s, 2) for s in v] for n, v in runs.items()})


if __name__ == "__main__":
    main()
