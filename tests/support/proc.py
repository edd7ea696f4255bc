"""Helpers to run the real console scripts as subprocesses (killed, signalled, under torchrun)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import torch

import dspark_cache
from dspark_cache.format.paths import CachePaths
from tests.support.ports import free_port
from tests.support.processes import alive, descendants
from tests.support.warm import BIN, WarmProcess, popen


def producer_cmd(*args: str) -> list[str]:
    return [os.path.join(BIN, "dspark-produce"), *args]


def torchrun(nproc: int, *args: str) -> list[str]:
    """The producer's torchrun entry as ``nproc`` local ranks (gloo on CPU)."""
    return [os.path.join(BIN, "torchrun"), "--standalone", f"--nproc_per_node={nproc}", "-m",
            "dspark_cache.producer", *args]


def start_ranks(cmd: list[str], world: int, env: dict | None = None,
                rank_env: dict[int, dict] | None = None) -> list[subprocess.Popen | WarmProcess]:
    """``world`` ranks of ``cmd`` started by hand, with the environment torchrun gives its ranks (forked warm,
    and with no agent, which would kill the others when one dies), ``env`` for all and ``rank_env[r]`` for
    rank ``r``. The tests of torchrun itself run it."""
    base = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", **(env or {})}
    return [start(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r), **(rank_env or {}).get(r, {})})
            for r in range(world)]


def run_ranks(cmd: list[str], world: int, env: dict | None = None, timeout: float = 300) -> None:
    """``world`` ranks of ``cmd`` (:func:`start_ranks`), each of which must succeed."""
    ranks = start_ranks(cmd, world, env)
    said = [r.communicate(timeout=timeout) for r in ranks]
    assert [r.returncode for r in ranks] == [0] * world, said


def start(cmd: list[str], env: dict | None = None, code: bool = False) -> subprocess.Popen | WarmProcess:
    """``cmd`` in a session of its own, its output piped: our console scripts (and, when ``code``,
    ``python -c``) forked warm (:mod:`tests.support.warm`)."""
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return popen(cmd, full_env, code=code, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 start_new_session=True)


def kill_group(proc: subprocess.Popen | WarmProcess) -> None:
    """SIGKILL ``proc``'s process group (it leads a session of its own) and wait until no process of
    it is left: a rerun started at once must not find a dying rank or worker still holding the lock."""
    tree = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it had ended, or was started a moment ago and does not lead its group yet
        if proc.poll() is None:  # not reaped: the pid is still its own
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()
    wait_for(lambda: not alive(tree), timeout=60)


def run(cmd: list[str], env: dict | None = None, timeout: float = 300,
        code: bool = False) -> subprocess.CompletedProcess:
    proc = start(cmd, env, code)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def events(cache_dir: str) -> list[dict]:
    out = []
    directory = CachePaths(cache_dir).events_dir
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        with open(os.path.join(directory, name)) as handle:
            for line in handle:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by SIGKILL
                    pass
    return out


def wait_for(predicate, timeout: float = 120, poll: float = 0.05) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(poll)


def published(cache_dir: str) -> int:
    return sum(1 for e in events(cache_dir) if e["kind"] == "shard_published")


def assert_same_samples(
    a_dir, b_dir, exact: bool = True, tolerance: tuple[float, float] = (1e-4, 1e-5)
) -> int:
    """Every sample of cache ``a`` equals ``b``'s (ids, masks, hidden states), none missing or extra; each a
    path or an opened cache. Not ``exact``: the states within ``tolerance`` (rtol, atol)."""
    a = dspark_cache.open_cache(a_dir) if isinstance(a_dir, str) else a_dir
    b = dspark_cache.open_cache(b_dir) if isinstance(b_dir, str) else b_dir
    assert a.manifest.identity() == b.manifest.identity()
    n = 0
    for x, y in zip(a.samples(), b.samples(), strict=True):
        assert x["sample_id"] == y["sample_id"]
        for key in ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"):
            if exact or key in ("input_ids", "loss_mask"):
                assert torch.equal(x[key], y[key]), (x["sample_id"], key)
            else:
                torch.testing.assert_close(x[key], y[key], rtol=tolerance[0], atol=tolerance[1])
        n += 1
    return n
