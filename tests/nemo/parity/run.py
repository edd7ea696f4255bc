"""Real-NeMo parity harness (``make test-nemo``): NVIDIA's nemo-automodel 0.7.0, unedited, against dspark_cache.

Run with OUR venv's python; NeMo's pieces run as subprocesses of .venv-nemo (see setup_venv.sh):

    .venv/bin/python tests/nemo/parity/run.py [--workdir .bench/nemo_parity] [--nemo-python .venv-nemo/bin/python]

1. builds the embedded tiny Qwen3 target (4 layers x 64, vocab 2048, the ``generation`` chat
   template) and ~48 chat rows, each with assistant tokens that survive truncation at seq 256;
2. NeMo's ``precompute_dspark`` and our ``dspark-produce`` with the same flags; compares the caches
   sample by sample (input_ids / loss_mask exact, hidden states max |diff|); again with
   ``--mask-generation-prompt``;
3. trains NeMo's ``train_dspark`` recipe from each cache and compares per-step losses with the run
   on NeMo's own cache (modes: nemo, ours, imported, exported, nemo-cache+dspark); mode ``fp8``
   trains from ``dspark-produce --dtype fp8`` of the same rows (dequantised to fp32 by
   ``dspark_cache.nemo``): the same micro-batches, a last-epoch mean loss within ``--fp8-loss-rtol``;
   mode ``superset`` trains the same recipe (layers 1, 2) from one dspark cache that holds every
   layer (-1..3, as ``--for-draft-layers`` would for several drafters): its losses must equal those
   of the cache made for this drafter alone (mode ``ours``) and NeMo's; mode ``mixture`` trains from a
   mixture file naming two dspark caches of the rows' halves: the concatenated rows in order, so its
   losses must equal those of NeMo's cache and of ours of all the rows; mode ``zstd`` trains from
   ``dspark-produce --compression zstd`` of the same rows: its losses must equal mode ``ours``'s
   exactly (a lossless codec) and NeMo's within ``--loss-tol``, from fewer shard bytes.

Pieces of our side that do not exist yet are reported as ``pending``; the exit code is non-zero
only on a mismatch or a crash. Results: ``WORKDIR/results.json``; logs: ``WORKDIR/logs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from dspark_cache.format.paths import CachePaths

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

import compare  # noqa: E402

TARGET_LAYER_IDS = [1, 2]
SUPERSET_LAYER_IDS = [-1, 0, 1, 2, 3]  # every layer of the 4-layer target; the final state inside
MIN_SUPERVISED = 16  # assistant tokens inside the first seq_length tokens, so no producer skips a row


def shard_bytes(cache: str) -> int:
    """Bytes of a dspark cache's shards directory."""
    shards = CachePaths(cache).shards_dir
    return sum(os.path.getsize(os.path.join(shards, name)) for name in os.listdir(shards))


