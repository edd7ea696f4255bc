"""bench/gpu_check.py and bench/gpu_capture.py run end to end in their CPU modes and say which parts
need CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_gpu_check_cpu_mode(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--device", "cpu",
                           "--rows", "16", "--seq-length", "128", "--workdir", str(tmp_path / "work"),
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == []
    assert report["a_stream_safety"]["ours"]["corrupted"] == 0
    assert "CUDA only" in report["a_stream_safety"]["control"]
    assert report["b_host_syncs"]["main_thread_trap"] == 0
    pinned = report["c_pinned_memory"]
    assert pinned["ring_capacity"] <= pinned["budget"] + pinned["largest_batch_in_ring"]
    assert "skipped" in report["d_loader_pinned"]
    assert report["e_efficiency"]["real_tokens"] > 0 and report["e_efficiency"]["pipeline_s"] > 0


@pytest.mark.slow
def test_gpu_capture_cpu_mode(tmp_path):
    """The Qwen3-8B capture run, shrunk to its tiny CPU shape: every run writes every shard, the report
    has what the GPU session reads, and the FP8 check sees only codes and scales cross."""
    out, disk, shm = tmp_path / "capture.json", tmp_path / "disk", tmp_path / "shm"
    shm.mkdir()
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_capture.py"), "--device", "cpu",
                           "--workdir", str(disk), "--shm-dir", str(shm), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failed"] == []
    assert report["target"]["layer_ids"] == [0, 1, 2, 3, 4]
    assert report["target"]["config"]["num_hidden_layers"] == 6
    per_token = report["target"]["bytes_per_token"]
    assert per_token == 6 * 64 * 2  # five captured layers and the final state apart, bf16
    plan = report["plan"]
    assert plan["real_tokens"] > 0 and plan["shards"] >= 2
    alone = report["forward_alone"]
    assert len(alone["seconds"]) == 2 and alone["reference_s"] == min(alone["seconds"]) > 0

    runs = report["runs"]
    assert report["finished"]
    # Plain runs on both targets, the big ring, then compressed on tmpfs with the CPU's lane count.
    assert [(r["target"], r["writers"], r["compression"]) for r in runs] == (
        [(target, n, "none") for n in (1, 2, 4, 8) for target in ("disk", "shm")] + [("disk", 8, "none")]
        + [("shm", 2, "zstd")])
    assert runs[-2]["max_inflight_bytes"] == 4 << 30
    for run in runs:
        assert "pipeline_s" in run, run  # neither skipped nor failed
        assert run["complete"] and run["shards"] == plan["shards"] and run["dropped_nonfinite"] == 0
        # bytes on disk: more than the states stored plain, fewer once compressed (random states too)
        assert run["tokens"] == plan["real_tokens"] and (run["bytes"] > run["tokens"] * per_token) == (
            run["compression"] == "none"), run
        assert run["states_gb_per_s"] > 0
        assert run["pipeline_s"] > 0 and run["tokens_per_s"] > 0 and 0 < run["ratio"] <= 100
        assert run["forward_span_s"] <= run["pipeline_s"] and run["steady_ratio"] >= run["ratio"]
        assert set(run["stage_seconds"]) == {"data", "device", "copy", "backpressure", "wait", "write"}
        assert 0 < run["ring_peak"] <= run["ring_capacity"]
    assert set(report["summary"]["best"]) == {"disk", "shm"} and report["summary"]["goal"] == 0.95

    fp8 = report["fp8"]
    assert fp8["ok"]
    assert fp8["bf16"]["copied_bytes_per_token"] == fp8["bf16"]["expected_bytes_per_token"] == per_token
    # FP8: one byte a value plus a float32 scale per token and layer (5 captured + the final state).
    assert fp8["fp8"]["copied_bytes_per_token"] == fp8["fp8"]["expected_bytes_per_token"] == 6 * 64 + 6 * 4
    assert fp8["fp8"]["tensors"]["target_hidden_states"] == "float8_e4m3fn on cpu"
    assert fp8["fp8"]["ring_bytes_claimed"] < fp8["bf16"]["ring_bytes_claimed"]
    assert "CUDA only" in fp8["fp8"]["profiler_dtoh"]["skipped"]
    # Every run removed what it wrote: on a GPU a run writes GBs.
    assert not list(shm.iterdir()) and not list(disk.iterdir())
