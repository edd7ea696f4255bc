"""``dspark-verify CACHE_DIR``: check a cache byte for byte against its manifest and indexes."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, field

import msgspec

from dspark_cache.format.errors import CacheError, CorruptShardError
from dspark_cache.format.paths import CachePaths
from dspark_cache.format.schema import Manifest, decode_manifest
from dspark_cache.format.tar.reader import ShardReader, load_shard_index

EXIT_OK, EXIT_PROBLEMS, EXIT_NOT_A_CACHE = 0, 1, 2


@dataclass
class Report:
    cache: str
    complete: bool = False
    shards_total: int = 0
    shards_ok: int = 0
    samples_ok: int = 0
    missing: list[int] = field(default_factory=list)
    corrupt: list[dict] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.complete and not self.missing and not self.corrupt


def verify_cache(path: str) -> Report:
    """Check every planned shard: index present, tar present with the indexed size, checksums."""
    paths = CachePaths(path)
    try:
        with open(paths.manifest, "rb") as handle:
            manifest: Manifest = decode_manifest(handle.read(), paths.manifest)
    except FileNotFoundError as exc:
        raise CacheError(f"{path} is not a dspark cache (no manifest.json)") from exc
    except msgspec.DecodeError as exc:
        raise CacheError(str(exc)) from exc
    report = Report(cache=path, complete=manifest.complete, shards_total=manifest.num_shards,
                    leftovers=paths.partial_files())
    indexed = set(paths.indexed_shard_ids())
    for shard_id in range(manifest.num_shards):
        if shard_id not in indexed:
            report.missing.append(shard_id)
            if os.path.exists(paths.shard_tar(shard_id)):  # renamed, killed before its index: unpublished
                report.leftovers.append(paths.shard_tar(shard_id))
            continue
        try:
            index = load_shard_index(paths, shard_id)
            with ShardReader(paths, shard_id, index) as reader:
                reader.verify()
            report.shards_ok += 1
            report.samples_ok += index.num_samples
        except CorruptShardError as exc:
            report.corrupt.append({"shard": shard_id, "path": exc.path, "sample": exc.sample_id, "reason": str(exc)})
    return report


def repair(path: str, report: Report) -> None:
    """Unpublish corrupt shards: index first (readers stop seeing it), then the tar."""
    paths = CachePaths(path)
    for problem in report.corrupt:
        for file in (paths.shard_index(problem["shard"]), paths.shard_tar(problem["shard"])):
            if os.path.exists(file):
                os.unlink(file)
        problem["repaired"] = True


def format_ranges(ids: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``1-3, 7``: thousands of shard ids stay readable."""
    parts: list[str] = []
    for i in sorted(ids):
        if parts and i == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{i}"
        else:
            parts.append(str(i))
    return ", ".join(parts)


def _print_human(report: Report) -> None:
    state = "complete" if report.complete else "INCOMPLETE"
    print(f"{report.cache}: {state}, {report.shards_ok}/{report.shards_total} shards verified, "
          f"{report.samples_ok} samples")
    if report.missing:
        print(f"missing shards: {format_ranges(report.missing)}")
    for problem in report.corrupt:
        done = " (deleted: rerun dspark-produce to recompute it)" if problem.get("repaired") else ""
        print(f"corrupt shard {problem['shard']}: {problem['reason']}{done}")
    for leftover in report.leftovers:
        print(f"leftover from an interrupted run (deleted by the next dspark-produce): {leftover}")
    if report.ok:
        print("OK")
    elif report.corrupt and not all(p.get("repaired") for p in report.corrupt):
        print("Run dspark-verify --repair to unpublish the corrupt shards, then rerun dspark-produce with the "
              "cache's original arguments: it recomputes exactly those shards.")
    else:
        print("Rerun dspark-produce with the cache's original arguments to compute the missing shards "
              "(or wait, if a producer is still running).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark-verify", description="Verify a dspark cache: manifest, "
                                     "every shard index, every shard and sample checksum.")
    parser.add_argument("cache_dir")
    parser.add_argument("--json", action="store_true", help="print one JSON object for machines")
    parser.add_argument("--repair", action="store_true",
                        help="delete corrupt shards (tar and index) so that a dspark-produce rerun recomputes them")
    args = parser.parse_args(argv)
    try:
        report = verify_cache(args.cache_dir)
        if args.repair:
            repair(args.cache_dir, report)
    except CacheError as exc:
        print(f"dspark-verify: error: {exc}", file=sys.stderr)
        return EXIT_NOT_A_CACHE
    if args.json:
        print(msgspec.json.encode({**asdict(report), "ok": report.ok}).decode())
    else:
        _print_human(report)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


if __name__ == "__main__":
    sys.exit(main())
