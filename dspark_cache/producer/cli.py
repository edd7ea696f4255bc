"""``dspark-produce`` entry point: concise output, clear errors, documented exit codes."""

from __future__ import annotations

import logging
import os
import sys

from dspark_cache.producer.config import (
    EXIT_ERROR, EXIT_INCOMPLETE, EXIT_OK, EXIT_STOPPED, EXIT_USAGE, parse_config,
)


def _summary(result) -> str:
    m, plan = result.manifest, result.plan
    tokens = max(plan.num_tokens, 1)
    return (
        f"cache {'complete' if m.complete else 'incomplete'}: {plan.num_samples} samples "
        f"({len(plan.skipped)} rows skipped), {plan.num_tokens} tokens, {len(plan.shards)} shards, "
        f"{plan.num_bytes / 1e6:.1f} MB ({plan.num_bytes / tokens:.0f} bytes/token), {result.seconds:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--tui" in argv:  # the monitor is composed in by the dspark-produce entry point
        print("dspark-produce: --tui needs the dspark-produce command (dspark_cache.cli), not this module",
              file=sys.stderr)
        return EXIT_USAGE
    cfg = parse_config(argv)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dspark_cache.producer.run import produce

    try:
        result = produce(cfg)
    except KeyboardInterrupt:
        print("dspark-produce: aborted; rerun the same command to resume", file=sys.stderr)
        return EXIT_STOPPED
    except Exception as exc:  # every expected failure carries a message that says what to do
        logging.getLogger("dspark_cache").debug("failure", exc_info=True)
        print(f"dspark-produce: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    rank = int(os.environ.get("RANK", "0"))
    print(_summary(result) if rank == 0 else f"rank {rank}: done")
    if result.missing:
        print(f"dspark-produce: shards {result.missing} were not published because the rank that owned them "
              "stopped; rerun the same command (any number of ranks) to complete the cache", file=sys.stderr)
        return EXIT_INCOMPLETE
    if result.stopped:
        print("dspark-produce: stopped before completion; rerun the same command to resume", file=sys.stderr)
        return EXIT_STOPPED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
