"""Compare a NeMo-layout DSpark cache with a dspark cache, and two training records (our .venv).

Cache comparison: sample i of the NeMo cache is input row i; a dspark cache yields its samples in
ascending sample id, unpadded. NeMo right-pads every row to ``seq_length`` with the pad token and a
0 loss mask, so on the real length ``input_ids`` and ``loss_mask`` must be exactly equal, the
padding must be pad/0, and hidden states are compared by max abs difference on the real length.

    .venv/bin/python tests/nemo/parity/compare.py NEMO_CACHE DSPARK_CACHE [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
from typing import Any

import torch

HIDDEN_KEYS = ("target_hidden_states", "target_last_hidden_states")
# Manifest fields NeMo's recipe validates (or that shape what it trains on): must be equal.
STRICT_MANIFEST_KEYS = (
    "target_model_type", "target_vocab_size", "hidden_size", "num_hidden_layers", "seq_length", "dtype",
    "num_samples", "target_hidden_dim", "target_last_hidden_dim", "target_layer_ids",
    "mask_reasoning_content", "mask_generation_prompt",
)
# Identity fields: reported when they differ (NeMo only warns or never reads them when training).
INFO_MANIFEST_KEYS = (
    "target_model", "train_data_path", "train_split", "shuffle_seed", "chat_template_sha256", "shard_size",
)


def row_hash(row: torch.Tensor) -> str:
    """Same fingerprint as runner.py's: sha1 of the int64 row bytes, 12 hex digits."""
    return hashlib.sha1(row.detach().to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:12]


