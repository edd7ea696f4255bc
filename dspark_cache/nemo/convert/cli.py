"""``dspark-convert SRC DST --to {dspark,nemo}``: move a cache between NeMo's format and ours.

The options and the run are defined here; the parser's conventions and the exit codes come from
``dspark_cache.cli`` (which dispatches the console script to :func:`run`).
"""

from __future__ import annotations

import argparse
import sys

from dspark_cache.cli.conventions import (
    EXIT_ERROR,
    EXIT_NOT_A_CACHE,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_USAGE,
    UsageError,
    add_storage_arguments,
    staging_limit_from_args,
    exit_codes_epilog,
    storage_from_args,
)
from dspark_cache.format.codec import CODECS, DEFAULT_LEVEL, LEVELS
from dspark_cache.format.errors import CacheError, NotACacheError
from dspark_cache.nemo.convert.common import ConvertResult, ConvertUsageError
from dspark_cache.storage.remote.url import is_remote

PROG = "dspark-convert"

DESCRIPTION = """\
Convert a DSpark target cache between NVIDIA NeMo Automodel's layout (padded
shard-NNNNNN.safetensors files) and dspark-cache's (unpadded WebDataset shards).

--to dspark imports a complete NeMo cache: NeMo sample i becomes sample id i and NeMo shard k
our shard k. Each row keeps its real tokens: the trailing run of pad ids is stripped as NeMo's
attention mask strips it (one trailing eos is kept when pad == eos), and a pad-id token with
loss_mask 1 counts as real. The pad id comes from the tokenizer in the manifest's target_model
directory, or from --pad-token-id. When the last layer id is num_hidden_layers-1, the duplicated
final state is checked and stored once.

--to nemo exports a dspark cache in NeMo 0.7.0's exact layout and manifest, readable by NeMo's
unmodified train_dspark. Sample i is the i-th sample in ascending sample id (ids are renumbered
densely). input_ids are padded with the manifest's pad_token_id and float tensors with zeros,
left as holes in sparse files (they read as zeros and take no disk); NeMo's own producer stores
the target's outputs at pad positions instead, which training masks. NeMo has no FP8: an FP8
cache is dequantised, to bf16 unless --dtype fp32 (what NeMo's recipe needs on a CPU).

Both directions stream one row at a time (memory stays bounded whatever the shard size), publish
each shard atomically, and resume: rerun the same command after a crash or kill and published
shards are kept. The manifest says complete only once every shard is in place."""

