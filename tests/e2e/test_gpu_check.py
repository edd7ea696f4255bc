"""bench/gpu_check.py runs end to end in its CPU mode and says which parts need CUDA."""

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
    assert report["c_pinned_memory"]["ring_capacity"] <= (report["c_pinned_memory"]["budget"]
                                                          + report["c_pinned_memory"]["largest_batch_staged"])
    assert "skipped" in report["d_loader_pinned"]
    assert report["e_efficiency"]["real_tokens"] > 0 and report["e_efficiency"]["pipeline_s"] > 0