def load_nemo_cache(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """NeMo layout: manifest.json + shard-NNNNNN.safetensors, concatenated in shard order."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "manifest.json")) as handle:
        manifest = json.load(handle)
    shards = sorted(glob.glob(os.path.join(path, "shard-*.safetensors")))
    parts = [load_file(s) for s in shards]
    tensors = {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}
    return manifest, tensors


def load_dspark_cache(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    import msgspec

    import dspark_cache

    with dspark_cache.open_cache(path) as cache:
        manifest = msgspec.to_builtins(cache.manifest)
        samples = [dict(s) for s in cache.samples()]
    return manifest, samples


def _weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = os.path.join(path, "target_weights.safetensors")
    return load_file(file) if os.path.exists(file) else {}


def _decode(tokenizer, ids: list[int]) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode(ids)


def compare_caches(nemo_dir: str, dspark_dir: str, *, pad_id: int, hidden_tol: float = 1e-4,
                   tokenizer=None) -> dict[str, Any]:
    """Sample-by-sample comparison; ``status`` is ok or mismatch, with the first difference described."""
    nemo_manifest, nemo = load_nemo_cache(nemo_dir)
    ours_manifest, ours = load_dspark_cache(dspark_dir)
    n_nemo = int(nemo["input_ids"].shape[0]) if nemo else 0
    ids = [int(s["sample_id"]) for s in ours]
    report: dict[str, Any] = {
        "nemo": nemo_dir, "dspark": dspark_dir, "samples_nemo": n_nemo, "samples_dspark": len(ours),
        "sample_ids_match": ids == list(range(n_nemo)),
        "problems": [],
    }
    problems: list[str] = report["problems"]
    if not report["sample_ids_match"]:
        missing = sorted(set(range(n_nemo)) - set(ids))
        extra = sorted(set(ids) - set(range(n_nemo)))
        problems.append(f"sample ids differ: NeMo has 0..{n_nemo - 1}, dspark lacks {missing[:10]} "
                        f"and has extra {extra[:10]} (the dspark producer skipped or renumbered rows)")

    bad: dict[str, list[int]] = {"input_ids": [], "loss_mask": [], "padding": []}
    first: dict[str, Any] | None = None
    hidden_max = {k: 0.0 for k in HIDDEN_KEYS}
    hidden_worst = {k: None for k in HIDDEN_KEYS}
    pad_hidden_nonzero = 0
    for sample in ours:
        i = int(sample["sample_id"])
        if i >= n_nemo:
            continue
        length = int(sample["input_ids"].shape[0])
        for key in ("input_ids", "loss_mask"):
            ref = nemo[key][i, :length].to(torch.int64)
            got = sample[key].to(torch.int64)
            if not torch.equal(ref, got):
                bad[key].append(i)
                if first is None:
                    pos = int((ref != got).nonzero()[0])
                    diff_pos = (ref != got).nonzero().flatten().tolist()
                    first = {
                        "sample": i,
                        "key": key,
                        "position": pos,
                        "length": length,
                        "differing_positions": diff_pos[:40],
                        "num_differing": len(diff_pos),
                        "nemo_values": ref[diff_pos[:40]].tolist(),
                        "dspark_values": got[diff_pos[:40]].tolist(),
                        "tokens_there": _decode(tokenizer, nemo["input_ids"][i, diff_pos[:40]].tolist()),
                    }
        tail_ids = nemo["input_ids"][i, length:]
        tail_mask = nemo["loss_mask"][i, length:]
        if bool((tail_ids != pad_id).any()) or bool((tail_mask != 0).any()):
            bad["padding"].append(i)
        for key in HIDDEN_KEYS:
            ref = nemo[key][i, :length].double()
            got = sample[key].double()
            if ref.shape != got.shape:
                problems.append(f"sample {i} {key}: shape {list(got.shape)} != NeMo {list(ref.shape)}")
                continue
            diff = float((ref - got).abs().max()) if length else 0.0
            if diff > hidden_max[key]:
                hidden_max[key], hidden_worst[key] = diff, i
        if any(length < nemo[k].shape[1] and bool(nemo[k][i, length:].ne(0).any()) for k in HIDDEN_KEYS):
            pad_hidden_nonzero += 1
    report["mismatched_samples"] = bad
    report["first_mismatch"] = first
    report["hidden_max_abs_diff"] = hidden_max
    report["hidden_worst_sample"] = hidden_worst
    report["nemo_samples_with_nonzero_pad_hidden"] = pad_hidden_nonzero
    for key in ("input_ids", "loss_mask"):
        if bad[key]:
            problems.append(f"{key} differs in {len(bad[key])} sample(s): {bad[key][:12]}")
    if bad["padding"]:
        problems.append(f"NeMo tail is not pad/0 after the dspark length in samples {bad['padding'][:12]} "
                        "(dspark sample is shorter than NeMo's real length)")
    for key, value in hidden_max.items():
        if value > hidden_tol:
            problems.append(f"{key} max |diff| {value:.3g} > {hidden_tol:g} (sample {hidden_worst[key]})")

    w_nemo, w_ours = _weights(nemo_dir), _weights(dspark_dir)
    report["target_weights_equal"] = bool(w_nemo) and w_nemo.keys() == w_ours.keys() and all(
        torch.equal(w_nemo[k], w_ours[k]) for k in w_nemo)
    if not report["target_weights_equal"]:
        problems.append("target_weights.safetensors differ")

    strict = {k: (nemo_manifest.get(k), ours_manifest.get(k)) for k in STRICT_MANIFEST_KEYS
              if nemo_manifest.get(k) != ours_manifest.get(k)}
    info = {k: (nemo_manifest.get(k), ours_manifest.get(k)) for k in INFO_MANIFEST_KEYS
            if nemo_manifest.get(k) != ours_manifest.get(k)}
    report["manifest_diffs"] = strict
    report["manifest_info_diffs"] = info
    if strict:
        problems.append(f"manifest fields differ (NeMo, dspark): {strict}")
    report["status"] = "mismatch" if problems else "ok"
    return report


def compare_nemo_layouts(ref_dir: str, other_dir: str) -> dict[str, Any]:
    """Two NeMo-layout caches (e.g. dspark-convert --to nemo output against NeMo's own)."""
    m1, a = load_nemo_cache(ref_dir)
    m2, b = load_nemo_cache(other_dir)
    report: dict[str, Any] = {"problems": []}
    if a.keys() != b.keys():
        report["problems"].append(f"shard keys differ: {sorted(a)} vs {sorted(b)}")
    for key in a.keys() & b.keys():
        if a[key].dtype != b[key].dtype or a[key].shape != b[key].shape:
            report["problems"].append(
                f"{key}: {b[key].dtype}{list(b[key].shape)} != {a[key].dtype}{list(a[key].shape)}"
            )
    report["status"] = "mismatch" if report["problems"] else "ok"
    return report


def _losses(record: dict[str, Any]) -> list[float]:
    logged = [row["loss"] for row in record.get("logged", []) if "loss" in row]
    return logged or [mb["loss"] for mb in record.get("micro_batches", [])]


def compare_runs(ref: dict[str, Any], other: dict[str, Any], *, tol: float,
                 sample_of_row: dict[str, int] | None = None) -> dict[str, Any]:
    """Per-step losses of ``other`` against the reference run, with a diagnosis of the first divergence."""
    a, b = _losses(ref), _losses(other)
    steps = min(len(a), len(b))
    diffs = [abs(x - y) for x, y in zip(a, b)]
    report: dict[str, Any] = {
        "steps": len(b), "reference_steps": len(a), "max_abs_diff": max(diffs) if diffs else None,
        "losses": b, "info": other.get("info", {}),
    }
    problems = []
    if len(a) != len(b):
        problems.append(f"step count {len(b)} != reference {len(a)}")
    bad = [i for i, d in enumerate(diffs) if d > tol]
    if bad:
        problems.append(f"loss differs at {len(bad)} of {steps} steps (first: step {bad[0] + 1}, "
                        f"{a[bad[0]]:.7f} vs {b[bad[0]]:.7f})")
    report["diagnosis"] = diagnose(ref, other, sample_of_row or {}, tol) if problems else None
    report["problems"] = problems
    report["status"] = "mismatch" if problems else "ok"
    return report


def compare_quantised_run(ref: dict[str, Any], other: dict[str, Any], *, rel_tol: float,
                          epochs: int) -> dict[str, Any]:
    """A run from an FP8 cache against the reference: the same micro-batches (rows and loss masks, in
    order: only the hidden states differ) and a last-epoch mean loss within ``rel_tol`` of it."""
    a, b = _losses(ref), _losses(other)
    problems = []
    if len(a) != len(b):
        problems.append(f"step count {len(b)} != reference {len(a)}")
    pairs = list(zip(ref.get("micro_batches", []), other.get("micro_batches", [])))
    same = [x["rows"] == y["rows"] and x["loss_mask"] == y["loss_mask"] for x, y in pairs]
    if not all(same):
        problems.append(f"micro-batch {same.index(False) + 1} holds other rows or masks than the reference's")
    # Not vacuous: the states training received must differ (by the quantisation error).
    moved = [abs(y["hidden_sum"] - x["hidden_sum"]) / max(abs(x["hidden_sum"]), 1e-30) for x, y in pairs]
    if pairs and not any(moved):
        problems.append("the hidden states are identical to the reference's: nothing was quantised")
    epoch = max(1, len(a) // epochs)
    ref_final, final = sum(a[-epoch:]) / epoch, sum(b[-epoch:]) / epoch
    rel = abs(final - ref_final) / abs(ref_final)
    if rel > rel_tol:
        problems.append(f"last-epoch mean loss {final:.5f} vs {ref_final:.5f} ({rel:.2%} > {rel_tol:.2%})")
    diffs = [abs(x - y) for x, y in zip(a, b)]
    return {
        "steps": len(b),
        "max_abs_diff": max(diffs) if diffs else None,
        "losses": b,
        "reference_losses": a,
        "last_epoch_mean": final,
        "reference_last_epoch_mean": ref_final,
        "relative_diff": rel,
        "max_relative_step_diff": max((d / abs(x) for d, x in zip(diffs, a)), default=None),
        "max_hidden_sum_rel_diff": max(moved, default=None),
        "problems": problems,
        "status": "mismatch" if problems else "ok",
    }


def diagnose(ref: dict[str, Any], other: dict[str, Any], sample_of_row: dict[str, int], tol: float) -> str:
    """Name the first micro-batch whose inputs (rows, masks, RNG, hidden states) differ from the reference."""
    ra, rb = ref.get("micro_batches", []), other.get("micro_batches", [])
    if ref.get("info", {}).get("dataset_len") != other.get("info", {}).get("dataset_len"):
        return (f"dataset length {other.get('info', {}).get('dataset_len')} != reference "
                f"{ref.get('info', {}).get('dataset_len')}")

    def names(rows: list[str]) -> list:
        return [sample_of_row.get(h, f"?{h}") for h in rows]

    for step, (x, y) in enumerate(zip(ra, rb), start=1):
        if x["dtypes"] != y["dtypes"] or x["shapes"] != y["shapes"]:
            return f"step {step}: batch dtypes/shapes differ: {y['dtypes']} {y['shapes']} vs {x['dtypes']} {x['shapes']}"
        if x["rng"] != y["rng"]:
            return (f"step {step}: torch's global RNG state differs before the forward (the loader drew a "
                    "different number of values from the global RNG than NeMo's DataLoader/RandomSampler), "
                    "so the DSpark anchors differ")
        if x["rows"] != y["rows"]:
            return f"step {step}: batch holds samples {names(y['rows'])}, NeMo's holds {names(x['rows'])} (sample order)"
        if x["loss_mask"] != y["loss_mask"]:
            which = [
                names(x["rows"])[k] for k, (p, q) in enumerate(zip(x["loss_mask"], y["loss_mask"])) if p != q
            ]
            return f"step {step}: same samples, loss_mask differs for samples {which}"
        for key in ("hidden_sum", "last_hidden_sum"):
            if abs(x[key] - y[key]) > 1e-3 * max(1.0, abs(x[key])):
                return f"step {step}: same samples and masks, {key} over real tokens differs: {y[key]} vs {x[key]}"
        if abs(x["loss"] - y["loss"]) > tol:
            return (
                f"step {step}: identical batch inputs and RNG state, loss {y['loss']:.7f} vs {x['loss']:.7f}: "
                "the difference comes from the model/optimizer state (an earlier step's numerics)"
            )
    return "inputs identical at every recorded micro-batch; only the step count / logging differs"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nemo_cache")
    parser.add_argument("dspark_cache")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--pad-id", type=int, default=None)
    parser.add_argument("--hidden-tol", type=float, default=1e-4)
    args = parser.parse_args()
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    pad_id = args.pad_id if args.pad_id is not None else (tokenizer.pad_token_id if tokenizer else 0)
    report = compare_caches(args.nemo_cache, args.dspark_cache, pad_id=pad_id, hidden_tol=args.hidden_tol,
                            tokenizer=tokenizer)
    print(json.dumps(report, indent=2, default=str))
    return 0 if report["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
