"""Producer to object storage against local disk, on bench/producer.py's synthetic device.

    python bench/producer_remote.py                      # 200 long-tail rows, 3 repeats, ratios 2 and 1
    python bench/producer_remote.py --rows 400 --repeat 5 --ratios 2,1,0.5

One process, one plan, one moto S3 server (tests/support/s3server.py, a process of its own on this
machine, its spill files on /dev/shm like the local cache). The set-up is bench/producer.py's
synthetic suite, imported from it: the embedded target only for its tokenizer, chat data of the
``long-tail`` profile (``ensure_inputs``, ``load_plan``), a payload of Qwen3-0.6B's width (H=1024,
28 layers, 5 captured: 10 KiB a token in bf16), shards of 16, and its fake device
(``SyntheticTarget``: sleeps a calibrated time per padded token, returns right-shaped tensors).
Both sinks write on /dev/shm (``synthetic_workdir``): the local cache, and the s3 run's staging
directory; every s3 run gets a fresh prefix, and the server is wiped after it (outside the timing).

Measured, interleaved per repetition (as producer.py's ``measure_phases``, whose stages are closures
there and so written again here):
  (a) device only    every planned batch through the fake device, nothing written
  (b) write only     the same bytes through the writer with an instant device: to the directory,
                     and to s3:// (RemoteOutput: staging, 4 upload threads, HEAD, index) until
                     ``flush()`` returns (every shard on the store)
  (c) pipeline       the producer's ``run_pipeline`` with the fake device, to each sink; the s3
                     time runs until ``flush()`` returns (the tail after the pipeline is reported)
  efficiency         max(fastest a, fastest b of that sink) / median c, producer.py's definition;
  device busy        median a / median c: the fraction of the wall time the device worked
  overlap            per run, max(a, the writer thread's busy time in that run) / c
The fake device is calibrated, as producer.py calibrates it against the local writer, against the
*slower* sink: seconds per padded token = ratio x fastest s3 write-only / padded tokens, so that
ratio 2 is compute-bound and 1 balanced for the s3 pipeline (and both compute-bound for the local
one); against the local writer alone moto on this machine would make every s3 run upload-bound.
Backpressure: an s3 pipeline with ``staging_limit`` = ``--small-limit-shards`` median shards, at each
ratio, once with the default ring (``--max-inflight-bytes`` 1 GiB, which holds this whole run, so a
held writer never reaches the device) and once with a ``--small-ring`` (512 MiB) ring, where it could;
and an instant device to s3 with that limit. The staged bytes (RemoteOutput.transfer and the staging
directory's tar bytes on disk) are sampled each time a shard is handed over, and each shard's hand-over
and commit times are kept (``timeline`` in the JSON).
Requests: per s3 run, moto's own request log (a line per request: method, path, query) counted by
kind; one whole ``dspark-produce`` command (the embedded real tiny target, 200 rows) to s3:// through
tests/support/faultproxy.FaultProxy counts every request of a whole job (lease, heartbeats, event
log, plan, weights, manifest) by the object it touched, checked against moto's log of the same run;
the same command to a local directory for its wall time (``--whole-repeat`` of each, alternating).
CPU: the bench process's own (all threads: writer, uploads, obstore's runtime) and moto's, per run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from importlib.metadata import version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from producer import (  # noqa: E402  (bench/producer.py)
    BENCH_DIR, SyntheticTarget, ensure_inputs, load_plan, produce_cli_args, synthetic_workdir,
)
from producer import machine as producer_machine  # noqa: E402

from tests.support.faultproxy import FaultProxy  # noqa: E402
from tests.support.s3server import S3Server  # noqa: E402

BUCKET = "bench"
_LOG_LINE = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) (\S+) HTTP/1\.[01]" (\d{3})')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


# ----------------------------------------------------------------------------- requests

def request_kind(method: str, target: str) -> str:
    """What one S3 request was: PUT, PUT part, POST create / complete (multipart), GET, HEAD, LIST, ..."""
    path, _, query = target.partition("?")
    params = dict(p.partition("=")[::2] for p in query.split("&") if p)
    if method == "PUT":
        return "PUT part" if "partNumber" in params else "PUT"
    if method == "POST":
        if "uploads" in params:
            return "POST create multipart"
        if "uploadId" in params:
            return "POST complete multipart"
        if "delete" in params:
            return "POST delete objects"
        return "POST"
    if method == "GET":
        if "uploads" in params:
            return "LIST multipart uploads"
        if "list-type" in params or path.strip("/").count("/") == 0:
            return "LIST"
        return "GET"
    return method


def object_kind(target: str, prefix: str) -> str:
    """Which of the cache's objects a request touched (its path under the run's prefix)."""
    path = target.partition("?")[0].lstrip("/")
    if "?" in target and "prefix=" in target.partition("?")[2]:
        listed = re.search(r"prefix=([^&]*)", target).group(1).replace("%2F", "/")
        return "listing " + (
            listed[len(prefix) :].strip("/").split("/")[0] + "/" if listed.startswith(prefix) else listed
        )
    key = path[len(BUCKET) + 1:]
    if not key.startswith(prefix + "/"):
        return "bucket" if not key else "other"
    relative = key[len(prefix) + 1:]
    if relative.startswith("shards/") and relative.endswith(".tar"):
        return "shard tar"
    if relative.startswith("shards/") and relative.endswith(".idx"):
        return "shard index"
    top = relative.split("/")[0]
    return relative if "/" not in relative else (relative if top == "control" else top + "/")


def moto_requests(server: S3Server, start: int) -> tuple[list[tuple[str, str]], int]:
    """The (method, target) of every request moto logged from byte ``start`` of its log; and the end."""
    name = server._log_file.name  # noqa: SLF001  (tests/support/s3server.py keeps it private; a file per server)
    with open(name, "rb") as handle:
        handle.seek(start)
        data = handle.read()
    seen = []
    for line in data.decode(errors="replace").splitlines():
        match = _LOG_LINE.search(_ANSI.sub("", line))
        if match:
            seen.append((match[1], match[2]))
    return seen, start + len(data)


def log_end(server: S3Server) -> int:
    return os.path.getsize(server._log_file.name)  # noqa: SLF001


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS")) / 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def count(requests: list[tuple[str, str]]) -> dict[str, int]:
    return dict(sorted(Counter(request_kind(m, t) for m, t in requests).items()))


# ----------------------------------------------------------------------------- runs

class Bench:
    def __init__(self, args: argparse.Namespace, pargs: argparse.Namespace) -> None:
        import torch

        from dspark_cache.producer import collate

        self.args, self.pargs = args, pargs
        self.target, self.data = ensure_inputs(pargs)
        self.cfg, self.info, self.layer_ids, self.shape, self.plan, tok = load_plan(
            pargs, self.target, self.data
        )
        self.pad = tok.pad_token_id
        self.device = torch.device("cpu")
        self.padded = sum(max(s.length for s in b) * len(b) for sh in self.plan.shards for b in sh.batches)
        self.instant = SyntheticTarget(self.shape, self.cfg.batch_token_budget, 0.0, self.device).forward
        self.collate = collate
        self.shm = synthetic_workdir(pargs)  # /dev/shm unless --synthetic-dir
        self.server: S3Server | None = None

    # -- stages ---------------------------------------------------------------------------------

    def device_only(self, forward) -> float:
        t = time.perf_counter()
        for shard in self.plan.shards:
            for batch in shard.batches:
                forward(*self.collate(batch, self.pad, self.device))
        return time.perf_counter() - t

    def through(self, forward, sink: str, staging_limit: int | None = None, ring: int | None = None) -> dict:
        """One ``run_pipeline`` to ``sink`` ("local" or "s3"); for s3 until every shard is on the store."""
        from dspark_cache.storage.backing import StorageOptions
        from dspark_cache.storage.output import CacheOutput
        from dspark_cache.storage.remote.output import RemoteOutput
        from dspark_cache.producer import run_pipeline

        where = tempfile.mkdtemp(prefix=f"{sink}-", dir=self.shm)
        remote = sink == "s3"
        prefix = f"run-{uuid.uuid4().hex[:12]}"
        if remote:
            assert self.server is not None
            output = RemoteOutput(
                f"s3://{BUCKET}/{prefix}",
                storage=StorageOptions({"endpoint": self.server.endpoint}),
                staging_dir=where,
                staging_limit=staging_limit,
            )
            start = log_end(self.server)
        else:
            output = CacheOutput(where)
        output.paths.ensure_dirs()
        shards_dir = output.paths.shards_dir
        peak = {"staged_bytes": 0, "staging_tar_bytes": 0}
        sizes: list[int] = []

        timeline: list[tuple[int, int, float]] = []  # shard, bytes, seconds when handed over
        committed: dict[int, float] = {}
        if remote:  # when each shard's index reached the store (the transfer thread's callback, wrapped)
            uploads = output._uploads  # noqa: SLF001  (observed only: nothing else changes)
            real_committed = uploads._committed  # noqa: SLF001

            def timed_committed(index, etag: str) -> None:
                real_committed(index, etag)
                committed[index.shard_id] = time.perf_counter() - t

            uploads._committed = timed_committed  # noqa: SLF001

        def on_published(shard, index) -> None:  # on the writer thread, right after the hand-over
            sizes.append(index.tar_bytes)
            timeline.append((index.shard_id, index.tar_bytes, time.perf_counter() - t))
            if remote:
                peak["staged_bytes"] = max(peak["staged_bytes"], output.transfer["staged_bytes"])
                on_disk = 0
                for entry in os.scandir(shards_dir):
                    if entry.name.endswith((".tar", ".partial")):
                        try:
                            on_disk += entry.stat().st_size
                        except FileNotFoundError:  # uploaded and removed meanwhile
                            pass
                peak["staging_tar_bytes"] = max(peak["staging_tar_bytes"], on_disk)

        cpu = os.times()
        moto_cpu = cpu_seconds(self.server._proc.pid) if remote else 0.0  # noqa: SLF001
        t = time.perf_counter()
        stats = run_pipeline(
            self.plan.shards,
            forward,
            output=output,
            shape=self.shape,
            device=self.device,
            pad_id=self.pad,
            max_inflight_bytes=ring or self.pargs.max_inflight_bytes,
            writer_threads=self.args.writer_threads,
            on_published=on_published,
            check_finite=False,
        )
        pipeline_s = time.perf_counter() - t
        output.flush()
        seconds = time.perf_counter() - t
        used = os.times()
        out = {
            "seconds": seconds,
            "pipeline_s": pipeline_s,
            "flush_tail_s": seconds - pipeline_s,
            "cpu_s": used.user + used.system - cpu.user - cpu.system,
            "bytes": stats.bytes,
            "writer_busy_s": stats.times.write,
            "backpressure_s": stats.times.backpressure,
            "shards": len(sizes),
            "tar_sizes": sizes,
            "stage_times": stats.times.as_dict(),
            "timeline": [
                (k, n, round(a, 3), round(committed[k], 3) if k in committed else None)
                for k, n, a in timeline
            ],
        }
        if remote:
            out.update(output.transfer)
            out.update({f"peak_{k}": v for k, v in peak.items()})
            out["staging_limit"] = output.staging_limit
        out["ring_budget"] = ring or self.pargs.max_inflight_bytes
        output.release()
        shutil.rmtree(where, ignore_errors=True)
        if remote:
            out["moto_cpu_s"] = cpu_seconds(self.server._proc.pid) - moto_cpu  # noqa: SLF001
            out["moto_rss_mb"] = rss_mb(self.server._proc.pid)  # noqa: SLF001  (objects held, before the wipe)
            time.sleep(0.3)  # moto logs a request after its response
            requests, _ = moto_requests(self.server, start)
            out["requests"] = count(requests)
            out["requests_by_object"] = dict(sorted(Counter(
                f"{request_kind(m, q)} {object_kind(q, prefix)}" for m, q in requests).items()))
            self.server.reset()  # nothing of this run stays in moto's memory or spill files
            self.server.make_bucket(BUCKET)
        os.sync()  # no dirty pages of this run may slow the next one
        return out

    def synthetic(self, ratio_of: float, ratio: float):
        return SyntheticTarget(self.shape, self.cfg.batch_token_budget, ratio * ratio_of / self.padded,
                               self.device).forward

    # -- the whole command ----------------------------------------------------------------------

    def whole_command(self, sink: str) -> dict:
        """``dspark-produce`` with the embedded real tiny target (its own process), to a directory or to
        s3:// through a FaultProxy that logs every request."""
        assert self.server is not None
        where = tempfile.mkdtemp(prefix=f"whole-{sink}-", dir=self.shm)
        prefix = f"whole-{uuid.uuid4().hex[:12]}"
        wargs = argparse.Namespace(**{**vars(self.pargs), "shard_size": self.args.whole_shard_size})
        env = {**os.environ, "DSPARK_LOCAL_CACHE_DIR": os.path.join(where, "node")}
        out: dict = {}
        if sink == "local":
            cmd = produce_cli_args(wargs, self.target, self.data, os.path.join(where, "cache"))
            proxy = None
        else:
            proxy = FaultProxy("127.0.0.1", self.server.port).start()
            env.update(self.server.env())
            env["AWS_ENDPOINT_URL"] = proxy.endpoint
            cmd = produce_cli_args(wargs, self.target, self.data, f"s3://{BUCKET}/{prefix}")
            cmd += ["--staging-dir", os.path.join(where, "staging")]
            start = log_end(self.server)
        cmd = [sys.executable, "-m", "dspark_cache.producer", *cmd, "--no-progress"]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        out["seconds"] = time.perf_counter() - t
        if proc.returncode != 0:
            if proxy is not None:
                proxy.stop()
            raise SystemExit(f"dspark-produce to {sink} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        if proxy is not None:
            seen = [(s.method, s.target) for s in proxy.log]
            proxy.stop()
            time.sleep(0.3)
            moto, _ = moto_requests(self.server, start)
            out["requests"] = count(seen)
            out["requests_total"] = len(seen)
            out["request_log"] = [f"{m} {q}" for m, q in seen]  # in order: what a whole job asks of the store
            out["moto_requests_total"] = len(moto)
            out["requests_by_object"] = dict(sorted(Counter(
                f"{request_kind(m, q)} {object_kind(q, prefix)}" for m, q in seen).items()))
            listing = self.server.boto3_client().list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/shards/")
            out["shards"] = sum(o["Key"].endswith(".tar") for o in listing.get("Contents", []))
            self.server.reset()
            self.server.make_bucket(BUCKET)
        else:
            out["shards"] = sum(
                n.endswith(".idx") for n in os.listdir(os.path.join(where, "cache", "shards"))
            )
        shutil.rmtree(where, ignore_errors=True)
        return out


def measure(args: argparse.Namespace) -> dict:
    began = time.monotonic()
    pargs = producer_args(args)
    bench = Bench(args, pargs)
    plan = bench.plan
    print(
        f"plan: {plan.num_samples} samples, {plan.num_tokens} real tokens, {len(plan.shards)} shards of "
        f"{pargs.shard_size}, padded tokens {bench.padded} ({bench.padded / plan.num_tokens - 1:.1%} padding) "
        f"[{time.monotonic() - began:.0f} s]",
        flush=True,
    )
    runs: dict[str, list] = {}

    def add(key: str, value) -> None:
        runs.setdefault(key, []).append(value)

    # The server's spill files (objects above ~5 MiB) on /dev/shm, like the local cache and the staging
    # directory: the VM disk's bimodal write speed would otherwise be in every s3 number.
    spill = tempfile.mkdtemp(prefix="moto-", dir=bench.shm)
    server = bench.server = S3Server(server_env={"TMPDIR": spill})
    try:
        server.start()
        os.environ.update(server.env())
        server.make_bucket(BUCKET)
        # Warm-up outside every timing: the fake device's first call, the writer's first run,
        # the client's first connections and moto's first responses.
        bench.instant(*bench.collate(plan.shards[0].batches[0], bench.pad, bench.device))
        bench.through(bench.instant, "local")
        bench.through(bench.instant, "s3")
        for rep in range(args.repeat):  # write only, both sinks, interleaved
            add("write_local", bench.through(bench.instant, "local"))
            add("write_s3", bench.through(bench.instant, "s3"))
            print(f"  write-only rep {rep}: local {runs['write_local'][-1]['seconds']:.2f} s, s3 "
                  f"{runs['write_s3'][-1]['seconds']:.2f} s "
                  f"(pipeline {runs['write_s3'][-1]['pipeline_s']:.2f} s + flush)", flush=True)
        write_local = min(r["seconds"] for r in runs["write_local"])
        write_s3 = min(r["seconds"] for r in runs["write_s3"])
        sizes = runs["write_local"][0]["tar_sizes"]
        small = args.small_limit_shards * int(statistics.median(sizes))
        print(
            f"  calibration: fastest write-only local {write_local:.2f} s, s3 {write_s3:.2f} s; small staging "
            f"limit {small / 1e6:.0f} MB ({args.small_limit_shards} median shards of "
            f"{statistics.median(sizes) / 1e6:.1f} MB; largest {max(sizes) / 1e6:.1f} MB)",
            flush=True,
        )
        add("write_s3_small_limit", bench.through(bench.instant, "s3", staging_limit=small))
        r = runs["write_s3_small_limit"][-1]
        print(f"  write-only s3, small limit: {r['seconds']:.2f} s, stalled {r['stalled_seconds']:.2f} s, "
              f"peak staged {r['peak_staged_bytes'] / 1e6:.0f} MB", flush=True)
        for ratio in args.ratios:
            forward = bench.synthetic(write_s3, ratio)
            for rep in range(args.repeat):  # interleaved: drift hits every stage alike
                add(f"device_{ratio}", bench.device_only(forward))
                add(f"local_{ratio}", bench.through(forward, "local"))
                add(f"s3_{ratio}", bench.through(forward, "s3"))
                print(
                    f"  ratio {ratio} rep {rep}: device {runs[f'device_{ratio}'][-1]:.2f} s, local "
                    f"{runs[f'local_{ratio}'][-1]['seconds']:.2f} s, s3 {runs[f's3_{ratio}'][-1]['seconds']:.2f} s "
                    f"(stalled {runs[f's3_{ratio}'][-1]['stalled_seconds']:.2f} s, tail "
                    f"{runs[f's3_{ratio}'][-1]['flush_tail_s']:.2f} s)",
                    flush=True,
                )
            add(f"s3_small_limit_{ratio}", bench.through(forward, "s3", staging_limit=small))
            r = runs[f"s3_small_limit_{ratio}"][-1]
            print(
                f"  ratio {ratio}, small limit: s3 {r['seconds']:.2f} s, stalled {r['stalled_seconds']:.2f} s, "
                f"peak staged {r['peak_staged_bytes'] / 1e6:.0f} MB",
                flush=True,
            )
            # The default ring (--max-inflight-bytes 1 GiB) holds this whole run: a writer held by the
            # staging limit is then invisible to the device. With a ring smaller than the run it reaches it.
            add(f"s3_small_limit_small_ring_{ratio}", bench.through(forward, "s3", staging_limit=small,
                                                                    ring=args.small_ring))
            r = runs[f"s3_small_limit_small_ring_{ratio}"][-1]
            print(
                f"  ratio {ratio}, small limit, ring {args.small_ring / 1e6:.0f} MB: s3 {r['seconds']:.2f} s, "
                f"stalled {r['stalled_seconds']:.2f} s, device waited for ring space "
                f"{r['backpressure_s']:.2f} s",
                flush=True,
            )
        for rep in range(args.whole_repeat):
            add("whole_local", bench.whole_command("local"))
            add("whole_s3", bench.whole_command("s3"))
            print(
                f"  whole command rep {rep}: local {runs['whole_local'][-1]['seconds']:.2f} s, s3 "
                f"{runs['whole_s3'][-1]['seconds']:.2f} s, {runs['whole_s3'][-1]['requests_total']} requests "
                f"({runs['whole_s3'][-1]['moto_requests_total']} in moto's log) for "
                f"{runs['whole_s3'][-1]['shards']} shards",
                flush=True,
            )
    except BaseException:  # what the server said before it went (stop() removes its log)
        proc = server._proc  # noqa: SLF001
        print(f"moto server running: {server.running}, exit code {proc.poll() if proc else None}\n"
              f"{server.stderr_tail(15)}", file=sys.stderr)
        raise
    finally:
        server.stop()
        shutil.rmtree(spill, ignore_errors=True)
        shutil.rmtree(bench.shm, ignore_errors=True)
        shutil.rmtree(pargs.workdir, ignore_errors=True)
    return summarise(args, pargs, bench, runs, write_local, write_s3, small, time.monotonic() - began)


def summarise(args, pargs, bench, runs, write_local, write_s3, small, total_s) -> dict:
    med = statistics.median
    plan = bench.plan
    res: dict = {
        "machine": machine(),
        "args": vars(args),
        "samples": plan.num_samples,
        "tokens": plan.num_tokens,
        "shards": len(plan.shards),
        "padded_tokens": bench.padded,
        "bytes": runs["write_local"][0]["bytes"],
        "tar_sizes": runs["write_local"][0]["tar_sizes"],
        "write_local_fastest_s": write_local,
        "write_s3_fastest_s": write_s3,
        "small_limit": small,
        "runs": runs,
        "seconds_total": total_s,
    }
    res["write_only"] = {
        sink: {
            "median_s": med(r["seconds"] for r in runs[f"write_{sink}"]),
            "gb_per_s": res["bytes"] / med(r["seconds"] for r in runs[f"write_{sink}"]) / 1e9,
        }
        for sink in ("local", "s3")
    }
    res["write_only"]["s3"]["vs_local"] = (
        res["write_only"]["s3"]["median_s"] / res["write_only"]["local"]["median_s"]
    )
    shards = len(plan.shards)
    per_shard = {k: v / shards for k, v in runs["write_s3"][0]["requests"].items()}
    res["requests_per_shard"] = per_shard
    res["ratios"] = {}
    for ratio in args.ratios:
        dev = runs[f"device_{ratio}"]
        out = {"device_median_s": med(dev), "device_fastest_s": min(dev)}
        for sink, fastest_write in (("local", write_local), ("s3", write_s3)):
            rs = runs[f"{sink}_{ratio}"]
            c = med(r["seconds"] for r in rs)
            out[sink] = {
                "median_s": c, "runs_s": [r["seconds"] for r in rs],
                "efficiency": max(min(dev), fastest_write) / c,
                "device_busy": med(dev) / c,
                "overlap_runs": [max(d, r["writer_busy_s"]) / r["seconds"] for d, r in zip(dev, rs)],
                "stalled_s": [r.get("stalled_seconds", 0.0) for r in rs],
                "flush_tail_s": [r["flush_tail_s"] for r in rs],
                "writer_busy_s": med(r["writer_busy_s"] for r in rs),
                "backpressure_s": med(r["backpressure_s"] for r in rs),
                "copy_s": med(r["stage_times"]["copy"] for r in rs),  # the main thread's copies into the ring
                "cpu_s": med(r["cpu_s"] for r in rs),
                "moto_cpu_s": med(r.get("moto_cpu_s", 0.0) for r in rs),
            }
        out["s3_vs_local"] = out["s3"]["median_s"] / out["local"]["median_s"]
        out["s3_vs_local_paired"] = med(s["seconds"] / loc["seconds"]
                                        for s, loc in zip(runs[f"s3_{ratio}"], runs[f"local_{ratio}"]))
        for key, name in (("s3_small_limit", f"s3_small_limit_{ratio}"),
                          ("s3_small_limit_small_ring", f"s3_small_limit_small_ring_{ratio}")):
            sm = runs[name][0]
            out[key] = {
                k: sm[k]
                for k in (
                    "seconds",
                    "stalled_seconds",
                    "peak_staged_bytes",
                    "peak_staging_tar_bytes",
                    "flush_tail_s",
                    "staging_limit",
                    "backpressure_s",
                    "ring_budget",
                )
            }
            out[key]["vs_default_limit"] = sm["seconds"] / out["s3"]["median_s"]
            out[key]["device_busy"] = med(dev) / sm["seconds"]
        res["ratios"][str(ratio)] = out
    sm = runs["write_s3_small_limit"][0]
    res["write_s3_small_limit"] = {k: sm[k] for k in ("seconds", "stalled_seconds", "peak_staged_bytes",
                                                       "peak_staging_tar_bytes", "staging_limit")}
    res["write_s3_small_limit"]["vs_default_limit"] = sm["seconds"] / res["write_only"]["s3"]["median_s"]
    res["write_s3_peak_staged_bytes"] = max(r["peak_staged_bytes"] for r in runs["write_s3"])
    if runs.get("whole_s3"):
        w = runs["whole_s3"]
        res["whole"] = {"local_median_s": med(r["seconds"] for r in runs["whole_local"]),
                        "s3_median_s": med(r["seconds"] for r in w), "shards": w[0]["shards"],
                        "requests": w[0]["requests"], "requests_total": [r["requests_total"] for r in w],
                        "moto_requests_total": [r["moto_requests_total"] for r in w],
                        "requests_by_object": w[0]["requests_by_object"]}
        res["whole"]["s3_vs_local"] = res["whole"]["s3_median_s"] / res["whole"]["local_median_s"]
    return res


def report(r: dict) -> str:
    mb = 1e6
    lines = [
        f"{r['samples']} samples, {r['tokens']:,} real tokens, {r['shards']} shards, {r['bytes'] / 1e9:.2f} GB "
        f"per run (tars median {statistics.median(r['tar_sizes']) / mb:.1f} MB, largest "
        f"{max(r['tar_sizes']) / mb:.1f} MB)",
        "",
    ]
    w = r["write_only"]
    lines += [
        "| write only (instant device) | median s | GB/s |",
        "|---|---|---|",
        f"| local (/dev/shm) | {w['local']['median_s']:.2f} | {w['local']['gb_per_s']:.2f} |",
        f"| s3 (staging on /dev/shm, until flush) | {w['s3']['median_s']:.2f} | {w['s3']['gb_per_s']:.2f} |",
        f"| s3, staging limit {r['small_limit'] / mb:.0f} MB | {r['write_s3_small_limit']['seconds']:.2f} | "
        f"{r['bytes'] / r['write_s3_small_limit']['seconds'] / 1e9:.2f} |",
        "",
    ]
    lines += [
        "| ratio | device s | local s | s3 s | s3/local (paired) | efficiency local / s3 | device busy local / s3 "
        "| s3 stalled s | s3 tail after pipeline s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ratio, o in r["ratios"].items():
        lo, s3 = o["local"], o["s3"]
        lines.append(
            f"| {ratio} | {o['device_median_s']:.2f} | {lo['median_s']:.2f} | {s3['median_s']:.2f} | "
            f"{o['s3_vs_local']:.3f}x ({o['s3_vs_local_paired']:.3f}x) | {lo['efficiency']:.2f} / "
            f"{s3['efficiency']:.2f} | {lo['device_busy']:.2f} / {s3['device_busy']:.2f} | "
            f"{statistics.median(s3['stalled_s']):.2f} | {statistics.median(s3['flush_tail_s']):.2f} |"
        )
    lines += [
        "",
        "| ratio | main-thread copy s local / s3 | writer busy s local / s3 | bench CPU s local / s3 | "
        "moto CPU s |",
        "|---|---|---|---|---|",
    ]
    for ratio, o in r["ratios"].items():
        lo, s3 = o["local"], o["s3"]
        lines.append(
            f"| {ratio} | {lo['copy_s']:.2f} / {s3['copy_s']:.2f} | {lo['writer_busy_s']:.2f} / "
            f"{s3['writer_busy_s']:.2f} | {lo['cpu_s']:.1f} / {s3['cpu_s']:.1f} | {s3['moto_cpu_s']:.1f} |"
        )
    lines += [
        "",
        "| staging limit run | seconds | vs default limit | stalled s | peak staged MB (transfer) | "
        "peak tar MB in staging dir |",
        "|---|---|---|---|---|---|",
    ]
    for ratio, o in r["ratios"].items():
        sm = o["s3_small_limit"]
        lines.append(
            f"| ratio {ratio}, limit {sm['staging_limit'] / mb:.0f} MB | {sm['seconds']:.2f} | "
            f"{sm['vs_default_limit']:.3f}x | {sm['stalled_seconds']:.2f} | {sm['peak_staged_bytes'] / mb:.0f} | "
            f"{sm['peak_staging_tar_bytes'] / mb:.0f} |"
        )
        sm = o["s3_small_limit_small_ring"]
        lines.append(
            f"| ratio {ratio}, limit {sm['staging_limit'] / mb:.0f} MB, ring {sm['ring_budget'] / mb:.0f} MB | "
            f"{sm['seconds']:.2f} | {sm['vs_default_limit']:.3f}x | {sm['stalled_seconds']:.2f} "
            f"(device waited {sm['backpressure_s']:.2f}) | {sm['peak_staged_bytes'] / mb:.0f} | "
            f"{sm['peak_staging_tar_bytes'] / mb:.0f} |"
        )
    sm = r["write_s3_small_limit"]
    lines.append(
        f"| instant device, limit {sm['staging_limit'] / mb:.0f} MB | {sm['seconds']:.2f} | "
        f"{sm['vs_default_limit']:.3f}x | {sm['stalled_seconds']:.2f} | {sm['peak_staged_bytes'] / mb:.0f} | "
        f"{sm['peak_staging_tar_bytes'] / mb:.0f} |"
    )
    lines.append(
        f"(instant device, default 8 GiB limit: peak staged {r['write_s3_peak_staged_bytes'] / mb:.0f} MB)"
    )
    lines += ["", "requests per shard (pipeline to s3, moto's log): " + ", ".join(
        f"{k} {v:.2f}" for k, v in r["requests_per_shard"].items())]
    if "whole" in r:
        wh = r["whole"]
        lines += ["", f"whole dspark-produce (embedded tiny target): local {wh['local_median_s']:.2f} s, s3 "
                  f"{wh['s3_median_s']:.2f} s ({wh['s3_vs_local']:.2f}x); {wh['shards']} shards, requests "
                  f"{wh['requests_total']} (moto's log: {wh['moto_requests_total']}): " + ", ".join(
                      f"{k} {v}" for k, v in wh["requests"].items()),
                  "by object: " + ", ".join(f"{k} {v}" for k, v in wh["requests_by_object"].items())]
    return "\n".join(lines)


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        "?",
    )
    return {**producer_machine(), "model": cpu, **{n: version(n) for n in ("obstore", "moto")}}


def producer_args(args: argparse.Namespace) -> argparse.Namespace:
    """bench/producer.py's settings for its synthetic suite (its defaults, the long-tail profile)."""
    workdir = tempfile.mkdtemp(prefix="producer-remote-", dir=BENCH_DIR)
    return argparse.Namespace(
        target=None, data=None, rows=args.rows, data_profile=args.data_profile, heads=None, head_dim=None,
        hidden=64, layers=8, model_vocab=2048, seq_length=2048, batch_size=16, shard_size=16, dtype="bf16",
        device="cpu", max_inflight_bytes=1 << 30, workdir=workdir, synthetic_dir=args.synthetic_dir,
        synthetic_hidden=1024, synthetic_layers=28)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200, help="rows of the embedded sample data")
    p.add_argument("--data-profile", choices=["default", "long-tail"], default="long-tail")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--writer-threads", type=int, default=2, help="shards written at once (the producer's option)"
    )
    p.add_argument(
        "--ratios",
        default="2,1",
        help="fake device time as multiples of the fastest s3 write-only time (2: compute-bound, 1: balanced)",
    )
    p.add_argument("--small-limit-shards", type=float, default=2.0,
                   help="the backpressure runs' --staging-limit, in median shards")
    p.add_argument(
        "--small-ring",
        type=int,
        default=512 << 20,
        help="--max-inflight-bytes of one more backpressure run per ratio (default 512 MiB, under the run's bytes)",
    )
    p.add_argument(
        "--whole-repeat", type=int, default=2, help="whole dspark-produce commands per sink (0: none)"
    )
    p.add_argument("--whole-shard-size", type=int, default=16)
    p.add_argument("--synthetic-dir", default=None, help="where caches and staging go (default /dev/shm)")
    args = p.parse_args()
    args.ratios = [float(x) for x in args.ratios.split(",")]
    os.makedirs(BENCH_DIR, exist_ok=True)
    result = measure(args)
    print()
    print(report(result))
    m = result["machine"]
    print(
        f"\nmachine: {m['model']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}, obstore "
        f"{m['obstore']}, moto {m['moto']}; medians of {args.repeat}; {result['seconds_total']:.0f} s in all"
    )
    path = os.path.join(BENCH_DIR, f"producer-remote-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as handle:
        json.dump(result, handle, indent=2)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
