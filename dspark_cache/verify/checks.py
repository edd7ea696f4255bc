"""The checks of ``dspark-verify``: a cache byte for byte, with the same checks the loader relies on.

Every problem is reported with its file and reason; the command line (options, exit codes) is
:mod:`dspark_cache.verify.cli`.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field

from dspark_cache.cli.conventions import command_hint
from dspark_cache.format.errors import CacheError, CorruptShardError
from dspark_cache.format.paths import TARGET_WEIGHTS
from dspark_cache.format.schema import Manifest, ShardIndex
from dspark_cache.format.tar.reader import ShardReader
from dspark_cache.format.tar.rebuild import rebuild_index
from dspark_cache.format.validate import check_catalog
from dspark_cache.format.weights import weights_problem
from dspark_cache.storage.backing import StorageOptions
from dspark_cache.storage.cache import CacheDir
from dspark_cache.storage.destination import open_output
from dspark_cache.storage.remote.url import is_remote


@dataclass
class Report:
    cache: str
    complete: bool = False
    shards_total: int = 0
    shards_ok: int = 0
    samples_ok: int = 0
    missing: list[int] = field(default_factory=list)
    corrupt: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # about the cache as a whole (manifest, shard set)
    leftovers: list[str] = field(default_factory=list)
    produce_command: str = ""  # the dspark-produce run that recomputes what is missing (produce_command)

    @property
    def ok(self) -> bool:
        return self.complete and not self.missing and not self.corrupt and not self.problems


def verify_cache(path: str, storage: StorageOptions | None = None) -> Report:
    """Check every planned shard: index valid for the manifest, tar intact, every sample's checksum
    and header. Raises :class:`NotACacheError` (or another ``CacheError``) only when the
    directory holds no readable dspark manifest; everything else is reported. A remote cache
    (``s3://...``) streams through its node-local copy one shard at a time (``storage``'s
    ``cache_limit`` bounds the disk it takes)."""
    cache = CacheDir(path, allow_incomplete=True, strict=False, storage=storage)  # unplanned shards: reported
    try:
        return _verify(cache, path)
    finally:
        cache.close()


def _verify(cache: CacheDir, path: str) -> Report:
    paths, manifest = cache.paths, cache.manifest
    report = Report(cache=path, complete=manifest.complete, shards_total=manifest.num_shards,
                    leftovers=paths.partial_files(), produce_command=produce_command(manifest, path))
    report.problems += [
        f"{paths.shard_index(s)} is published but the manifest plans {manifest.num_shards} shards"
        for s in cache.extra_shards()
    ]
    present = set(cache.indexed_ids())
    indexes: dict[int, ShardIndex] = {}
    for shard_id in range(manifest.num_shards):
        if shard_id not in present:
            report.missing.append(shard_id)
            if cache.remote is not None and cache.backing.tar_size(shard_id) >= 0:
                report.leftovers.append(
                    cache.backing.store.name(f"shards/{os.path.basename(paths.shard_tar(shard_id))}")
                )
            elif os.path.exists(paths.shard_tar(shard_id)):  # renamed, killed before its index: unpublished
                report.leftovers.append(paths.shard_tar(shard_id))
            continue
        index = _verify_shard(cache, shard_id, report)
        if index is not None:
            indexes[shard_id] = index
    try:
        check_catalog(manifest, indexes, path)
    except CacheError as exc:
        report.problems.append(str(exc))
    cache.backing.fetch_file(TARGET_WEIGHTS)  # a remote cache's copy is brought in first
    weights = weights_problem(paths, manifest)  # a running producer may not have written them yet
    if weights is not None and (manifest.complete or os.path.lexists(paths.target_weights)):
        report.problems.append(weights)
    return report


def _verify_shard(cache: CacheDir, shard_id: int, report: Report) -> ShardIndex | None:
    paths = cache.paths
    held = bytes_checked = False
    try:
        index = cache.require(shard_id)
        cache.hold(index)  # a remote shard is downloaded (and checked against its index) here
        held = True
        with ShardReader(paths, shard_id, index, cache.shape) as reader:
            reader.verify()
        bytes_checked = True
        _verify_values(cache, index, shard_id)
    except CorruptShardError as exc:
        problem = {"shard": shard_id, "path": exc.path, "sample": exc.sample_id, "reason": exc.detail}
        if bytes_checked:  # the bytes are the writer's: rebuilding the index cannot help
            problem["rebuildable"] = False
        report.corrupt.append(problem)
        return None
    except (CacheError, OSError) as exc:
        report.corrupt.append({"shard": shard_id, "path": paths.shard_tar(shard_id), "sample": None,
                               "reason": f"{paths.shard_tar(shard_id)}: {exc}"})
        return None
    finally:
        if held:
            cache.let_go(shard_id)
    report.shards_ok += 1
    report.samples_ok += index.num_samples
    return index


def _verify_values(cache: CacheDir, index: ShardIndex, shard_id: int) -> None:
    """Every sample's values by the readers' own rules, after the checksums passed (from the page
    cache): an FP8 or compressed sample is read whole (``ShardReader.read_sample`` decodes it and checks
    its scales, codes and tokens), any other only its token ids and loss mask (the token rule,
    ``check_tokens``). A compressed sample's frame that does not decode is corrupt like any other."""
    with ShardReader(cache.paths, shard_id, index, cache.shape, cache.manifest.target_vocab_size) as reader:
        for entry in index.samples:
            if cache.shape.fp8 or cache.shape.compressed:
                reader.read_sample(entry)
            else:
                reader.check_tokens(entry)


