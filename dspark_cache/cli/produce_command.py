"""``dspark-produce``: the producer's options, ``--tui``, the one-line summary and the exit code.

The same command runs under torchrun as ``python -m dspark_cache.producer`` (one process per
rank); ``--tui`` is for the console script only, which then runs that module as a child under
the monitor.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dspark_cache.cli.conventions import (
    EXIT_ERROR, EXIT_INCOMPLETE, EXIT_OK, EXIT_STOPPED, EXIT_USAGE, UsageError, error, exit_codes_epilog,
    new_parser, run_script,
)
from dspark_cache.format.errors import CacheError

if TYPE_CHECKING:
    from dspark_cache.producer.run import RunResult

PROG = "dspark-produce"


@dataclass(frozen=True)
class Published:
    """What the cache directory holds now, counted from its shard indexes."""

    shards: int
    samples: int
    tokens: int
    bytes: int


def published(output_dir: str) -> Published:
    """Count the published shards, samples, tokens and bytes from the indexes (a shard exists when its index does)."""
    from dspark_cache.format.cache import CacheDir

    shards = samples = tokens = size = 0
    with CacheDir(output_dir, allow_incomplete=True, strict=False) as cache:
        for shard_id in cache.indexed_ids():
            index = cache.published(shard_id)
            if index is None:
                continue
            shards += 1
            samples += index.num_samples
            tokens += sum(entry.length for entry in index.samples)
            size += index.tar_bytes
    return Published(shards, samples, tokens, size)


def summary(result: RunResult, output_dir: str) -> str:
    """Rank 0's last line: what the cache holds now (read from ``output_dir``), what was planned, what it cost."""
    m, plan = result.manifest, result.plan
    try:
        done = published(output_dir)
    except (CacheError, OSError) as exc:  # the run's own line must not fail on a damaged index: say so instead
        return (f"cache {'complete' if m.complete else 'incomplete'}: planned {plan.num_samples} samples in "
                f"{len(plan.shards)} shards; the published shards could not be counted ({exc}); "
                f"run dspark-verify {output_dir}")
    skipped = f"{len(plan.skipped)} rows skipped"
    if m.complete:
        return (f"cache complete: {done.samples} samples ({skipped}), {done.tokens} tokens, {done.shards} shards, "
                f"{done.bytes / 1e6:.1f} MB ({done.bytes / max(done.tokens, 1):.0f} bytes/token), "
                f"{result.seconds:.1f} s")
    return (f"cache incomplete: {done.shards} of {len(plan.shards)} shards, {done.samples} of {plan.num_samples} "
            f"samples, {done.tokens} of {plan.num_tokens} tokens, {done.bytes / 1e6:.1f} of "
            f"{plan.num_bytes / 1e6:.1f} MB published ({skipped}), {result.seconds:.1f} s")


def plan_report(plan, manifest, output_dir: str) -> str:
    """What ``--dry-run`` prints: enough to size a job before renting devices."""
    import shutil

    skipped = ", ".join(f"{n} {reason}" for reason, n in plan.skipped_counts().items()) or "none"
    batches = sum(len(s.batches) for s in plan.shards)
    probe = output_dir
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = f"{shutil.disk_usage(probe or '.').free / 1e9:.1f} GB free" if probe or output_dir else ""
    return "\n".join([
        f"dry run: {plan.num_rows} rows -> {plan.num_samples} samples (skipped: {skipped})",
        f"  tokens: {plan.num_tokens} ({plan.num_loss_tokens} supervised), seq_length {manifest.seq_length}",
        f"  batches: {batches}, {plan.padded_tokens} tokens computed (padding {100 * plan.padding_waste:.1f}%)",
        f"  shards: {len(plan.shards)} of at most {manifest.shard_size} samples, {plan.num_bytes} bytes "
        f"({plan.num_bytes / 1e9:.3f} GB, {plan.num_bytes / max(1, plan.num_tokens):.0f} bytes/token)",
        f"  stored per token: layers {manifest.target_layer_ids} x {manifest.hidden_size} in {manifest.dtype}; "
        f"{output_dir}: {free}",
    ])


