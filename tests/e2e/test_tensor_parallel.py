"""Targets split over several ranks (--tp-size / --ep-size) on gloo (CPU): a real torchrun job, and
ranks started with the environment torchrun gives them.

A model-parallel group computes every batch together and only its first rank writes; the cache
must be the one a single process writes. Groups own shards as ranks do without model
parallelism, and a rank that dies or freezes must end its group, never hang it.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

import dspark_cache
from dspark_cache.producer.device.model_group import check_target, target_problem
from dspark_cache.producer.device.topology import ParallelError, Topology, check_topology
from dspark_cache.format.paths import CachePaths
from dspark_cache.verify import verify_cache
from tests.support.produce import produce_args, run_produce, small_run
from tests.support.proc import (
    assert_same_samples,
    events,
    producer_cmd,
    published,
    run,
    run_ranks,
    start_ranks,
    torchrun,
    wait_for,
)

ARGS = small_run(2, 2)


def statuses(out: str) -> dict[int, dict]:
    paths = CachePaths(out)
    world = len(os.listdir(paths.status_dir))
    return {rank: json.load(open(paths.status(rank))) for rank in range(world)}


def publishers(out: str) -> dict[int, set[int]]:
    """Shards published, by the rank whose event log says so."""
    by_rank: dict[int, set[int]] = {}
    for e in events(out):
        if e["kind"] == "shard_published":
            by_rank.setdefault(e["rank"], set()).add(e["data"]["shard"])
    return by_rank


def build_moe_target(out_dir: str) -> str:
    """A random Qwen3-MoE (4 experts, 2 per token) with the embedded target's tokenizer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from dspark_cache.embedded.target import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32768, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.mark.slow
def test_two_ranks_one_group_equal_one_process(embedded, tmp_path, reference):
    """Three shards in flight: the partner follows the writer's schedule batch for batch."""
    out = str(tmp_path / "cache")
    proc = run(torchrun(2, *produce_args(embedded.stock, embedded.data, out, *ARGS, "--tp-size", "2",
                                         "--writer-threads", "3")))
    assert proc.returncode == 0, proc.stderr
    assert_same_samples(out, reference, exact=False)  # ids and masks exact, states to fp32 rounding
    assert verify_cache(out).ok
    # lm_head was sharded over the group: gathered, it is the single process's byte for byte.
    weights = CachePaths(out).target_weights, CachePaths(reference).target_weights
    assert open(weights[0], "rb").read() == open(weights[1], "rb").read()
    ranks, whole = statuses(out), statuses(reference)[0]["weight_bytes"]
    assert [(r["group"], r["group_size"], r["state"]) for r in ranks.values()] == [(0, 2, "finished")] * 2
    for r in ranks.values():  # each rank loaded its half of the weights, never the whole model
        assert 0.45 * whole < r["weight_bytes"] < 0.55 * whole
    assert ranks[1]["bytes_written"] == 0 and ranks[1]["shards_done"] == ranks[0]["shards_done"] > 0
    assert set(publishers(out)) == {0}  # the writer published every shard, its partner none


@pytest.fixture(scope="module")
def two_groups(embedded, tmp_path_factory) -> str:
    """A cache written by 4 ranks in 2 model-parallel groups of 2 (started as torchrun starts them;
    the 2-rank test above runs under torchrun itself)."""
    out = str(tmp_path_factory.mktemp("two-groups") / "cache")
    run_ranks(producer_cmd(*produce_args(embedded.stock, embedded.data, out, *ARGS, "--tp-size", "2")), 4)
    return out


@pytest.mark.slow
def test_four_ranks_two_groups_equal_one_process(two_groups, reference):
    out = two_groups
    assert_same_samples(out, reference, exact=False)
    assert verify_cache(out).ok
    assert {r: s["group"] for r, s in statuses(out).items()} == {0: 0, 1: 0, 2: 1, 3: 1}
    by_rank = publishers(out)
    assert set(by_rank) == {0, 2}  # one writer per group, each with its own shards
    shards = set(range(len(dspark_cache.open_cache(out).shards)))
    assert not by_rank[0] & by_rank[2] and by_rank[0] | by_rank[2] == shards
    claims = [n for n in os.listdir(CachePaths(out).control_dir) if CachePaths.is_completion_claim(n)]
    assert len(claims) == 1