def repair(path: str, report: Report, storage: StorageOptions | None = None) -> None:
    """Rebuild the index of a shard whose tar is provably intact; unpublish the others (index first,
    so readers stop seeing it, then the tar) so that a producer rerun recomputes them. Writes
    nothing when no shard is corrupt (an intact cache on a read-only filesystem repairs fine).
    A cache on object storage is repaired holding its lease (no producer writes it meanwhile),
    each tar to rebuild from downloaded and deleted again."""
    if not report.corrupt:
        return
    output = open_output(path, storage=storage)
    remote = is_remote(path)
    if not remote and os.path.islink(output.paths.shards_dir):
        raise CacheError(
            f"{output.paths.shards_dir} is a symlink: dspark-verify --repair never deletes through one; "
            "replace it with a real directory first"
        )
    if remote:
        output.check()
        output.lock(f"dspark-verify-{os.getpid()}")
    try:
        manifest = output.read_manifest()
        if manifest is None:
            raise CacheError(f"{output.shown} lost its manifest while it was verified; rerun dspark-verify")
        for problem in report.corrupt:
            shard_id = problem["shard"]
            index = None
            if problem.get("rebuildable", True) and shard_id in output.published():
                with output.shard_tar(shard_id):
                    index = rebuild_index(output.paths, shard_id, manifest)
            if index is not None:
                output.replace_index(index)
                problem["repaired"] = "rebuilt"
                continue
            output.unpublish(shard_id)
            problem["repaired"] = "deleted"
        output.write_wids_index()  # wids' shard list names exactly the shards still published
    finally:
        output.release()


