"""Regenerate benchmark: dspark-regenerate against a real ``transformers serve`` on this machine.

    python bench/regenerate.py                      # 64 prompts, 64 tokens each, 3 repetitions
    python bench/regenerate.py --rows 32 --repeat 1 # quicker

The embedded tiny target is served by ``transformers serve`` (CPU, offline, as the tests do) and
``--rows`` prompts of the sample data (one user turn each, so every row is one request) are
regenerated greedily, ``--max-tokens`` each, by the real client (``run_regenerate``, in this process,
so its CPU time is the client's alone: the server is another process) at ``--concurrency`` 1, 4 and
16, interleaved with a plain load loop: 16 threads posting the same request bodies over keep-alive
``http.client`` connections and reading the answers, nothing else. Per run: rows/s, generated
tokens/s and the client's CPU seconds per request; medians of --repeat. The ratio of the client at
16 to the plain loop says whether the client is the bottleneck. Raw results in .bench/regenerate.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import queue
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.support.serving import Server  # noqa: E402  (the tests' server, started the same way)


def prompts(data: str, rows: int, out: str) -> list[dict]:
    """The first user turn (and a system turn before it) of the first ``rows`` sample rows, as a JSONL input."""
    from dspark_cache.producer import normalise_row

    picked = []
    with open(data) as handle:
        for line in handle:
            messages, _ = normalise_row(json.loads(line))
            first = next(i for i, m in enumerate(messages) if m["role"] == "user")
            picked.append({"messages": messages[: first + 1]})
            if len(picked) == rows:
                break
    with open(out, "w") as handle:
        for row in picked:
            handle.write(json.dumps(row) + "\n")
    return picked


def run_client(endpoint: str, data: str, out: str, concurrency: int, max_tokens: int) -> dict:
    from dspark_cache.producer import set_progress
    from dspark_cache.regenerate.run import run_regenerate
    from dspark_cache.regenerate.settings import RegenerateConfig

    set_progress(False)
    cfg = RegenerateConfig(input_data=data, output=out, endpoint=[endpoint], concurrency=concurrency,
                           max_tokens=max_tokens, temperature=0.0, overwrite=True)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    result = run_regenerate(cfg)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    assert result.written and not result.failed, result
    return {"rows": result.written, "tokens": result.tokens, "wall_s": wall, "client_cpu_s": cpu,
            "rows_per_s": result.written / wall, "tokens_per_s": result.tokens / wall,
            "cpu_ms_per_request": 1000 * cpu / result.written}


def run_plain(port: int, model: str, rows: list[dict], concurrency: int, max_tokens: int) -> dict:
    """The server alone: ``concurrency`` threads posting the same bodies as fast as answers come."""
    from dspark_cache.regenerate.settings import row_seed

    bodies: queue.Queue[bytes] = queue.Queue()
    for i, row in enumerate(rows):
        bodies.put(json.dumps({"model": model, "messages": row["messages"], "temperature": 0.0, "top_p": 1.0,
                               "max_tokens": max_tokens, "seed": row_seed(0, i)}).encode())
    tokens = [0] * concurrency

    def loop(slot: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        while True:
            try:
                body = bodies.get_nowait()
            except queue.Empty:
                break
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            answer = json.loads(resp.read())
            assert resp.status == 200, answer
            tokens[slot] += answer["usage"]["completion_tokens"]
        conn.close()

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
    wall0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - wall0
    return {"rows": len(rows), "tokens": sum(tokens), "wall_s": wall, "rows_per_s": len(rows) / wall,
            "tokens_per_s": sum(tokens) / wall}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--workdir", default=os.path.join(ROOT, ".bench", "regenerate"))
    parser.add_argument("--continuous-batching", action="store_true",
                        help="serve with transformers serve --continuous-batching (default: its plain mode)")
    args = parser.parse_args()
    from dspark_cache.demo import ensure_embedded

    os.makedirs(args.workdir, exist_ok=True)
    target, data = ensure_embedded(args.workdir)
    rows = prompts(data, args.rows, os.path.join(args.workdir, "prompts.jsonl"))
    results: dict[str, list[dict]] = {}
    extra = ("--continuous-batching",) if args.continuous_batching else ()
    with Server(target, os.path.join(args.workdir, "serve.log"), extra=extra) as server:
        # One unmeasured pass: the server's first requests warm its caches.
        run_plain(server.port, server.model, rows[:8], 4, args.max_tokens)
        for rep in range(args.repeat):
            for c in args.concurrency:
                r = run_client(server.url, os.path.join(args.workdir, "prompts.jsonl"),
                               os.path.join(args.workdir, f"out-{c}.jsonl"), c, args.max_tokens)
                results.setdefault(f"client c={c}", []).append(r)
                print(f"rep {rep} client c={c}: {r['rows_per_s']:.2f} rows/s, {r['tokens_per_s']:.0f} tok/s, "
                      f"{r['cpu_ms_per_request']:.2f} client CPU ms/request", flush=True)
            r = run_plain(server.port, server.model, rows, 16, args.max_tokens)
            results.setdefault("plain c=16", []).append(r)
            print(
                f"rep {rep} plain loop c=16: {r['rows_per_s']:.2f} rows/s, {r['tokens_per_s']:.0f} tok/s",
                flush=True,
            )
    print(
        f"\nmachine: {platform.platform()}, {os.cpu_count()} CPUs; transformers serve {' '.join(extra) or '(plain)'}; "
        f"{args.rows} prompts x {args.max_tokens} tokens, medians of {args.repeat}"
    )
    med = {
        name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()
    }
    for name, m in med.items():
        cpu = f", client {m['cpu_ms_per_request']:.2f} CPU ms/request" if "cpu_ms_per_request" in m else ""
        print(f"{name:>14}: {m['rows_per_s']:.2f} rows/s, {m['tokens_per_s']:.0f} generated tok/s{cpu}")
    outputs = {c: open(os.path.join(args.workdir, f"out-{c}.jsonl"), "rb").read() for c in args.concurrency}
    same = len(set(outputs.values())) == 1
    print(
        f"outputs at concurrency {', '.join(map(str, args.concurrency))}: {'identical' if same else 'DIFFER'} bytes"
    )
    if "client c=16" in med:
        print(
            f"client c=16 / plain loop c=16: {med['client c=16']['tokens_per_s'] / med['plain c=16']['tokens_per_s']:.3f}"
            " (tokens/s)"
        )
    name = "regenerate-cb.json" if args.continuous_batching else "regenerate.json"
    with open(os.path.join(os.path.dirname(args.workdir), name), "w") as handle:
        json.dump(
            {"args": vars(args), "runs": results, "medians": med, "outputs_identical": same}, handle, indent=1
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