@pytest.mark.slow
@pytest.mark.anyio
async def test_the_monitor_shows_groups_and_writers(two_groups):
    from dspark_cache.tui.app import MonitorApp

    app = MonitorApp(two_groups, refresh=3600)
    async with app.run_test(size=(140, 60)):
        await app.first_snapshot()
        table = app.query_one("#ranks")
        labels = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
    assert labels == ["0 g0 w", "1 g0", "2 g1 w", "3 g1"]


@pytest.mark.slow
def test_moe_expert_parallel_equals_one_process(embedded, tmp_path):
    target = build_moe_target(str(tmp_path / "moe"))
    ref, out = str(tmp_path / "ref"), str(tmp_path / "cache")
    assert run_produce(target, embedded.data, ref, *ARGS) == 0
    run_ranks(producer_cmd(*produce_args(target, embedded.data, out, *ARGS, "--ep-size", "2")), 2)
    assert_same_samples(out, ref, exact=False)
    whole = statuses(ref)[0]["weight_bytes"]
    for r in statuses(out).values():  # two of the four experts (and half the attention) per rank
        assert r["group_size"] == 2 and 0.45 * whole < r["weight_bytes"] < 0.55 * whole




@pytest.mark.slow
def test_sigkill_of_a_partner_ends_its_group_and_a_rerun_completes(embedded, tmp_path, reference):
    out = str(tmp_path / "cache")
    ranks = start_ranks(
        producer_cmd(*produce_args(embedded.stock, embedded.data, out, *ARGS, "--tp-size", "2")), 4
    )
    wait_for(lambda: published(out) >= 2)
    os.kill(ranks[1].pid, signal.SIGKILL)  # the partner of group 0's writer
    _, err0 = ranks[0].communicate(timeout=120)
    assert ranks[0].returncode == 1, err0
    assert "rank 1 of model-parallel group 0" in err0 and "rerun" in err0
    # Group 1 finishes its own shards, then names group 0's as missing (and nobody waits for a waiting rank).
    for r in (2, 3):
        _, err = ranks[r].communicate(timeout=120)
        assert ranks[r].returncode == 4, err
    ranks[1].wait()
    assert statuses(out)[0]["state"] == "failed"
    report = verify_cache(out)
    assert report.missing and not report.corrupt
    assert publishers(out).get(2)  # the other group published while group 0 was gone
    done = run(producer_cmd(*produce_args(embedded.stock, embedded.data, out, *ARGS)))
    assert done.returncode == 0, done.stderr
    assert_same_samples(out, reference, exact=False)
    assert dspark_cache.open_cache(out).manifest.complete


@pytest.mark.slow
def test_a_frozen_partner_does_not_hang_its_writer(embedded, tmp_path):
    """A stopped (SIGSTOP) partner leaves gloo's sockets open, as a hung NCCL peer would: the
    writer sits in a collective, and only the heartbeat watch can end it."""
    out = str(tmp_path / "cache")
    args = (*ARGS, "--tp-size", "2", "--rank-timeout", "3")
    cmd = producer_cmd(*produce_args(embedded.stock, embedded.data, out, *args))
    ranks = start_ranks(cmd, 2)
    try:
        wait_for(lambda: published(out) >= 1)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        _, err0 = ranks[0].communicate(timeout=120)
    finally:
        os.kill(ranks[1].pid, signal.SIGKILL)
        ranks[1].wait()
    assert ranks[0].returncode == 1
    assert "rank 1 of model-parallel group 0" in err0 and "silent" in err0
    status = statuses(out)[0]
    assert status["state"] == "failed" and "silent" in status["last_error"]
    report = verify_cache(out)
    assert report.missing and not report.corrupt


@pytest.mark.slow
def test_sigterm_to_a_partner_stops_its_group_at_a_shard_boundary(embedded, tmp_path):
    """The partner asks to stop; the writer, which got no signal, stops with it after the shards in flight."""
    out = str(tmp_path / "cache")
    ranks = start_ranks(
        producer_cmd(
            *produce_args(
                embedded.stock, embedded.data, out, *ARGS, "--tp-size", "2", "--writer-threads", "2"
            )
        ),
        2,
    )
    wait_for(lambda: published(out) >= 1)
    os.kill(ranks[1].pid, signal.SIGTERM)
    for proc in ranks:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 3, err  # stopped: rerun to resume
    assert [s["state"] for s in statuses(out).values()] == ["stopped", "stopped"]
    report = verify_cache(out)
    assert report.missing and not report.corrupt and not report.complete
    assert not [n for n in os.listdir(CachePaths(out).shards_dir) if n.endswith(".partial")]


