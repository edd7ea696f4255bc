"""Runs ``dspark-convert`` jobs in one process under an address-space limit; the test watches it.

Usage: ``python -m tests.support.convert_worker JOBS.json``, a list of ``{"name", "argv"}``. For each job it
prints ``{"start": name}``, runs the CLI's ``main(argv)`` in this process (an import of torch per
job would cost seconds) and prints ``{"name", "code", "stderr"}``, or ``{"name", "escaped": ...}``
when an exception got out of ``main`` (a defect: the CLI turns every failure into a message). A
hang or a crash is pinned on the job whose ``start`` has no result; :func:`run_jobs` does that.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import traceback

from tests.support.fuzz_worker import MEMORY_LIMIT
from tests.support import warm


def run_job(argv: list[str]) -> dict:
    """One conversion: its exit code and stderr, or what escaped."""
    from tests.support.scripts import convert as main

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    except BaseException as exc:  # MemoryError and RecursionError included: each is a finding
        return {"escaped": f"{type(exc).__name__}: {exc} | {traceback.format_exc(limit=4)[-600:]}",
                "stderr": err.getvalue()}
    return {"code": code, "stderr": err.getvalue()}


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_jobs(jobs: list[dict], workdir: str, timeout: float) -> dict[str, dict]:
    """Run ``jobs`` in a worker; a job that hung or killed the worker gets ``{"escaped": why}``."""
    spec = os.path.join(workdir, "jobs.json")
    with open(spec, "w") as handle:
        json.dump(jobs, handle)
    cmd = [sys.executable, "-m", "tests.support.convert_worker", spec]
    try:
        done = warm.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=os.getcwd())
        stdout, why = done.stdout, f"worker exit {done.returncode}: {done.stderr[-1500:]}"
    except subprocess.TimeoutExpired as exc:
        stdout, why = (exc.stdout or b"").decode(), f"timed out after {timeout} s (a hang)"
    results: dict[str, dict] = {}
    for line in stdout.splitlines():
        if line.startswith("{") and "name" in (record := json.loads(line)):
            results[record.pop("name")] = record
    out, blamed = {}, False
    for job in jobs:
        if job["name"] in results:
            out[job["name"]] = results[job["name"]]
        else:  # the first job without a result hung or killed the worker; the rest never ran
            out[job["name"]] = {"escaped": "not run: an earlier job hung or crashed" if blamed else why}
            blamed = True
    return out


def main(spec: str) -> None:
    limit_memory()
    with open(spec) as handle:
        jobs = json.load(handle)
    for job in jobs:
        print(json.dumps({"start": job["name"]}), flush=True)
        print(json.dumps({"name": job["name"], **run_job(job["argv"])}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
