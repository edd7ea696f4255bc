"""A real OpenAI-compatible server for the tests: ``transformers serve`` on 127.0.0.1, on CPU, offline,
serving a local checkpoint (the embedded target), and the checkpoint variant the tests serve.

Start-up takes seconds to tens of seconds (torch, transformers and the model load), so a test module
starts one and shares it (``Server`` is a context manager; :meth:`Server.kill` and :meth:`Server.start`
let a test take it down and bring it back on the same port).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from tests.support.ports import free_port

BIN = os.path.dirname(sys.executable)
START_TIMEOUT_S = 180.0
# The token the stopping variant also ends a turn on: one the random tiny target emits often, so
# that greedy answers end early ("stop") for some prompts and run to --max-tokens ("length") for others.
STOP_WORD = " kavi"


def stopping_target(target: str, out: str) -> str:
    """A copy of ``target`` whose generation config also ends a turn on :data:`STOP_WORD`'s token."""
    from transformers import AutoTokenizer

    shutil.copytree(target, out)
    ids = AutoTokenizer.from_pretrained(out).encode(STOP_WORD)
    assert len(ids) == 1, f"{STOP_WORD!r} is not one token of the embedded tokenizer: {ids}"
    path = os.path.join(out, "generation_config.json")
    with open(path) as handle:
        config = json.load(handle)
    config["eos_token_id"] = [config["eos_token_id"], ids[0]]
    with open(path, "w") as handle:
        json.dump(config, handle)
    return out


class Server:
    """``transformers serve MODEL`` on 127.0.0.1:``port``; its log in ``log_path``."""

    def __init__(self, model: str, log_path: str, port: int | None = None, extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.model = model  # a local checkpoint, or a hub id that ``env``'s HF_HUB_CACHE holds
        self.extra = extra  # more `transformers serve` options, e.g. --continuous-batching
        self.env = env or {}
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false", **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    os.path.join(BIN, "transformers"),
                    "serve",
                    self.model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--device",
                    "cpu",
                    *self.extra,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"transformers serve exited with {self.proc.returncode}; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(
            f"transformers serve did not answer within {START_TIMEOUT_S:g} s; see {self.log_path}"
        )

    def kill(self) -> None:
        """SIGKILL the server (the whole session it leads) and wait for it: the port stops answering."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        """A direct chat completion (what the tests compare ``dspark-regenerate``'s rows with)."""
        body = json.dumps({"model": self.model, "messages": messages, **params}).encode()
        request = urllib.request.Request(f"{self.url}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as resp:
            return json.load(resp)