EPILOG = exit_codes_epilog(EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_STOPPED) + (
    ". Bad input or a DST holding another cache exits 1; shards already published are kept.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``SRC DST --to`` and the direction's options."""
    p.add_argument("src", metavar="SRC", help="the cache to read (complete)")
    p.add_argument(
        "dst",
        metavar="DST",
        help="the directory to write (created; resumed when it holds the same conversion)",
    )
    p.add_argument("--to", required=True, choices=["dspark", "nemo"], help="the layout to write")
    p.add_argument(
        "--pad-token-id",
        type=int,
        default=None,
        metavar="N",
        help="--to dspark: the id NeMo padded rows with (default: the tokenizer's pad token, or its eos "
        "when it has none; required when target_model is not a local tokenizer directory)",
    )
    p.add_argument(
        "--eos-token-id",
        type=int,
        default=None,
        metavar="N",
        help="--to dspark: the tokenizer's eos id, when it cannot be loaded (decides NeMo's pad == eos rule)",
    )
    p.add_argument("--shard-size", type=int, default=None, metavar="N",
                   help="--to nemo: samples per NeMo shard (default: the source's shard_size)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                   help="--to nemo, FP8 caches: the dtype their states are dequantised to (default: bf16)")
    p.add_argument("--compression", choices=list(CODECS), default=None,
                   help="--to dspark: store the cache compressed (zstd: byte planes + zstd, lossless; "
                   "default none)")
    p.add_argument("--compression-level", type=int, default=None, metavar="N",
                   help=f"--to dspark with --compression zstd: the zstd level, {LEVELS[0]}..{LEVELS[1]} "
                   f"(default {DEFAULT_LEVEL})")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a different cache in DST (deletes only cache files of either layout)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_storage_arguments(p, staging=True)


def _check_args(args: argparse.Namespace) -> None:
    if args.to == "nemo" and (args.pad_token_id is not None or args.eos_token_id is not None):
        raise UsageError(
            "--pad-token-id/--eos-token-id apply to --to dspark (an export pads with the manifest's "
            "pad_token_id)"
        )
    if args.to == "dspark" and args.shard_size is not None:
        raise UsageError("--shard-size applies to --to nemo (an import keeps NeMo's shards)")
    if args.to == "nemo" and (args.compression is not None or args.compression_level is not None):
        raise UsageError("--compression/--compression-level apply to --to dspark (NeMo's layout is "
                         "uncompressed; a compressed source is decoded)")
    if args.compression_level is not None and args.compression != "zstd":
        raise UsageError("--compression-level needs --compression zstd")
    if args.compression_level is not None and not LEVELS[0] <= args.compression_level <= LEVELS[1]:
        raise UsageError(f"--compression-level must be in [{LEVELS[0]}, {LEVELS[1]}]")
    if args.to == "dspark" and args.dtype is not None:
        raise UsageError("--dtype applies to --to nemo (an import keeps NeMo's dtype)")
    for name in ("pad_token_id", "eos_token_id"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0")
    if args.shard_size is not None and args.shard_size < 1:
        raise UsageError("--shard-size must be >= 1")
    if args.to == "dspark" and is_remote(args.src):
        raise UsageError(
            "dspark-convert --to dspark reads NeMo caches from local directories only (NeMo's own "
            "loader reads no object store); copy SRC to a local directory first"
        )
    if args.to == "nemo" and is_remote(args.dst):
        raise UsageError(
            "dspark-convert --to nemo writes a local directory (NeMo's recipe reads only those); give "
            "DST as a directory"
        )
    if (args.staging_dir or args.staging_limit) and not (args.to == "dspark" and is_remote(args.dst)):
        raise UsageError(
            "--staging-dir/--staging-limit apply to --to dspark with DST on object storage (s3://...)"
        )


def summary(result: ConvertResult) -> str:
    """What the run did, and bytes before/after: printed on stdout."""
    kinds = ("NeMo", "dspark") if result.direction == "dspark" else ("dspark", "NeMo")
    kept = f", {result.shards_kept} kept from an earlier run" if result.shards_kept else ""
    lines = [
        f"converted {kinds[0]} -> {kinds[1]}: {result.samples} samples in {result.shards} shards{kept}, "
        f"{result.seconds:.1f} s",
        f"shard bytes: {result.bytes_before / 1e6:,.1f} MB before, {result.bytes_after / 1e6:,.1f} MB after, "
        f"ratio before/after {result.ratio:.2f}",
    ]
    if result.direction == "dspark":
        lines.append(
            f"pad id {result.pad_token_id} (from {result.pad_source}); {result.ambiguous} samples with an "
            f"ambiguous length (NeMo's rule decided); {result.skipped} rows skipped (all padding)"
        )
    else:
        lines.append(
            f"{result.allocated_after / 1e6:,.1f} MB of it allocated on disk: the zero padding is left as "
            "holes (sparse), which read as zeros"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Convert as ``args`` say; prints the summary on stdout, progress (unless ``--quiet``) on stderr."""
    _check_args(args)
    from dspark_cache.nemo.convert import convert_to_dspark, convert_to_nemo

    progress = None if args.quiet else sys.stderr
    try:
        if args.to == "dspark":
            result = convert_to_dspark(
                args.src,
                args.dst,
                pad_token_id=args.pad_token_id,
                eos_token_id=args.eos_token_id,
                overwrite=args.overwrite,
                progress=progress,
                storage=storage_from_args(args),
                staging_dir=args.staging_dir,
                staging_limit=staging_limit_from_args(args),
                compression=args.compression or "none",
                compression_level=args.compression_level,
            )
        else:
            result = convert_to_nemo(args.src, args.dst, shard_size=args.shard_size, overwrite=args.overwrite,
                                     progress=progress, dtype=args.dtype, storage=storage_from_args(args))
    except ConvertUsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(
            f"{PROG}: interrupted; published shards are kept: rerun the same command to resume",
            file=sys.stderr,
        )
        return EXIT_STOPPED
    except (CacheError, OSError) as exc:  # ConvertError, and CacheOutput's lock and directory checks' errors
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        # No cache at SRC is the exit code dspark-verify gives the same directory.
        return (
            EXIT_NOT_A_CACHE
            if any(isinstance(e, NotACacheError) for e in (exc, exc.__cause__))
            else EXIT_ERROR
        )
    print(summary(result))
    return EXIT_OK


if __name__ == "__main__":  # the entry's path in scripts written for an earlier release
    from dspark_cache.cli.conventions import not_an_entry

    not_an_entry(PROG, "dspark_cache.nemo.convert.cli", "dspark_cache.nemo.convert")
