"""Planning benchmark: memory and time of `dspark-produce --dry-run` as the dataset grows, and
of a rerun that reuses the saved plan.

    python bench/planning.py                       # 30k and 240k one-turn short chats
    python bench/planning.py --rows 30000 240000 --repeat 3

Each run is its own `dspark-produce --dry-run` process on the embedded target (built under
`.demo/` like `make demo`): first with a fresh output directory (tokenise, merge, save the plan),
then again on the same directory (the saved plan is reused: nothing tokenised). Peak RSS comes
from the child's rusage. The table is printed, then saved as JSON under `.bench/`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BENCH_DIR = os.path.join(ROOT, ".bench")
WORDS = ("the quick brown fox jumps over a lazy dog while cats sleep and birds sing in the morning light "
         "of a warm summer day near the river").split()


def write_short_chats(path: str, rows: int, seed: int = 0) -> None:
    """One-turn chats of a few dozen tokens: many rows, little text (planning cost per row shows)."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(rows):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14)))
            handle.write(json.dumps({"messages": [{"role": "user", "content": question},
                                                  {"role": "assistant", "content": answer}]}) + "\n")


def dry_run(target: str, data: str, out: str, seq_length: int) -> dict:
    """One `--dry-run` in a child process: its wall seconds, peak RSS (its own rusage) and report."""
    cmd = [sys.executable, "-m", "dspark_cache.producer", "--target-model", target, "--input-data", data,
           "--output-dir", out, "--seq-length", str(seq_length), "--dry-run", "--log-level", "WARNING",
           "--no-progress"]
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not a running maximum
        seconds = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"dry run failed ({proc.returncode}):\n{stderr.read().decode()}")
        return {
            "seconds": seconds,
            "rss_mb": usage.ru_maxrss / 1024,
            "report": stdout.read().decode().strip(),
        }


def measure(target: str, data: str, workdir: str, seq_length: int) -> dict:
    """A fresh plan, then a rerun on the same directory (the saved plan reused)."""
    out = tempfile.mkdtemp(prefix="plan-", dir=workdir)
    first = dry_run(target, data, out, seq_length)
    again = dry_run(target, data, out, seq_length)
    shutil.rmtree(out, ignore_errors=True)
    return {"fresh_s": first["seconds"], "fresh_rss_mb": first["rss_mb"], "reuse_s": again["seconds"],
            "reuse_rss_mb": again["rss_mb"], "report": first["report"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[30000, 240000])
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    from dspark_cache.demo import ensure_embedded

    os.makedirs(BENCH_DIR, exist_ok=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="planning-", dir=BENCH_DIR)
    os.makedirs(workdir, exist_ok=True)
    target, _ = ensure_embedded(os.path.join(ROOT, ".demo"))
    results = {}
    for rows in args.rows:
        data = os.path.join(workdir, f"short-{rows}.jsonl")
        write_short_chats(data, rows)
        runs = [measure(target, data, workdir, args.seq_length) for _ in range(args.repeat)]
        results[rows] = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "report"}
        results[rows]["report"] = runs[0]["report"]
    print("| rows | fresh plan | peak RSS | rerun (plan reused) | peak RSS |")
    print("|---|---|---|---|---|")
    for rows, r in results.items():
        print(f"| {rows:,} | {r['fresh_s']:.1f} s | {r['fresh_rss_mb']:.0f} MB | {r['reuse_s']:.1f} s | "
              f"{r['reuse_rss_mb']:.0f} MB |")
    if len(results) >= 2:
        small, large = results[min(results)], results[max(results)]
        print(
            f"peak RSS {max(results)} / {min(results)} rows: {large['fresh_rss_mb'] / small['fresh_rss_mb']:.2f}x "
            f"(+{large['fresh_rss_mb'] - small['fresh_rss_mb']:.0f} MB)"
        )
    for rows, r in results.items():
        print(f"\n{rows} rows:\n{r['report']}")
    path = os.path.join(BENCH_DIR, f"planning-{int(time.time())}.json")
    with open(path, "w") as handle:
        json.dump(results, handle, indent=2)
    print(f"\nsaved {path}")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
