"""Golden caches: the same caches made by two checkouts, compared byte for byte (a restructure's check).

    .venv/bin/python bench/golden_caches.py BEFORE_CHECKOUT AFTER_CHECKOUT --workdir DIR [--s3-endpoint URL]

Each checkout (its C extensions built in place) makes, from the embedded target and sample data of
``make demo`` (``.demo/``), a local bf16 cache, an FP8 one, a zstd one, a 2-rank one (torchrun), one on
object storage (an S3-compatible endpoint with a bucket named ``golden``; skipped without
``--s3-endpoint``) and the bf16 cache converted to NeMo's layout and back. Tars and safetensors files must
be equal byte for byte; JSON files (manifests, shard indexes, the plan) equal but for what names one run
(cache id, times, versions). Prints one line per cache; exit 1 on any difference.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import shutil
import subprocess
import sys
from typing import Any

VOLATILE = {"cache_id", "created_at", "completed_at", "versions", "run_id", "started_at"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
ARGS = ["--seq-length", "512", "--shard-size", "8", "--batch-size", "4", "--writer-threads", "2"]
SKIPPED = ("logs", "status", "events", "control", "staging")  # what one run leaves about itself


def make(checkout: str, out: str, endpoint: str | None) -> None:
    """Every golden cache of ``checkout`` under ``out``."""
    env = dict(os.environ, PYTHONPATH=checkout)
    target, data = os.path.join(ROOT, ".demo", "target"), os.path.join(ROOT, ".demo", "data.jsonl")
    base = ["--target-model", target, "--input-data", data, *ARGS]

    def run(*cmd: str, extra: dict[str, str] | None = None) -> None:
        done = subprocess.run(cmd, env={**env, **(extra or {})}, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")

    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    produce = os.path.join(BIN, "dspark-produce")
    run(produce, *base, "--output-dir", os.path.join(out, "bf16"))
    run(produce, *base, "--output-dir", os.path.join(out, "fp8"), "--dtype", "fp8")
    run(produce, *base, "--output-dir", os.path.join(out, "zstd"), "--compression", "zstd")
    run(os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", str(random.randint(20000, 40000)),
        "-m", "dspark_cache.producer", *base, "--output-dir", os.path.join(out, "ranks2"))
    convert = os.path.join(BIN, "dspark-convert")
    run(convert, os.path.join(out, "bf16"), os.path.join(out, "nemo"), "--to", "nemo")
    run(convert, os.path.join(out, "nemo"), os.path.join(out, "back"), "--to", "dspark")
    if endpoint:
        s3 = {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "test",
              "AWS_SECRET_ACCESS_KEY": "test"}
        url = f"s3://golden/{os.path.basename(out)}"
        run(produce, *base, "--output-dir", url, "--staging-dir", os.path.join(out, "staging"), extra=s3)
        run(convert, url, os.path.join(out, "s3"), "--to", "nemo", extra=s3)  # brought down whole


def _json(path: str) -> Any:
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in VOLATILE}
        return [strip(v) for v in value] if isinstance(value, list) else value
    with open(path, encoding="utf-8") as handle:
        return strip(json.load(handle))


def compare(before: str, after: str) -> list[str]:
    """What differs between two caches (empty: the same)."""
    def files(root: str) -> set[str]:
        return {os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names
                if os.path.relpath(d, root).split(os.sep)[0] not in SKIPPED}
    ours, theirs = files(before), files(after)
    problems = [f"only in one: {name}" for name in sorted(ours ^ theirs)]
    for name in sorted(ours & theirs):
        a, b = os.path.join(before, name), os.path.join(after, name)
        if name.endswith((".json", ".idx")):
            same = _json(a) == _json(b)
        else:
            same = filecmp.cmp(a, b, shallow=False)
        if not same:
            problems.append(f"differs: {name}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--s3-endpoint", default=None)
    args = parser.parse_args()
    for name, checkout in (("before", args.before), ("after", args.after)):
        make(os.path.abspath(checkout), os.path.join(args.workdir, name), args.s3_endpoint)
    failed = False
    for cache in sorted(os.listdir(os.path.join(args.workdir, "before"))):
        if cache == "staging":
            continue
        problems = compare(os.path.join(args.workdir, "before", cache), os.path.join(args.workdir, "after", cache))
        failed |= bool(problems)
        print(f"{cache}: {'the same' if not problems else '; '.join(problems[:5])}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
