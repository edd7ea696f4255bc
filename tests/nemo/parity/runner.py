"""Run NVIDIA's nemo-automodel pieces, unedited, inside .venv-nemo, with the harness-only CPU shims.

    python runner.py precompute PRECOMPUTE_ARGS...
        NeMo's ``precompute_dspark`` CLI. Shim: the target is loaded with plain
        ``transformers.AutoModelForCausalLM.from_pretrained`` (NeMo's ``NeMoAutoModelForCausalLM``
        hard-codes ``torch.device("cuda", torch.cuda.current_device())`` and cannot load on a
        CPU-only torch). Tokenisation, masks, capture and shard writing are NeMo's own code.

    python runner.py train --mode {nemo,dspark} --seed N --record OUT.json -- -c recipe.yaml [--a.b=v]
        NeMo's ``train_dspark`` recipe. ``nemo`` calls NeMo's ``main()`` as is; ``dspark`` runs
        ``python -m dspark_cache.nemo`` (install + NeMo's ``main()``). Shims, applied the same way
        in both modes: seed torch/numpy/random with NeMo's ``init_all_rng`` before ``main()`` (the
        draft is built before the recipe seeds), and after ``setup()`` switch every draft config's
        ``_attn_implementation`` to ``sdpa`` (FlexAttention has no backward on CPU; the draft then
        takes the dense-mask branch of the same DFlash mask). Records per micro-batch: the loss,
        a fingerprint of the batch (row hashes, float sums) and of torch's global RNG state.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import runpy
import sys
import time

import torch


def _precompute(argv: list[str]) -> int:
    import transformers
    from nemo_automodel.components.speculative import precompute_dspark

    class _HFCausalLM:
        """What ``force_hf`` would load, minus NeMo's CUDA-only infrastructure wrapper."""

        @staticmethod
        def from_pretrained(path, *, trust_remote_code=False, torch_dtype=None, force_hf=False, **kwargs):
            return transformers.AutoModelForCausalLM.from_pretrained(
                path, trust_remote_code=trust_remote_code, dtype=torch_dtype, **kwargs)

    precompute_dspark.NeMoAutoModelForCausalLM = _HFCausalLM
    return int(precompute_dspark.main(argv) or 0)


def _hash(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().to(torch.int64).contiguous().numpy().tobytes()).hexdigest()[:12]


def _real_sum(hidden: torch.Tensor, real: torch.Tensor) -> float:
    return float((hidden.double() * real.unsqueeze(-1)).sum())


def _rng_hash() -> str:
    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12]


def _train(mode: str, seed: int, record_path: str, recipe_argv: list[str]) -> int:
    from nemo_automodel.components.training.rng import init_all_rng
    from nemo_automodel.recipes.llm import train_dspark

    records: list[dict] = []
    recipe_cls = train_dspark.TrainDSparkRecipe
    original_setup = recipe_cls.setup
    original_forward = recipe_cls._forward_batch

    def setup(self):
        original_setup(self)
        switched = 0
        for module in self.draft_model.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "_attn_implementation"):
                config._attn_implementation = "sdpa"
                switched += 1
        if not switched:
            raise RuntimeError("harness shim: found no draft config to switch to sdpa")
        self._parity_info = {
            "dataset_len": len(self.train_dataloader.dataset),
            "batches_per_epoch": len(self.train_dataloader),
            "loader": type(self.train_dataloader).__module__ + "." + type(self.train_dataloader).__name__,
            "read_manifest": getattr(train_dspark.read_manifest, "__module__", "?"),
        }

    def forward_batch(self, batch):
        pad_id = self.tokenizer.pad_token_id
        real = batch["input_ids"] != (pad_id if pad_id is not None else -1)
        entry = {
            "rng": _rng_hash(),
            "rows": [_hash(row) for row in batch["input_ids"]],
            "loss_mask": [_hash(row) for row in batch["loss_mask"]],
            # over the real (non-pad) tokens: NeMo's cache stores the target's states at pad
            # positions too, dspark's loader zero-fills them; neither reaches the loss
            "hidden_sum": _real_sum(batch["target_hidden_states"], real),
            "last_hidden_sum": _real_sum(batch["target_last_hidden_states"], real),
            "shapes": {k: list(v.shape) for k, v in batch.items()},
            "dtypes": {k: str(v.dtype) for k, v in batch.items()},
        }
        metrics = original_forward(self, batch)
        entry["loss"] = float(metrics.loss.detach())
        records.append(entry)
        return metrics

    recipe_cls.setup = setup
    recipe_cls._forward_batch = forward_batch

    holder: dict = {}
    original_run = recipe_cls.run_train_validation_loop

    def run_loop(self):
        holder["info"] = getattr(self, "_parity_info", {})
        holder["output_dir"] = str(self.output_dir)
        return original_run(self)

    recipe_cls.run_train_validation_loop = run_loop

    init_all_rng(seed)
    sys.argv = [sys.argv[0], *recipe_argv]
    start = time.perf_counter()
    if mode == "nemo":
        train_dspark.main()
    else:
        try:
            runpy.run_module("dspark_cache.nemo", run_name="__main__", alter_sys=False)
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
    elapsed = time.perf_counter() - start

    metrics_path = os.path.join(holder.get("output_dir", ""), "dspark_train_metrics.jsonl")
    logged = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as handle:
            logged = [json.loads(line) for line in handle if line.strip()]
    with open(record_path, "w") as handle:
        json.dump({"mode": mode, "seconds": elapsed, "info": holder.get("info", {}),
                   "micro_batches": records, "logged": logged}, handle)
    return 0


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("precompute", "train"):
        print(__doc__)
        return 2
    if sys.argv[1] == "precompute":
        return _precompute(sys.argv[2:])
    parser = argparse.ArgumentParser(prog="runner.py train")
    parser.add_argument("--mode", choices=("nemo", "dspark"), required=True)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--record", required=True)
    parser.add_argument("recipe_argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(sys.argv[2:])
    recipe_argv = args.recipe_argv[1:] if args.recipe_argv[:1] == ["--"] else args.recipe_argv
    return _train(args.mode, args.seed, args.record, recipe_argv)


if __name__ == "__main__":
    sys.exit(main())
