"""Convert benchmark: dspark-convert in both directions on a realistic-size cache.

    python bench/convert.py                 # 320 samples, seq 2048, H=1024 x 5 layers, bf16, shards of 32
    python bench/convert.py --samples 96    # quicker

It writes a cache in our format (random tensors through the real shard writer) whose lengths
follow long-tail chat data (most rows a few hundred tokens, a tail cut at seq_length), then,
interleaved and --repeat times, each in a fresh process (clean peak RSS):
  export  convert_to_nemo: ours -> NeMo's padded layout (shards of --shard-size samples)
  import  convert_to_dspark: that NeMo cache -> ours (pad id given, as for a hub target)
in three settings: "disk cold" (the source evicted from the page cache first: read from disk, as
for a cache larger than RAM), "disk warm" (source in the page cache), and "tmpfs" (source and
destination in /dev/shm: no disk at all, the converter's own ceiling). Every shard and the
copied target weights are fsynced, so on disk the writes always reach it. A last export with
4x larger shards shows that memory does not grow with the shard.
Numbers: seconds, GB/s of NeMo-layout (padded) bytes and of our (real-token) bytes, peak RSS;
medians of --repeat. Raw results land in .bench/convert.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYERS, NUM_LAYERS = [1, 8, 14, 20, 27], 28


def chat_lengths(samples: int, seq: int, seed: int = 0) -> list[int]:
    """Long-tail lengths: lognormal around ~350 tokens, a few percent cut at ``seq``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.9, 0.9, samples).astype(int), 16, seq).tolist()