class Harness:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = os.path.abspath(args.workdir)
        self.logs = os.path.join(self.work, "logs")
        self.checks: list[dict[str, Any]] = []
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                        WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        self.env.pop("PYTHONPATH", None)
        self.tokenizer = None

    # ---------------------------------------------------------------- helpers
    def path(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    def sh(self, name: str, cmd: list[str]) -> tuple[bool, float]:
        """Run ``cmd`` with its output in logs/NAME.log; on failure print the log's tail."""
        log = os.path.join(self.logs, f"{name}.log")
        start = time.perf_counter()
        with open(log, "w") as handle:
            handle.write("$ " + " ".join(cmd) + "\n")
            handle.flush()
            code = subprocess.call(cmd, stdout=handle, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        seconds = time.perf_counter() - start
        if code != 0:
            with open(log) as handle:
                tail = handle.read()[-3000:]
            print(f"--- {name} failed (exit {code}), last lines of {log}:\n{tail}\n---", flush=True)
        return code == 0, seconds

    def check(self, name: str, status: str, count: Any = "-", diff: Any = "-", note: str = "",
              **extra: Any) -> dict[str, Any]:
        entry = {"check": name, "status": status, "count": count, "max_abs_diff": diff, "note": note, **extra}
        self.checks.append(entry)
        shown = f"{diff:.3g}" if isinstance(diff, float) else diff
        print(f"[{status:>8}] {name}: count={count} max|diff|={shown} {note}", flush=True)
        return entry

    def ours_bin(self, name: str) -> str:
        return os.path.join(self.args.ours_bin, name)

    # ---------------------------------------------------------------- inputs
    def build_inputs(self) -> None:
        from transformers import AutoTokenizer

        from dspark_cache.embedded.data import sample_rows
        from dspark_cache.embedded.target import build_target

        target = self.path("target")
        build_target(target, hidden_size=64, num_layers=4, intermediate_size=128, num_heads=4, num_kv_heads=2,
                     vocab_size=2048, template="generation", seed=0)
        self.tokenizer = AutoTokenizer.from_pretrained(target)
        sharegpt_roles = {"human": "user", "gpt": "assistant", "system": "system"}
        rows, stats = [], {"single_turn": 0, "multi_turn": 0, "sharegpt": 0, "reasoning": 0, "truncated": 0}
        for row in sample_rows(600, seed=0):
            if "conversations" in row:
                messages = [
                    {"role": sharegpt_roles[m["from"]], "content": m["value"]} for m in row["conversations"]
                ]
            else:
                messages = row["messages"]
            turns = sum(m["role"] == "assistant" for m in messages)
            if not turns:
                continue
            enc = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
            if sum(enc["assistant_masks"][: self.args.seq_length]) < MIN_SUPERVISED:
                continue
            rows.append(row)
            stats["single_turn" if turns == 1 else "multi_turn"] += 1
            stats["sharegpt"] += "conversations" in row
            stats["reasoning"] += any(m.get("reasoning_content") for m in messages)
            stats["truncated"] += len(enc["input_ids"]) > self.args.seq_length
            if len(rows) == self.args.rows:
                break
        with open(self.path("rows.jsonl"), "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.row_stats = {"rows": len(rows), **stats}
        print(f"inputs: target 4x64 vocab {len(self.tokenizer)}, rows {self.row_stats}", flush=True)

    def producer_flags(self, out: str, mgp: bool) -> list[str]:
        flags = ["--target-model", self.path("target"), "--input-data", self.path("rows.jsonl"),
                 "--output-dir", out, "--seq-length", str(self.args.seq_length), "--batch-size", "4",
                 "--shard-size", "8", "--dtype", "fp32", "--device", "cpu",
                 "--target-layer-ids", *map(str, TARGET_LAYER_IDS), "--log-level", "WARNING"]
        return flags + (["--mask-generation-prompt"] if mgp else [])

    def ours_supports(self, flag: str) -> bool:
        out = subprocess.run([self.ours_bin("dspark-produce"), "--help"], capture_output=True, text=True,
                             env=self.env).stdout
        return flag in out

    # ---------------------------------------------------------------- caches
    def caches(self, mgp: bool) -> bool:
        suffix = "_mgp" if mgp else ""
        label = "cache --mask-generation-prompt" if mgp else "cache"
        if mgp and not self.ours_supports("--mask-generation-prompt"):
            self.check(
                label, "pending", note="dspark-produce --help does not list --mask-generation-prompt yet"
            )
            return False
        nemo_dir, ours_dir = self.path("nemo_cache" + suffix), self.path("ours_cache" + suffix)
        ok, t_nemo = self.sh(
            "precompute_nemo" + suffix,
            [
                self.args.nemo_python,
                os.path.join(HERE, "runner.py"),
                "precompute",
                *self.producer_flags(nemo_dir, mgp),
            ],
        )
        if not ok:
            self.check(label, "crash", note="NeMo precompute_dspark failed (see logs)")
            return False
        ok, t_ours = self.sh("produce_ours" + suffix, [self.ours_bin("dspark-produce"),
                                                       *self.producer_flags(ours_dir, mgp)])
        if not ok:
            self.check(label, "crash", note="dspark-produce failed (see logs)")
            return False
        report = compare.compare_caches(nemo_dir, ours_dir, pad_id=self.tokenizer.pad_token_id,
                                        hidden_tol=self.args.hidden_tol, tokenizer=self.tokenizer)
        worst = max(report["hidden_max_abs_diff"].values())
        note = "ids/loss_mask exact, " if not (report["mismatched_samples"]["input_ids"]
                                                or report["mismatched_samples"]["loss_mask"]) else ""
        note += "; ".join(report["problems"]) or f"NeMo {t_nemo:.1f}s, ours {t_ours:.1f}s"
        if mgp and os.path.exists(self.path("nemo_cache")):
            # the flag must actually change NeMo's masks here, or this check proves nothing
            plain = compare.load_nemo_cache(self.path("nemo_cache"))[1]["loss_mask"]
            masked = compare.load_nemo_cache(nemo_dir)[1]["loss_mask"]
            removed = (plain - masked).clamp(min=0)
            report["flag_removed_loss_tokens"] = int(removed.sum())
            note += (f"; NeMo's flag removed {int(removed.sum())} loss tokens in "
                     f"{int(removed.any(1).sum())} samples")
            if not int(removed.sum()):
                note += " (vacuous: the flag changed nothing)"
        self.check(label, report["status"], count=f"{report['samples_dspark']}/{report['samples_nemo']}",
                   diff=worst, note=note, report=report)
        return report["status"] == "ok"

    def convert(self, src: str, dst: str, to: str, name: str) -> str | None:
        """Run dspark-convert; returns None when it does not exist yet (pending)."""
        tool = self.ours_bin("dspark-convert")
        if not os.path.exists(tool):
            return None
        ok, _ = self.sh(name, [tool, src, dst, "--to", to])
        return dst if ok else ""

    # ---------------------------------------------------------------- training
    def write_recipe(self) -> str:
        mask_token_id = self.tokenizer.convert_tokens_to_ids("</tool_response>")
        recipe = f"""# NeMo train_dspark recipe for the parity harness (CPU, world size 1)
recipe_args:
  target_model_name_or_path: {self.path('target')}
  cached_target_path: {self.path('nemo_cache')}
  mask_token_id: {mask_token_id}
  seq_length: {self.args.seq_length}
  micro_batch_size: {self.args.micro_batch_size}
  num_epochs: {self.args.epochs}
  output_dir: {self.path('train', 'unset')}
  target_layer_ids: {TARGET_LAYER_IDS}
  draft_num_hidden_layers: 1
  block_size: 4
  num_anchors: 16
  log_every_steps: 1
  shuffle_seed: 42
optimizer:
  lr: 1.0e-3
  warmup_ratio: 0.0
dist_env:
  backend: gloo
checkpoint:
  enabled: false
"""
        path = self.path("recipe.yaml")
        with open(path, "w") as handle:
            handle.write(recipe)
        return path

    def train(self, name: str, mode: str, cache: str, recipe: str, *extra: str) -> dict[str, Any] | None:
        out = self.path("train", name)
        shutil.rmtree(out, ignore_errors=True)
        record = self.path("train", f"{name}.json")
        ok, seconds = self.sh("train_" + name, [
            self.args.nemo_python, os.path.join(HERE, "runner.py"), "train", "--mode", mode,
            "--seed", str(self.args.seed), "--record", record, "--", "-c", recipe,
            f"--recipe_args.cached_target_path={cache}", f"--recipe_args.output_dir={out}", *extra])
        if not ok:
            return None
        with open(record) as handle:
            data = json.load(handle)
        data["wall_seconds"] = seconds
        return data

    def training(self, imported: str | None, exported: str | None) -> None:
        recipe = self.write_recipe()
        have_dspark_nemo = os.path.exists(os.path.join(ROOT, "dspark_cache", "nemo", "__main__.py"))
        ref = self.train("nemo", "nemo", self.path("nemo_cache"), recipe)
        if ref is None:
            self.check(
                "train nemo (reference)", "crash", note="NeMo's recipe failed on NeMo's cache (see logs)"
            )
            return
        losses = compare._losses(ref)
        self.check("train nemo (reference)", "ok", count=len(losses), diff=0.0,
                   note=f"loss {losses[0]:.4f} -> {losses[-1]:.4f}, {ref['wall_seconds']:.0f}s")
        nemo_cache_rows = compare.load_nemo_cache(self.path("nemo_cache"))[1]["input_ids"]
        sample_of_row = {compare.row_hash(row): i for i, row in enumerate(nemo_cache_rows)}

        modes = [
            (
                "ours",
                "dspark",
                self.path("ours_cache"),
                None if have_dspark_nemo else "dspark_cache.nemo missing",
            ),
            (
                "imported",
                "dspark",
                imported,
                "dspark_cache.nemo missing"
                if not have_dspark_nemo
                else ".venv/bin/dspark-convert missing"
                if imported is None
                else None,
            ),
            ("exported", "nemo", exported, ".venv/bin/dspark-convert missing" if exported is None else None),
            (
                "nemo-cache+dspark",
                "dspark",
                self.path("nemo_cache"),
                None if have_dspark_nemo else "dspark_cache.nemo missing",
            ),
        ]
        for name, mode, cache, pending in modes:
            label = f"train {name}"
            if name not in self.args.modes:
                continue
            if pending:
                self.check(label, "pending", note=pending)
                continue
            if not cache:
                self.check(label, "crash", note="dspark-convert failed (see logs)")
                continue
            data = self.train(name, mode, cache, recipe)
            if data is None:
                self.check(
                    label, "crash", note=f"recipe failed with --mode {mode} on {os.path.basename(cache)}"
                )
                continue
            report = compare.compare_runs(ref, data, tol=self.args.loss_tol, sample_of_row=sample_of_row)
            info = data.get("info", {})
            note = "; ".join(report["problems"]) or (
                f"{data['wall_seconds']:.0f}s, loader {info.get('loader', '?').rsplit('.', 1)[-1]} "
                f"({info.get('read_manifest', '?')})")
            if report["diagnosis"]:
                note += f" -- {report['diagnosis']}"
            self.check(label, report["status"], count=report["steps"], diff=report["max_abs_diff"], note=note,
                       report=report)
        if "fp8" in self.args.modes:
            self.fp8(ref, recipe, have_dspark_nemo)
        if "superset" in self.args.modes:
            self.superset(ref, recipe, have_dspark_nemo, sample_of_row)
        if "mixture" in self.args.modes:
            self.mixture(ref, recipe, sample_of_row)
        if "zstd" in self.args.modes:
            self.compressed(ref, recipe, have_dspark_nemo, sample_of_row)
        if self.args.negative_control:
            self.negative_control(ref, sample_of_row)

    def fp8(self, ref: dict[str, Any], recipe: str, have_dspark_nemo: bool) -> None:
        """Our producer's fp8 cache of the same rows through the unedited recipe: the loss curves side
        by side with the fp32 reference's (results.json), final loss within the stated tolerance."""
        label = f"train {self.args.fp8_dtype} (vs fp32)"
        if not have_dspark_nemo:
            self.check(label, "pending", note="dspark_cache.nemo missing")
            return
        cache = self.path("ours_cache_fp8")
        flags = self.producer_flags(cache, mgp=False)
        flags[flags.index("--dtype") + 1] = self.args.fp8_dtype
        ok, _ = self.sh("produce_ours_fp8", [self.ours_bin("dspark-produce"), *flags])
        data = self.train("fp8", "dspark", cache, recipe) if ok else None
        if data is None:
            self.check(label, "crash", note="dspark-produce --dtype fp8 or the recipe failed (see logs)")
            return
        report = compare.compare_quantised_run(
            ref, data, rel_tol=self.args.fp8_loss_rtol, epochs=self.args.epochs
        )
        sizes = [shard_bytes(self.path("ours_cache")), shard_bytes(cache)]
        report["shard_bytes"] = {"fp32": sizes[0], "fp8": sizes[1]}
        note = "; ".join(report["problems"]) or (
            f"last-epoch mean loss {report['last_epoch_mean']:.5f} vs {report['reference_last_epoch_mean']:.5f} "
            f"({report['relative_diff']:.3%}), worst step {report['max_relative_step_diff']:.2%}, hidden sums moved "
            f"up to {report['max_hidden_sum_rel_diff']:.2e}; "
            f"shards {sizes[1] / sizes[0]:.3f}x the fp32 cache's"
        )
        self.check(label, report["status"], count=report["steps"], diff=report["max_abs_diff"], note=note,
                   report=report)

    def superset(
        self, ref: dict[str, Any], recipe: str, have_dspark_nemo: bool, sample_of_row: dict[str, int]
    ) -> None:
        """One cache of every layer trains the recipe's drafter (layers 1, 2) as the cache made for it does."""
        label = "train superset cache"
        if not have_dspark_nemo:
            self.check(label, "pending", note="dspark_cache.nemo missing")
            return
        cache = self.path("ours_cache_superset")
        flags = self.producer_flags(cache, mgp=False)
        at = flags.index("--target-layer-ids") + 1
        flags[at : at + len(TARGET_LAYER_IDS)] = map(str, SUPERSET_LAYER_IDS)
        ok, _ = self.sh("produce_ours_superset", [self.ours_bin("dspark-produce"), *flags])
        data = self.train("superset", "dspark", cache, recipe) if ok else None
        if data is None:
            self.check(
                label, "crash", note="dspark-produce of the superset cache or the recipe failed (see logs)"
            )
            return
        report = compare.compare_runs(ref, data, tol=self.args.loss_tol, sample_of_row=sample_of_row)
        dedicated = self.path("train", "ours.json")
        if os.path.exists(dedicated):  # against the cache made for this drafter alone, too
            with open(dedicated) as handle:
                alone = compare.compare_runs(json.load(handle), data, tol=self.args.loss_tol,
                                             sample_of_row=sample_of_row)
            report["vs_dedicated"] = alone
            report["problems"] += [f"vs the dedicated cache: {p}" for p in alone["problems"]]
            if alone["status"] != "ok":
                report["status"] = alone["status"]
        sizes = [shard_bytes(self.path("ours_cache")), shard_bytes(cache)]
        note = "; ".join(report["problems"]) or (
            f"layers {SUPERSET_LAYER_IDS} stored, {TARGET_LAYER_IDS} trained; losses vs NeMo max "
            f"{report['max_abs_diff']:.2e}, vs the dedicated cache max "
            f"{report.get('vs_dedicated', {}).get('max_abs_diff', float('nan')):.2e}; shards "
            f"{sizes[1] / sizes[0]:.2f}x the dedicated cache's")
        self.check(label, report["status"], count=report["steps"], diff=report["max_abs_diff"], note=note,
                   report=report)

    def mixture(self, ref: dict[str, Any], recipe: str, sample_of_row: dict[str, int]) -> None:
        """Two dspark caches of the rows' first and second halves, named by a mixture file as the recipe's
        cached_target_path: its positions are the halves' rows in order, the concatenated rows, so the run
        must be the one on the cache of all rows (NeMo's, and ours: mode ``ours``)."""
        label = "train 2-source mixture"
        with open(self.path("rows.jsonl"), encoding="utf-8") as handle:
            rows = handle.readlines()
        sources = []
        for name, part in (("first", rows[: len(rows) // 2]), ("second", rows[len(rows) // 2 :])):
            with open(self.path(f"rows_{name}.jsonl"), "w", encoding="utf-8") as handle:
                handle.writelines(part)
            cache = self.path(f"ours_cache_{name}")
            flags = self.producer_flags(cache, mgp=False)
            flags[flags.index("--input-data") + 1] = self.path(f"rows_{name}.jsonl")
            ok, _ = self.sh(f"produce_ours_{name}", [self.ours_bin("dspark-produce"), *flags])
            if not ok:
                self.check(label, "crash", note=f"dspark-produce of the {name} half failed (see logs)")
                return
            sources.append({"path": cache})
        mixture = self.path("mixture.json")
        with open(mixture, "w") as handle:
            json.dump({"sources": sources}, handle)
        data = self.train("mixture", "dspark", mixture, recipe)
        if data is None:
            self.check(label, "crash", note="the recipe failed on the mixture file (see logs)")
            return
        report = compare.compare_runs(ref, data, tol=self.args.loss_tol, sample_of_row=sample_of_row)
        whole = self.path("train", "ours.json")
        if os.path.exists(whole):  # against our cache of all the rows, too
            with open(whole) as handle:
                alone = compare.compare_runs(json.load(handle), data, tol=self.args.loss_tol,
                                             sample_of_row=sample_of_row)
            report["vs_one_cache"] = alone
            report["problems"] += [f"vs our cache of all rows: {p}" for p in alone["problems"]]
            if alone["status"] != "ok":
                report["status"] = alone["status"]
        note = "; ".join(report["problems"]) or (
            f"halves of {len(rows)} rows; losses vs NeMo max {report['max_abs_diff']:.2e}, vs our cache of "
            f"all rows max {report.get('vs_one_cache', {}).get('max_abs_diff', float('nan')):.2e}")
        self.check(label, report["status"], count=report["steps"], diff=report["max_abs_diff"], note=note,
                   report=report)

    def compressed(self, ref: dict[str, Any], recipe: str, have_dspark_nemo: bool,
                   sample_of_row: dict[str, int]) -> None:
        """Our producer's compressed cache of the same rows through the unedited recipe: the run of the
        uncompressed cache (mode ``ours``) exactly, loss for loss, and NeMo's within tolerance."""
        label = "train zstd cache"
        if not have_dspark_nemo:
            self.check(label, "pending", note="dspark_cache.nemo missing")
            return
        if not self.ours_supports("--compression"):
            self.check(label, "pending", note="dspark-produce --help does not list --compression yet")
            return
        cache = self.path("ours_cache_zstd")
        flags = [*self.producer_flags(cache, mgp=False), "--compression", "zstd"]
        ok, _ = self.sh("produce_ours_zstd", [self.ours_bin("dspark-produce"), *flags])
        data = self.train("zstd", "dspark", cache, recipe) if ok else None
        if data is None:
            self.check(label, "crash",
                       note="dspark-produce --compression zstd or the recipe failed (see logs)")
            return
        report = compare.compare_runs(ref, data, tol=self.args.loss_tol, sample_of_row=sample_of_row)
        dedicated = self.path("train", "ours.json")
        if os.path.exists(dedicated):  # the uncompressed cache's run: the same losses, bit for bit
            with open(dedicated) as handle:
                plain = compare.compare_runs(json.load(handle), data, tol=0.0, sample_of_row=sample_of_row)
            report["vs_uncompressed"] = plain
            report["problems"] += [f"vs the uncompressed cache: {p}" for p in plain["problems"]]
            if plain["status"] != "ok":
                report["status"] = plain["status"]
        sizes = [shard_bytes(self.path("ours_cache")), shard_bytes(cache)]
        note = "; ".join(report["problems"]) or (
            f"losses vs NeMo max {report['max_abs_diff']:.2e}, vs the uncompressed cache max "
            f"{report.get('vs_uncompressed', {}).get('max_abs_diff', float('nan')):.2e}; shards "
            f"{sizes[1] / sizes[0]:.3f}x the uncompressed cache's")
        self.check(label, report["status"], count=report["steps"], diff=report["max_abs_diff"], note=note,
                   report=report)

    def negative_control(self, ref: dict[str, Any], sample_of_row: dict[str, int]) -> None:
        """Train from our --mask-generation-prompt cache: the harness must report a mismatch and pin
        it on the loss masks (proves the comparison and the diagnosis are not vacuous)."""
        cache = self.path("ours_cache_mgp")
        if not os.path.exists(cache):
            self.check("negative control", "pending", note="needs the --mask-generation-prompt caches")
            return
        data = self.train("negative-control", "dspark", cache, self.path("recipe.yaml"),
                          "--recipe_args.mask_generation_prompt=true")
        if data is None:
            self.check("negative control", "crash", note="recipe failed on ours_cache_mgp (see logs)")
            return
        report = compare.compare_runs(ref, data, tol=self.args.loss_tol, sample_of_row=sample_of_row)
        caught = report["status"] == "mismatch" and "loss_mask differs" in (report["diagnosis"] or "")
        self.check("negative control (mgp masks)", "ok" if caught else "mismatch", count=report["steps"],
                   diff=report["max_abs_diff"],
                   note=("detected: " if caught else "NOT detected as a loss-mask difference: ")
                   + (report["diagnosis"] or "no difference found"), report=report)

    # ---------------------------------------------------------------- main
    def run(self) -> int:
        start = time.perf_counter()
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.logs)
        os.makedirs(self.path("train"))
        # NeMo's venv imports dspark_cache from the checkout its setup linked (a .pth file); this run
        # tests the checkout the harness is in, whichever that is.
        os.makedirs(self.path("dspark-link"))
        os.symlink(os.path.join(ROOT, "dspark_cache"), self.path("dspark-link", "dspark_cache"))
        self.env["PYTHONPATH"] = self.path("dspark-link")
        self.build_inputs()
        cache_ok = self.caches(mgp=False)
        self.caches(mgp=True)
        imported = exported = None
        if cache_ok or os.path.exists(self.path("nemo_cache")):
            imported = self.convert(
                self.path("nemo_cache"), self.path("imported"), "dspark", "convert_import"
            )
            if imported:
                report = compare.compare_caches(
                    self.path("nemo_cache"),
                    imported,
                    pad_id=self.tokenizer.pad_token_id,
                    hidden_tol=self.args.hidden_tol,
                    tokenizer=self.tokenizer,
                )
                self.check("convert nemo -> dspark", report["status"], count=report["samples_dspark"],
                           diff=max(report["hidden_max_abs_diff"].values()),
                           note="; ".join(report["problems"]), report=report)
            elif imported is None:
                self.check("convert nemo -> dspark", "pending", note=".venv/bin/dspark-convert missing")
            exported = self.convert(self.path("ours_cache"), self.path("exported"), "nemo", "convert_export")
            if exported:
                report = compare.compare_caches(
                    exported,
                    self.path("ours_cache"),
                    pad_id=self.tokenizer.pad_token_id,
                    hidden_tol=self.args.hidden_tol,
                    tokenizer=self.tokenizer,
                )
                layout = compare.compare_nemo_layouts(self.path("nemo_cache"), exported)
                report["problems"] += layout["problems"]
                status = "mismatch" if report["problems"] else "ok"
                self.check("convert dspark -> nemo", status, count=report["samples_nemo"],
                           diff=max(report["hidden_max_abs_diff"].values()),
                           note="; ".join(report["problems"]), report=report)
            elif exported is None:
                self.check("convert dspark -> nemo", "pending", note=".venv/bin/dspark-convert missing")
        self.training(imported, exported)

        total = time.perf_counter() - start
        print(f"\n{'check':<34} {'count':>7} {'max|diff|':>10}  status")
        for c in self.checks:
            diff = c["max_abs_diff"]
            shown = f"{diff:.2e}" if isinstance(diff, float) else str(diff)
            print(f"{c['check']:<34} {str(c['count']):>7} {shown:>10}  {c['status']}")
        failed = [c for c in self.checks if c["status"] in ("mismatch", "crash")]
        summary = {"seconds": round(total, 1), "rows": getattr(self, "row_stats", {}),
                   "loss_tol": self.args.loss_tol, "hidden_tol": self.args.hidden_tol, "checks": self.checks,
                   "failed": [c["check"] for c in failed]}
        with open(self.path("results.json"), "w") as handle:
            json.dump(summary, handle, indent=2, default=str)
        print(f"\n{len(failed)} failed, {sum(c['status'] == 'pending' for c in self.checks)} pending, "
              f"{sum(c['status'] == 'ok' for c in self.checks)} ok in {total:.0f}s; "
              f"results: {self.path('results.json')}")
        return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Real-NeMo parity harness for dspark_cache.")
    parser.add_argument("--workdir", default=os.path.join(ROOT, ".bench", "nemo_parity"))
    parser.add_argument("--nemo-python", default=os.path.join(ROOT, ".venv-nemo", "bin", "python"))
    parser.add_argument("--ours-bin", default=os.path.dirname(sys.executable),
                        help="bin folder of our venv (dspark-produce, dspark-convert)")
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234, help="torch/numpy/random seed before NeMo's main()")
    parser.add_argument("--loss-tol", type=float, default=1e-4)
    parser.add_argument("--hidden-tol", type=float, default=1e-4)
    parser.add_argument("--modes", nargs="+",
                        default=["ours", "imported", "exported", "nemo-cache+dspark", "fp8", "superset",
                                 "mixture", "zstd"],
                        help="training modes besides the nemo reference")
    parser.add_argument(
        "--fp8-loss-rtol",
        type=float,
        default=0.01,
        help="mode fp8: the last-epoch mean loss may differ from the fp32 reference's by this much",
    )
    parser.add_argument(
        "--fp8-dtype",
        choices=["fp8", "fp8_e5m2"],
        default="fp8",
        help="mode fp8: the cache dtype (fp8_e5m2 has twice e4m3's error: the loss must see it)",
    )
    parser.add_argument(
        "--negative-control",
        action="store_true",
        help="also train from the --mask-generation-prompt cache and require a detected mismatch",
    )
    args = parser.parse_args(argv)
    if not os.path.exists(args.nemo_python):
        parser.error(f"{args.nemo_python} missing: run `make test-nemo` (it creates .venv-nemo)")
    return Harness(args).run()


if __name__ == "__main__":
    sys.exit(main())
