"""``make demo-regenerate``: serve the embedded target with ``transformers serve`` (CPU, offline), regenerate
a slice of the sample data through it with ``dspark-regenerate``, then run ``dspark-produce`` on the result.

Each step is the real command in a process of its own, printed before it runs; the server is stopped
before the producer starts (both would compete for the same cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from dspark_cache.cli.conventions import command_hint
from dspark_cache.demo import ensure_embedded
from dspark_cache.format.paths import CachePaths

START_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _step(cmd: list[str], env: dict[str, str] | None = None) -> int:
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    return subprocess.call(cmd, env=env)


def serve(target: str, port: int, log_path: str) -> subprocess.Popen:
    """``transformers serve`` for ``target`` on 127.0.0.1:``port``, once it answers ``/v1/models``."""
    server = os.path.join(os.path.dirname(sys.executable), "transformers")
    cmd = [server, "serve", target, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    print("$ " + " ".join(shlex.quote(c) for c in cmd) + f"   (log: {log_path})", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"transformers serve exited ({proc.returncode}); see {log_path} (is the serving extra "
                "installed? pip install 'transformers[serving]')"
            )
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as resp:
                print(f"serving {json.load(resp)['data'][0]['id']}", flush=True)
                return proc
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"transformers serve did not answer within {START_TIMEOUT_S:g} s; see {log_path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Regenerate the embedded sample data with the embedded target, "
        "then produce a cache from it."
    )
    parser.add_argument("--workdir", default=".demo")
    parser.add_argument("--rows", type=int, default=96, help="rows of the sample data to regenerate")
    args, extra = parser.parse_known_args(argv)
    target, data = ensure_embedded(args.workdir)
    regenerated = os.path.join(args.workdir, "regenerated.jsonl")
    cache = os.path.join(args.workdir, "cache-regenerated")
    port = _free_port()
    server = serve(target, port, os.path.join(args.workdir, "serve.log"))
    try:
        code = _step(
            [
                *shlex.split(command_hint("dspark-regenerate")),
                "--input-data",
                data,
                "--split",
                f"train[:{args.rows}]",
                "--output",
                regenerated,
                "--endpoint",
                f"http://127.0.0.1:{port}",
                "--overwrite",
                "--concurrency",
                "8",
                "--max-tokens",
                "48",
                *extra,
            ]
        )
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait()
    if code != 0:
        return code
    code = _step(
        [
            *shlex.split(command_hint("dspark-produce")),
            "--target-model",
            target,
            "--input-data",
            regenerated,
            "--output-dir",
            cache,
            "--overwrite",
            "--seq-length",
            "2048",
            "--batch-size",
            "16",
            "--shard-size",
            "64",
        ]
    )
    if code == 0:
        with open(CachePaths(cache).manifest) as handle:
            print(f"the manifest records: regenerated = {json.load(handle)['regenerated']}")
    return code


if __name__ == "__main__":
    sys.exit(main())
