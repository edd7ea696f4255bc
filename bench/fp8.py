"""FP8 storage benchmark (issue 18): bytes on disk and reconstruction error, per layer.

    python bench/fp8.py                      # H=1024 tiny Qwen3 (4 layers) + the embedded demo, CPU
    python bench/fp8.py --rows 24 --skip-demo

What it does, all through the real producer (``dspark-produce``) on CPU:
  bytes    the same rows stored as fp32, bf16, fp8 (e4m3) and fp8_e5m2 by a random-init Qwen3 of
           Qwen3-0.6B's width (H=1024, 16 heads of 128, 8 KV heads; 4 layers keep it fast): shard
           bytes, fp8 / bf16, and the scales' share of the fp8 shards; the same for ``make demo``'s
           embedded target (H=64) and data
  error    per captured layer, the fp8 caches' states (dequantised to float32) against the fp32
           cache's: relative RMS (||x8 - x|| / ||x|| over every token) and the worst row's
           max |x8 - x| / max |x|; bf16 alongside for scale
  outliers the fp32 activations with a few channels of every layer set to R x that layer's median
           |x| (R = 100 ... 1e5, the "massive activations" of real LLMs), quantised per token and
           layer as the producer does, error on the other channels and on the outliers themselves
Results: WORKDIR/results.json and markdown tables on stdout (BENCHMARKS.md's "## FP8").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import dspark_cache  # noqa: E402
from dspark_cache.format.sample import (  # noqa: E402
    CACHE_DTYPES, HIDDEN, HIDDEN_SCALE, LAST_HIDDEN, LAST_HIDDEN_SCALE, dequantize_rows,
)
from dspark_cache.producer.pipeline.tensors import quantize_fp8  # noqa: E402

DTYPES = ("fp32", "bf16", "fp8", "fp8_e5m2")
OUTLIER_RATIOS = (0, 100, 1000, 10_000, 100_000)
OUTLIER_CHANNELS = 4


def shard_bytes(cache: str) -> int:
    shards = os.path.join(cache, "shards")
    return sum(os.path.getsize(os.path.join(shards, n)) for n in os.listdir(shards) if n.endswith(".tar"))


def produce(target: str, data: str, out: str, dtype: str) -> float:
    """One dspark-produce run on CPU; returns its seconds."""
    from dspark_cache.producer.__main__ import main

    started = time.perf_counter()
    code = main(
        [
            "--target-model",
            target,
            "--input-data",
            data,
            "--output-dir",
            out,
            "--device",
            "cpu",
            "--dtype",
            dtype,
            "--seq-length",
            "1024",
            "--batch-size",
            "4",
            "--shard-size",
            "4",
            "--overwrite",
            "--log-level",
            "WARNING",
            "--no-progress",
        ]
    )
    if code != 0:
        raise SystemExit(f"dspark-produce --dtype {dtype} failed with exit {code}")
    return time.perf_counter() - started


def build_inputs(work: str, rows: int) -> tuple[str, str]:
    """The H=1024 target and ``rows`` chat rows of 180-700 tokens (tests/format/test_bytes.py's choice)."""
    from transformers import AutoTokenizer

    from dspark_cache.embedded.data import sample_rows
    from dspark_cache.embedded.target import build_target

    target = os.path.join(work, "target-h1024")
    if not os.path.isdir(target):
        build_target(
            target, hidden_size=1024, num_layers=4, intermediate_size=512, num_heads=16, num_kv_heads=8
        )
    tok = AutoTokenizer.from_pretrained(target)
    chosen = []
    for row in sample_rows(400, seed=5):
        messages = row.get("messages") or [
            {"role": {"human": "user", "gpt": "assistant"}.get(m["from"], m["from"]), "content": m["value"]}
            for m in row["conversations"]
        ]
        if not any(m["role"] == "assistant" for m in messages):
            continue
        n = len(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        if 180 <= n <= 700:
            chosen.append(row)
        if len(chosen) == rows:
            break
    data = os.path.join(work, "rows.jsonl")
    with open(data, "w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in chosen)
    return target, data


def scale_bytes(cache: str) -> int:
    """Bytes of the FP8 scale tensors in the cache (from the format's own layout)."""
    c = dspark_cache.open_cache(cache, dtype="raw")
    names = (HIDDEN_SCALE, LAST_HIDDEN_SCALE)
    total = sum(spec.nbytes for s in c.shards for e in s.samples for spec in c.shape.specs(e.length)
                if spec.name in names)
    c.close()
    return total


def layer_states(cache: str, dtype: object) -> list[torch.Tensor]:
    """Every token's states per captured layer (float32), plus the final state last when stored apart."""
    c = dspark_cache.open_cache(cache, dtype=dtype)
    h, k = c.manifest.hidden_size, len(c.manifest.target_layer_ids)
    rows = list(c.samples())
    layers = [torch.cat([s[HIDDEN][:, i * h:(i + 1) * h].float() for s in rows]) for i in range(k)]
    if c.shape.stores_last:
        layers.append(torch.cat([s[LAST_HIDDEN].float() for s in rows]))
    c.close()
    return layers


def errors(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    """Relative RMS over all tokens, and the worst row's max error relative to its max |x|."""
    diff = (got.double() - want.double())
    rms = float(diff.pow(2).mean().sqrt() / want.double().pow(2).mean().sqrt())
    row_max = (diff.abs().amax(-1) / want.double().abs().amax(-1).clamp_min(1e-30)).max()
    return {"rel_rms": rms, "max_rel": float(row_max)}


def reconstruction(caches: dict[str, str]) -> dict[str, list[dict[str, float]]]:
    reference = layer_states(caches["fp32"], None)
    out = {}
    for name, dtype in (("bf16", None), ("fp8", "fp32"), ("fp8_e5m2", "fp32")):
        states = layer_states(caches[name], dtype)
        out[name] = [errors(s, r) for s, r in zip(states, reference)]
    return out


def quantised(x: torch.Tensor, code: str) -> torch.Tensor:
    q, s = quantize_fp8(x, x.shape[-1], code)
    return torch.from_numpy(dequantize_rows(q.view(torch.uint8).numpy(), s.numpy(), code, "F32"))


def outliers(reference: list[torch.Tensor], seed: int = 0) -> list[dict]:
    """Per layer and ratio: the error on ordinary channels and on the injected outlier channels."""
    g = torch.Generator().manual_seed(seed)
    results = []
    for layer, x in enumerate(reference):
        channels = torch.randperm(x.shape[1], generator=g)[:OUTLIER_CHANNELS]
        ordinary = torch.ones(x.shape[1], dtype=torch.bool)
        ordinary[channels] = False
        median = float(x.abs().median())
        for ratio in OUTLIER_RATIOS:
            y = x.clone()
            if ratio:  # massive activations keep their sign: every token, the same channels
                y[:, channels] = ratio * median * torch.where(x[:, channels] < 0, -1.0, 1.0)
            row = {"layer": layer, "ratio": ratio}
            for name in ("fp8", "fp8_e5m2"):
                back = quantised(y, CACHE_DTYPES[name])
                row[name] = errors(back[:, ordinary], y[:, ordinary])
                row[name + "_outliers"] = errors(back[:, channels], y[:, channels]) if ratio else None
            results.append(row)
    return results


def demo_bytes(work: str) -> dict[str, int]:
    """``make demo``'s embedded target and data, stored as bf16 and as fp8."""
    out = {}
    for dtype in ("bf16", "fp8"):
        subprocess.run([sys.executable, "-m", "dspark_cache.demo", "--workdir", os.path.join(work, "demo"),
                        "--device", "cpu", "--dtype", dtype, "--no-progress", "--log-level", "WARNING"],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        out[dtype] = shard_bytes(os.path.join(work, "demo", "cache"))
    return out


def print_tables(results: dict) -> None:
    b = results["bytes"]
    print("\n| dtype | shard bytes | vs bf16 |\n|---|---|---|")
    for name in DTYPES:
        print(f"| {name} | {b[name]:,} | {b[name] / b['bf16']:.3f}x |")
    print(
        f"\nscales: {results['scale_bytes']:,} bytes = {results['scale_bytes'] / b['fp8']:.3%} of the fp8 shards"
    )
    if "demo" in results:
        d = results["demo"]
        print(f"demo (H=64): bf16 {d['bf16']:,} B, fp8 {d['fp8']:,} B: {d['fp8'] / d['bf16']:.3f}x")
    print("\n| layer | bf16 rel RMS | fp8 rel RMS | fp8 max | fp8_e5m2 rel RMS | fp8_e5m2 max |")
    print("|---|---|---|---|---|---|")
    r = results["error"]
    for i, ids in enumerate(results["layers"]):
        fp8, e5m2 = r["fp8"][i], r["fp8_e5m2"][i]
        print(f"| {ids} | {r['bf16'][i]['rel_rms']:.2e} | {fp8['rel_rms']:.4f} | {fp8['max_rel']:.4f} | "
              f"{e5m2['rel_rms']:.4f} | {e5m2['max_rel']:.4f} |")
    print(
        "\n| outlier ratio | fp8 rel RMS (other channels), worst layer | fp8 max | e5m2 rel RMS | e5m2 max | "
        "fp8 outlier channels rel RMS |\n|---|---|---|---|---|---|"
    )
    for ratio in OUTLIER_RATIOS:
        rows = [row for row in results["outliers"] if row["ratio"] == ratio]
        worst = max(rows, key=lambda row: row["fp8"]["rel_rms"])
        out = max((row["fp8_outliers"]["rel_rms"] for row in rows), default=0.0) if ratio else 0.0
        print(
            f"| {ratio:g} | {worst['fp8']['rel_rms']:.4f} | {max(row['fp8']['max_rel'] for row in rows):.4f} | "
            f"{max(row['fp8_e5m2']['rel_rms'] for row in rows):.4f} | "
            f"{max(row['fp8_e5m2']['max_rel'] for row in rows):.4f} | {out:.4f} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=os.path.join(ROOT, ".bench", "fp8"))
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--skip-demo", action="store_true")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    target, data = build_inputs(args.workdir, args.rows)
    caches = {name: os.path.join(args.workdir, f"cache-{name}") for name in DTYPES}
    seconds = {name: produce(target, data, caches[name], name) for name in DTYPES}
    manifest = dspark_cache.open_cache(caches["fp8"]).manifest
    lengths = [e.length for s in dspark_cache.open_cache(caches["fp8"]).shards for e in s.samples]
    results = {
        "machine": os.uname().nodename,
        "cpus": os.cpu_count(),
        "rows": args.rows,
        "samples": len(lengths),
        "tokens": sum(lengths),
        "hidden_size": manifest.hidden_size,
        "layers": [
            *manifest.target_layer_ids,
            *(["final"] if dspark_cache.open_cache(caches["fp8"]).shape.stores_last else []),
        ],
        "produce_seconds": seconds,
        "bytes": {name: shard_bytes(c) for name, c in caches.items()},
        "scale_bytes": scale_bytes(caches["fp8"]),
        "error": reconstruction(caches),
        "outliers": outliers(layer_states(caches["fp32"], None)),
    }
    if not args.skip_demo:
        results["demo"] = demo_bytes(args.workdir)
    with open(os.path.join(args.workdir, "results.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    print(json.dumps({k: v for k, v in results.items() if k not in ("error", "outliers")}, indent=2))
    print_tables(results)


if __name__ == "__main__":
    main()