@pytest.mark.slow
def test_device_map_auto_is_one_process_on_cpu(embedded, tmp_path, reference):
    out = str(tmp_path / "cache")
    assert run_produce(embedded.stock, embedded.data, out, *ARGS, "--device-map", "auto") == 0
    assert_same_samples(out, reference)  # CPU is one device: the same model, the same numbers


def test_a_target_without_a_tp_plan_is_refused_before_planning(embedded, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    target = str(tmp_path / "gpt2")
    config = GPT2Config(n_layer=8, n_embd=64, n_head=4, vocab_size=2048, bos_token_id=None, eos_token_id=None)
    GPT2LMHeadModel(config).save_pretrained(target)  # a whole checkpoint: only its missing TP plan is wrong
    out = str(tmp_path / "cache")
    # refused before meeting rank 1
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    proc = run(producer_cmd(*produce_args(target, embedded.data, out, *ARGS, "--tp-size", "2")), env=env)
    assert proc.returncode == 1
    line, = proc.stderr.strip().splitlines()
    assert "gpt2 has no tensor-parallel plan" in line and "--device-map auto" in line
    assert not os.path.exists(CachePaths(out).plan_dir)  # refused before any input was read


def test_usage_errors_name_the_launch():
    proc = run(
        producer_cmd("--target-model", "t", "--input-data", "d", "--output-dir", "o", "--tp-size", "2")
    )
    assert proc.returncode == 2
    line, = proc.stderr.strip().splitlines()
    assert "--tp-size" in line and "torchrun --nproc_per_node 2" in line
    proc = run(
        producer_cmd("--target-model", "t", "--input-data", "d", "--output-dir", "o", "--ep-size", "3"),
        env={"WORLD_SIZE": "4"},
    )
    assert proc.returncode == 2 and "not whole model-parallel groups of 3" in proc.stderr


def test_topologies(monkeypatch):
    for name, value in (("RANK", "5"), ("WORLD_SIZE", "8"), ("LOCAL_WORLD_SIZE", "8")):
        monkeypatch.setenv(name, value)
    topology = Topology.from_environment(tp_size=2)
    assert topology == Topology(rank=5, world_size=8, local_world_size=8, tp_size=2)
    check_topology(topology)
    assert (
        topology.groups,
        topology.group,
        topology.writer,
        topology.group_ranks(),
        topology.partners(),
    ) == (4, 2, False, [4, 5], [4])
    experts = Topology(rank=0, world_size=4, local_world_size=4, ep_size=4)
    check_topology(experts)
    assert experts.group_size == 4  # experts and attention over 4 ranks
    for (tp, ep, device_map), world, local, words in [
        ((2, 4, None), 4, 4, "--ep-size must equal --tp-size"),
        ((3, 1, None), 4, 4, "not whole model-parallel groups of 3"),
        ((2, 1, "auto"), 2, 2, "does not combine"),
        ((1, 1, "auto"), 2, 2, "--nproc_per_node 1"),
        ((0, 1, None), 1, 1, "must be >= 1"),
    ]:
        with pytest.raises(ParallelError, match=words):
            check_topology(Topology(0, world, local, tp, ep), device_map=device_map)
    spread = Topology(rank=1, world_size=2, local_world_size=1)
    check_topology(spread, device_map="auto")
    assert spread.group_size == 1  # one rank per node, each node's GPUs


def test_targets_that_cannot_be_split_are_named_from_their_config(embedded):
    from transformers import Qwen3Config, Qwen3MoeConfig

    dense = Qwen3Config(num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    assert "6 attention heads do not divide over 4" in target_problem(dense, 4, 1)
    assert "2 key/value heads do not divide over 3" in target_problem(
        Qwen3Config(num_attention_heads=6, num_key_value_heads=2), 3, 1
    )
    assert "no expert-parallel plan" in target_problem(dense, 2, 2)
    moe = Qwen3MoeConfig(num_attention_heads=8, num_key_value_heads=4, num_experts=6)
    assert "6 experts do not divide over --ep-size 4" in target_problem(moe, 4, 4)
    assert target_problem(moe, 2, 2) is None and target_problem(dense, 2, 1) is None
    with pytest.raises(ParallelError, match="2 key/value heads do not divide over 4"):
        check_target(embedded.stock, Topology(0, 4, tp_size=4))  # the embedded target: 4 heads, 2 KV heads