def dry_run(cfg) -> int:
    """Encode and plan, print the plan; nothing is written but the plan (under the directory's lock),
    which the real run then reuses instead of tokenising again."""
    import dataclasses

    from dspark_cache.format.output import CacheOutput
    from dspark_cache.producer.device.ranks import new_run_id
    from dspark_cache.producer.device.topology import Topology
    from dspark_cache.producer.plan.store import forget_found, found_directory, keep_plan_files, leave_as_found
    from dspark_cache.producer.prepare import prepare, resolve_settings
    from dspark_cache.producer.resume import take_directory

    me = Topology.from_environment(cfg.tp_size, cfg.ep_size)
    output = CacheOutput(cfg.output_dir)
    found = None  # what the directory held, once this process holds it
    try:  # planning needs no device: a login node without a GPU can size a GPU job
        settings = resolve_settings(dataclasses.replace(cfg, device="cpu"))
        if me.is_leader:  # as a real run does: a second producer is refused, and refuses us
            before = found_directory(output)  # before anything is created
            take_directory(output, new_run_id(), me.world_size, cfg.overwrite)
            found = keep_plan_files(output, before)  # held now: nobody else writes there
        p = prepare(settings, output)
    except Exception as exc:
        if found is not None:  # the directory is ours: a failed dry run leaves it as it found it
            leave_as_found(output, found)
        return error(PROG, str(exc))
    finally:
        output.release()
    if found is not None:
        forget_found(output, found)
    if me.is_leader:
        print(plan_report(p.plan, p.manifest, cfg.output_dir))
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    """The producer's options (``producer/config.py``) on the shared parser, plus ``--tui``."""
    from dspark_cache.producer.config import DESCRIPTION, add_arguments

    parser = new_parser(PROG, DESCRIPTION, log_level="INFO", epilog=exit_codes_epilog(
        EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_STOPPED, EXIT_INCOMPLETE))
    add_arguments(parser)
    parser.add_argument("--tui", action="store_true",
                        help="watch this run in dspark-monitor (the producer runs as a child; q stops it gracefully)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (log lines at INFO instead); bars are drawn only when stderr is a "
                        "terminal, by rank 0")
    return parser


def run(args: argparse.Namespace, argv: list[str], allow_tui: bool) -> int:
    """Produce with parsed ``args`` (``argv``: the same arguments, for the child under ``--tui``)."""
    from dspark_cache.producer.config import ConfigError, config_from_args, validate_config
    from dspark_cache.producer.report.progress import set_progress

    set_progress(False if args.no_progress else None)
    cfg = config_from_args(args)
    try:  # before anything is read: a setting that cannot work is a usage error (exit 2), not a failure
        validate_config(cfg)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    if cfg.dry_run:
        return dry_run(cfg)
    if args.tui:
        if not allow_tui:  # the child would start another monitor, and so on
            raise UsageError("--tui needs the dspark-produce command, not python -m dspark_cache.producer")
        from dspark_cache.tui.foreground import run_with_monitor

        # The child's output goes to a log file: log lines, never bars, even if the setting were forced.
        child_argv = [a for a in argv if a not in ("--tui", "--no-progress")] + ["--no-progress"]
        return run_with_monitor(child_argv, cfg.output_dir)
    from dspark_cache.producer.run import produce

    try:
        result = produce(cfg)
    except KeyboardInterrupt:
        print(f"{PROG}: aborted; rerun the same command to resume", file=sys.stderr)
        return EXIT_STOPPED
    except Exception as exc:  # every expected failure carries a message that says what to do
        logging.getLogger("dspark_cache").debug("failure", exc_info=True)
        return error(PROG, str(exc))
    rank = int(os.environ.get("RANK", "0"))
    outcome = "stopped" if result.stopped else "incomplete" if result.missing else "done"
    print(summary(result, cfg.output_dir) if rank == 0 else f"rank {rank}: {outcome}")
    if result.missing:
        print(f"{PROG}: shards {result.missing} were not published because the rank that owned them "
              "stopped; rerun the same command (any number of ranks) to complete the cache", file=sys.stderr)
        return EXIT_INCOMPLETE
    if result.stopped:
        print(f"{PROG}: stopped before completion; rerun the same command to resume", file=sys.stderr)
        return EXIT_STOPPED
    return EXIT_OK


def main(argv: list[str] | None = None, allow_tui: bool = True) -> int:
    """``dspark-produce`` (``allow_tui``) or one rank under torchrun (not)."""
    given = list(sys.argv[1:] if argv is None else argv)
    return run_script(build_parser(), lambda args: run(args, given, allow_tui), argv)