def make_source(root: str, samples: int, hidden: int, seq: int, shard_size: int) -> list[int]:
    """A complete dspark cache of random bf16 samples (what dspark-produce writes, byte for byte)."""
    import torch

    from dspark_cache.format.paths import CachePaths
    from dspark_cache.format.sample import sample_metadata, sample_specs
    from dspark_cache.format.schema import Manifest
    from dspark_cache.format.tar.writer import ShardWriter
    from dspark_cache.format.manifest import write_manifest
    from dspark_cache.producer import byte_views

    lengths = chat_lengths(samples, seq)
    paths = CachePaths(root)
    paths.ensure_dirs()
    dim = hidden * len(LAYERS)
    shards = -(-samples // shard_size)
    for shard in range(shards):
        writer = ShardWriter(paths, shard)
        for sid in range(shard * shard_size, min(samples, (shard + 1) * shard_size)):
            n = lengths[sid]
            mask = torch.zeros(n, dtype=torch.uint8)
            mask[n // 3 :] = 1
            tensors = {"target_hidden_states": torch.randn(n, dim).to(torch.bfloat16),
                       "input_ids": torch.randint(1, 150000, (n,), dtype=torch.int32), "loss_mask": mask}
            writer.append(sid, int(mask.sum()), sample_specs(n, dim, hidden, "BF16", False),
                          sample_metadata(sid, LAYERS, NUM_LAYERS, hidden), byte_views(tensors))
        writer.publish()
    weights = {"embed_tokens.weight": torch.randn(151936, hidden).to(torch.bfloat16),
               "lm_head.weight": torch.randn(151936, hidden).to(torch.bfloat16)}
    from safetensors.torch import save_file

    save_file(weights, paths.target_weights)
    write_manifest(paths, Manifest(
        complete=True, target_model="bench/not-local", target_model_type="qwen3", target_vocab_size=151936,
        hidden_size=hidden, num_hidden_layers=NUM_LAYERS, seq_length=seq, dtype="bf16", num_samples=samples,
        planned_samples=samples, shard_size=shard_size, target_hidden_dim=dim, target_last_hidden_dim=hidden,
        target_layer_ids=LAYERS, train_data_path="bench", num_shards=shards, pad_token_id=0,
        planned_tokens=sum(lengths)))
    return lengths


def evict(root: str) -> None:
    """Drop a directory's files from the page cache (no root needed: they are clean)."""
    for base, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(base, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def child(direction: str, src: str, dst: str, shard_size: int | None) -> None:
    """One conversion in this fresh process; prints its numbers as JSON."""
    from dspark_cache.nemo.convert import convert_to_dspark, convert_to_nemo

    if direction == "export":
        result = convert_to_nemo(src, dst, shard_size=shard_size, progress=None)
    else:
        result = convert_to_dspark(src, dst, pad_token_id=0, progress=None)
    print(json.dumps({"seconds": result.seconds, "before": result.bytes_before, "after": result.bytes_after,
                      "samples": result.samples, "shards": result.shards, "allocated": result.allocated_after,
                      "peak_rss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's peak RSS. Not ru_maxrss: Linux keeps that across exec, so a child started
    by a large parent reports the parent's size; VmHWM belongs to the new address space."""
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmHWM")) / 1024


def run_child(
    direction: str, src: str, dst: str, cold: bool, shard_size: int | None = None, label: str = ""
) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    if cold:
        evict(src)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", direction, src, dst]
    if shard_size:
        cmd += ["--shard-size", str(shard_size)]
    load = os.getloadavg()[0]  # other tenants' work on a 2-core VM shows up here
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["load_before"] = load
    nemo, ours = (
        (result["after"], result["before"]) if direction == "export" else (result["before"], result["after"])
    )
    result.update(nemo_gbps=nemo / result["seconds"] / 1e9, ours_gbps=ours / result["seconds"] / 1e9,
                  nemo_bytes=nemo, ours_bytes=ours)
    print(f"  {direction} {label}: {result['seconds']:.2f} s, {result['nemo_gbps']:.2f} GB/s "
          f"NeMo bytes, {result['ours_gbps']:.3f} GB/s our bytes, peak RSS {result['peak_rss_mb']:.0f} MB, "
          f"load before {load:.1f}", flush=True)
    return result


def machine() -> dict:
    import torch

    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        "?",
    )
    mem = next(
        (int(line.split()[1]) // 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0
    )
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_mb": mem, "python": platform.python_version(),
            "torch": torch.__version__}


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def table(results: dict) -> str:
    rows = ["| direction | setting | runs (s) | median | NeMo-layout GB/s | our GB/s | peak RSS |",
            "|---|---|---|---|---|---|---|"]
    for name, runs in results["runs"].items():
        direction, temp = name.split("|")
        seconds = ", ".join(f"{r['seconds']:.2f}" for r in runs)
        rows.append(f"| {direction} | {temp} | {seconds} | "
                    f"**{median(runs, 'seconds'):.2f} s** | **{median(runs, 'nemo_gbps'):.2f}** | "
                    f"{median(runs, 'ours_gbps'):.3f} | {median(runs, 'peak_rss_mb'):.0f} MB |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=320)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--shard-size", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--workdir",
        default=os.path.join(ROOT, ".bench"),
        help="a fresh directory of ours is made inside it and removed at the end (never the directory itself)",
    )
    p.add_argument("--child", nargs=3, metavar=("DIRECTION", "SRC", "DST"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child, None if args.shard_size == p.get_default("shard_size") else args.shard_size)
        return
    os.makedirs(args.workdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="convert-", dir=args.workdir)
    src, nemo, ours, out = (os.path.join(work, n) for n in ("src", "nemo", "ours", "out"))
    lengths = make_source(src, args.samples, args.hidden, args.seq, args.shard_size)
    print(f"source: {args.samples} samples, {sum(lengths)} tokens (mean {sum(lengths) / len(lengths):.0f}, "
          f"{sum(n == args.seq for n in lengths)} at seq {args.seq})", flush=True)
    shm = os.path.join("/dev/shm", f"dspark-convert-bench-{os.getpid()}")
    shm_src, shm_nemo, shm_ours = (os.path.join(shm, n) for n in ("src", "nemo", "ours"))
    shutil.copytree(src, shm_src)
    settings = {"disk cold": (src, nemo, ours, True), "disk warm": (src, nemo, ours, False),
                "tmpfs": (shm_src, shm_nemo, shm_ours, False)}
    runs: dict[str, list[dict]] = {f"{d}|{s}": [] for d in ("export", "import") for s in settings}
    try:
        for _ in range(args.repeat):
            for label, (a, b, c, cold) in settings.items():
                runs[f"export|{label}"].append(run_child("export", a, b, cold, label=label))
                runs[f"import|{label}"].append(run_child("import", b, c, cold, label=label))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    big = run_child("export", src, out, True, shard_size=args.shard_size * 4, label="disk cold, 4x shards")
    shutil.rmtree(out, ignore_errors=True)
    first = runs["export|disk cold"][0]
    results = {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "child"},
               "tokens": sum(lengths), "nemo_bytes": first["nemo_bytes"], "ours_bytes": first["ours_bytes"],
               "runs": runs, "export_4x_shard_rss_mb": big["peak_rss_mb"]}
    print()
    print(table(results))  # before saving: a failing save loses no number
    os.makedirs(os.path.join(ROOT, ".bench"), exist_ok=True)
    with open(os.path.join(ROOT, ".bench", "convert.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    print(
        f"\nshard bytes: NeMo layout {first['nemo_bytes'] / 1e9:.2f} GB ({first['allocated'] / 1e9:.2f} GB allocated "
        f"by the export: sparse padding), ours {first['ours_bytes'] / 1e9:.3f} GB "
        f"(ratio {first['nemo_bytes'] / first['ours_bytes']:.2f}); peak RSS of an export with "
        f"--shard-size {args.shard_size * 4}: {big['peak_rss_mb']:.0f} MB"
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