def format_ranges(ids: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``1-3, 7``: thousands of shard ids stay readable."""
    parts: list[str] = []
    for i in sorted(ids):
        if parts and i == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{i}"
        else:
            parts.append(str(i))
    return ", ".join(parts)


_REPAIRED = {"rebuilt": " (index rebuilt from the intact tar)", "deleted": " (deleted)"}


def produce_command(manifest: Manifest, cache: str) -> str:
    """The ``dspark-produce`` command that resumes this cache, from the settings its manifest records:
    a rerun with them plans the same shards and recomputes only the missing ones (``--batch-size``
    appears as the budget it made, ``--max-batch-tokens``, where the manifest records it). What leaves
    no trace in a manifest (``--chat-template``'s file, ``--trust-remote-code``, ``--storage-options``)
    is for the user to add; a relative ``--input-data`` is relative to where the cache was made."""
    m = manifest
    argv = ["--target-model", m.target_model, "--input-data", m.train_data_path, "--output-dir", cache,
            "--seq-length", str(m.seq_length), "--shard-size", str(m.shard_size), "--dtype", m.dtype,
            "--target-layer-ids", ",".join(map(str, m.target_layer_ids))]
    if m.max_batch_tokens:
        argv += ["--max-batch-tokens", str(m.max_batch_tokens)]
    if m.train_split is not None:
        argv += ["--split", m.train_split]
    argv += ["--shuffle-seed", str(m.shuffle_seed)]
    argv += [flag for flag, on in (("--mask-reasoning-content", m.mask_reasoning_content),
                                   ("--mask-generation-prompt", m.mask_generation_prompt)) if on]
    if m.compute_dtype:
        argv += ["--compute-dtype", m.compute_dtype]
    if m.attn_implementation:
        argv += ["--target-attn-implementation", m.attn_implementation]
    if m.compression != "none":  # one cache holds one codec: a resume with another is refused
        argv += ["--compression", m.compression, "--compression-level", str(m.compression_level)]
    return " ".join([command_hint("dspark-produce"), *(shlex.quote(a) for a in argv)])


def verdict(report: Report) -> str:
    """The verdict, first on the headline: what is wrong before how much is fine (``--json``: its
    ``state``, the key's name since the first version)."""
    found = (["CORRUPT"] if report.corrupt or report.problems else []) + \
        (["INCOMPLETE"] if report.missing or not report.complete else [])
    return ", ".join(found) or "complete"


def _blamed(problem: dict) -> str:
    """A damaged index is the index's fault (its tar may be intact), anything else the shard's."""
    if str(problem.get("path", "")).endswith(".idx"):
        return f"damaged index of shard {problem['shard']}"
    return f"corrupt shard {problem['shard']}"


def print_report(report: Report) -> None:
    """The report for people: what is wrong, file by file, and what to do about it."""
    print(
        f"{report.cache}: {verdict(report)}, {report.shards_ok}/{report.shards_total} shards verified, "
        f"{report.samples_ok} samples"
    )
    for problem in report.problems:
        print(f"problem: {problem}")
    if report.missing:
        print(f"missing shards: {format_ranges(report.missing)}")
    for problem in report.corrupt:
        print(f"{_blamed(problem)}: {problem['reason']}{_REPAIRED.get(problem.get('repaired'), '')}")
    for leftover in report.leftovers:
        print(f"leftover from an interrupted run (deleted by the next dspark-produce): {leftover}")
    deleted = [p["shard"] for p in report.corrupt if p.get("repaired") == "deleted"]
    rerun = f"\n  {report.produce_command}" if report.produce_command else ""
    if report.ok:
        print("OK")
    elif report.corrupt and not all(p.get("repaired") for p in report.corrupt):
        print(
            "Run dspark-verify --repair to rebuild damaged indexes and unpublish corrupt shards, then rerun "
            "dspark-produce with the settings the cache was made with (its manifest's); it recomputes "
            f"exactly those shards:{rerun}"
        )
    elif report.missing or deleted or not report.complete:
        print("Rerun dspark-produce with the settings the cache was made with (its manifest's) to compute "
              f"the missing shards ({format_ranges(report.missing + deleted)}), or wait, if a producer is "
              f"still running:{rerun}")
    elif report.problems:
        print("Fix the problems above (each says how), then run dspark-verify again.")
    else:
        print("Repaired: every damaged index was rebuilt from its intact tar and no shard is missing; run "
              "dspark-verify again to confirm.")
