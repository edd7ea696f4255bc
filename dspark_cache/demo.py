"""``make demo``: build the embedded target and sample data (once), then run dspark-produce."""

from __future__ import annotations

import argparse
import os
import sys

from dspark_cache.producer.cli import main as produce_main

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
    parser = argparse.ArgumentParser(description="Run dspark-produce on the embedded default target and data.")
    parser.add_argument("--workdir", default=".demo")
    args, extra = parser.parse_known_args(argv)
    target, data = ensure_embedded(args.workdir)
    output = os.path.join(args.workdir, "cache")
    cmd = ["--target-model", target, "--input-data", data, "--output-dir", output, "--overwrite",
           "--seq-length", "2048", "--batch-size", "16", "--shard-size", "64", "--log-level", "WARNING", *extra]
    print("dspark-produce " + " ".join(cmd))
    print(f"watch it live from another terminal: .venv/bin/dspark-monitor {output}   "
          "(or add --tui to a dspark-produce command to watch in the foreground)")
    code = produce_main(cmd)
    if code == 0:
        print(f"check it: .venv/bin/dspark-verify {output}   read it: dspark_cache.build_dataloader({output!r}, 4)")
    return code


if __name__ == "__main__":
    sys.exit(main())
