"""``make demo``: build the embedded target and sample data (once), then run dspark-produce.

The producer runs at its default log level (INFO): on a terminal its progress bars show
tokenising, planning and computing live; piped, the same progress comes as log lines.
"""

from __future__ import annotations

import argparse
import os
import sys

from dspark_cache.cli.conventions import command_hint
from dspark_cache.producer.__main__ import main as produce_main

STAMP = "embedded-v1"


def ensure_embedded(workdir: str) -> tuple[str, str]:
    """Build the tiny target and the sample data under ``workdir`` unless already there."""
    target, data = os.path.join(workdir, "target"), os.path.join(workdir, "data.jsonl")
    stamp = os.path.join(workdir, ".stamp")
    if os.path.exists(stamp) and open(stamp).read() == STAMP:
        return target, data
    from dspark_cache.embedded.data import write_sample_data
    from dspark_cache.embedded.target import build_target

    os.makedirs(workdir, exist_ok=True)
    print(f"building the embedded target and sample data in {workdir} (first run only)")
    build_target(target)
    write_sample_data(data)
    with open(stamp, "w") as handle:
        handle.write(STAMP)
    return target, data


def main(argv: list[str] | None = None) -> int:
    """Run the demo; arguments it does not know (``--no-progress``, ``--device cpu`` ...) go to dspark-produce."""
    parser = argparse.ArgumentParser(
        description="Run dspark-produce on the embedded default target and data."
    )
    parser.add_argument("--workdir", default=".demo")
    args, extra = parser.parse_known_args(argv)
    target, data = ensure_embedded(args.workdir)
    output = os.path.join(args.workdir, "cache")
    cmd = ["--target-model", target, "--input-data", data, "--output-dir", output, "--overwrite",
           "--seq-length", "2048", "--batch-size", "16", "--shard-size", "64", *extra]
    print(f"{command_hint('dspark-produce')} " + " ".join(cmd))
    print(f"watch it live from another terminal: {command_hint('dspark-monitor')} {output}   "
          "(or add --tui to a dspark-produce command to watch in the foreground)")
    sys.stdout.flush()  # the plan's log lines and the bar go to stderr: keep the order on a terminal
    code = produce_main(cmd)
    if code == 0:
        print(f"check it: {command_hint('dspark-verify')} {output}   "
              f"read it: dspark_cache.build_dataloader({output!r}, 4)")
    return code


if __name__ == "__main__":
    sys.exit(main())
