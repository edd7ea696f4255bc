"""``dspark-produce``'s options and run: the settings checked as a usage error, ``--dry-run``, the
run and its one-line summary and exit code.

``--tui`` is parsed here with the other options, but what it does (a monitor in the foreground,
the producer as its child) joins two parts, so the caller passes it in as ``foreground``:
``dspark_cache.cli.produce`` does, ``python -m dspark_cache.producer`` (a torchrun rank, or that
child) does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Callable

from dspark_cache.cli.conventions import (
    EXIT_ERROR, EXIT_INCOMPLETE, EXIT_OK, EXIT_STOPPED, EXIT_USAGE, UsageError, add_storage_arguments, error,
    exit_codes_epilog, not_an_entry,
)
from dspark_cache.producer.config import DESCRIPTION, ConfigError, ProduceConfig
from dspark_cache.producer.config import add_arguments as add_settings
from dspark_cache.producer.config import config_from_args, validate_config

PROG = "dspark-produce"
EPILOG = exit_codes_epilog(EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_STOPPED, EXIT_INCOMPLETE)
LOG_LEVEL = "INFO"  # NeMo's default: the plan and progress lines are what a user watches
NOT_HERE = f"--tui needs the {PROG} command, not python -m dspark_cache.producer"

Foreground = Callable[[ProduceConfig], int]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every setting (``config``), ``--tui`` and ``--no-progress``."""
    add_settings(parser)
    add_storage_arguments(parser, local_cache=False, staging=True)  # an --output-dir on object storage
    parser.add_argument("--lease-wait", metavar="SECONDS", type=float, default=None,
                        help="on object storage: how long to wait for the cache's lease (control/lease.json) "
                        "while another run holds it, for that run to finish or its lease to expire, before "
                        "giving up (exit 1). A lease left by a killed run on this host is taken at once. "
                        "Default: the lease's time-to-live plus 30 s (90 s), enough for a preempted job's "
                        "lease to expire; 0 gives up at once")
    parser.add_argument(
        "--tui",
        action="store_true",
        help="watch this run in dspark-monitor (the producer runs as a child; q stops it gracefully)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (log lines at INFO instead); bars are drawn only when stderr is a "
        "terminal, by rank 0",
    )


def run(args: argparse.Namespace, foreground: Foreground | None = None) -> int:
    """Produce with parsed ``args``; ``foreground`` runs the job under ``--tui`` (None: refused)."""
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
        if foreground is None:  # this process is the child under the monitor, or a torchrun rank
            raise UsageError(NOT_HERE)
        return foreground(cfg)
    return produce_and_report(cfg)


def dry_run(cfg: ProduceConfig) -> int:
    """Encode and plan, print the plan; nothing is written but the plan (under the directory's lock),
    which the real run then reuses instead of tokenising again."""
    from dspark_cache.producer.config import cache_output
    from dspark_cache.producer.device.ranks import new_run_id
    from dspark_cache.producer.device.topology import Topology
    from dspark_cache.producer.plan.found import forget_found, found_directory, keep_plan_files, leave_as_found
    from dspark_cache.producer.prepare import prepare, resolve_settings
    from dspark_cache.producer.report.summary import layers_cost, plan_report
    from dspark_cache.producer.resume import take_directory

    me = Topology.from_environment(cfg.tp_size, cfg.ep_size)
    output = cache_output(cfg, me.rank)
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
        if isinstance(exc, ConfigError):  # found once the target's config is read: still a usage error
            raise UsageError(str(exc)) from None
        return error(PROG, str(exc))
    finally:
        output.release()
    if found is not None:
        forget_found(output, found)
    if me.is_leader:
        note = layers_cost(cfg.for_draft_layers, p.info.num_layers, p.shape, p.plan.num_tokens) \
            if cfg.for_draft_layers else None
        print(plan_report(p.plan, p.manifest, output, note))
    return EXIT_OK


def produce_and_report(cfg: ProduceConfig) -> int:
    """This rank's whole run, then rank 0's summary (other ranks: one word) and the exit code."""
    from dspark_cache.producer.report.summary import summary
    from dspark_cache.producer.run import produce

    try:
        result = produce(cfg)
    except ConfigError as exc:  # found once the target's config is read: still a usage error (exit 2)
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt:
        print(f"{PROG}: aborted; rerun the same command to resume", file=sys.stderr)
        return EXIT_STOPPED
    except Exception as exc:  # every expected failure carries a message that says what to do
        logging.getLogger("dspark_cache").debug("failure", exc_info=True)
        return error(PROG, str(exc))
    rank = int(os.environ.get("RANK", "0"))
    outcome = "stopped" if result.stopped else "incomplete" if result.missing else "done"
    print(summary(result) if rank == 0 else f"rank {rank}: {outcome}")
    if result.missing:
        print(f"{PROG}: shards {result.missing} were not published because the rank that owned them "
              "stopped; rerun the same command (any number of ranks) to complete the cache", file=sys.stderr)
        return EXIT_INCOMPLETE
    if result.stopped:
        print(f"{PROG}: stopped before completion; rerun the same command to resume", file=sys.stderr)
        return EXIT_STOPPED
    return EXIT_OK


if __name__ == "__main__":  # the entry's path in job scripts written for an earlier release
    not_an_entry(PROG, "dspark_cache.producer.cli", "dspark_cache.producer")
