"""The analytic communication volume (lmforge.parallel.comm_volume) against the bytes gloo really
sends, read from /proc/self/io around one training step of 2 processes: data parallel (DDP, FSDP2),
tensor parallel with and without sequence parallelism, and pipeline parallel (1F1B, interleaved)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lmforge.models.presets import PRESETS
from lmforge.parallel.comm_volume import (
    Layout,
    bytes_sent,
    expert_bytes,
    stage_parameters,
    step_bytes,
)
from lmforge.parallel.mesh import fsdp_shards_experts
from tests.parallel.launch import torchrun

WORKER = Path(__file__).with_name("comm_worker.py")


@pytest.mark.slow
@pytest.mark.skipif(
    bytes_sent() is None, reason="needs Linux /proc/self/io to count the bytes sent"
)
@pytest.mark.parametrize("strategy,micro_batches", [("ddp", 2), ("fsdp", 2)])
def test_data_parallel_bytes_match_the_model(strategy, micro_batches, tmp_path):
    out = tmp_path / "sent.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[2])}
    r = torchrun(2, [str(WORKER), strategy, str(micro_batches), str(out)], env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in json.loads(out.read_text()):
        # Within 3%: FSDP pads shards to a multiple of the world size; the barriers add a few bytes.
        assert rank["sent"] == pytest.approx(rank["expected"], rel=0.03), rank


MESH_LAYOUTS = [
    {"tensor": 2, "pipeline": 1, "sequence_parallel": False, "micro_batches": 2},
    # gloo: all-gather (n-1)/n, reduce-scatter run as an all-reduce 2 (n-1)/n: 1.5x plain TP's
    # bytes.
    {"tensor": 2, "pipeline": 1, "sequence_parallel": True, "micro_batches": 2},
    # Two ranks, each at an end: one way per micro batch (2v - 1 = 1 send), interleaved 3 (v = 2).
    {"tensor": 1, "pipeline": 2, "sequence_parallel": False, "micro_batches": 4},
    {
        "tensor": 1,
        "pipeline": 2,
        "sequence_parallel": False,
        "micro_batches": 4,
        "virtual_stages": 2,
    },
]


@pytest.mark.slow
@pytest.mark.skipif(
    bytes_sent() is None, reason="needs Linux /proc/self/io to count the bytes sent"
)
def test_tensor_and_pipeline_bytes_match_the_model(tmp_path):
    layouts, out = tmp_path / "layouts.json", tmp_path / "sent.json"
    layouts.write_text(json.dumps(MESH_LAYOUTS))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[2])}
    r = torchrun(2, [str(WORKER), "mesh", str(layouts), str(out)], env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in json.loads(out.read_text()):
        assert [r["layout"] for r in rank] == MESH_LAYOUTS
        for result in rank:
            # Within 2%: gloo frames each collective and point-to-point message with a few hundred
            # bytes.
            assert result["sent"] == pytest.approx(result["expected"], rel=0.02), result


@pytest.mark.slow
@pytest.mark.skipif(
    bytes_sent() is None, reason="needs Linux /proc/self/io to count the bytes sent"
)
def test_expert_parallel_bytes_match_the_model(tmp_path):
    """parallel.expert=2 on 4 ranks, two accumulation micro-batches: the all-to-alls send every
    row routed across ranks four times (out and back, forward and backward). Under DDP the two
    ranks holding the same experts all-reduce their gradients once; under FSDP2 they shard them:
    all-gathers per micro-batch, one reduce-scatter per step. Data parallelism reduces the other
    weights only."""
    out = tmp_path / "sent.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[2])}
    r = torchrun(4, [str(WORKER), "expert", str(out)], env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in json.loads(out.read_text()):
        ddp, fsdp = rank
        assert ddp["strategy"] == "ddp" and fsdp["strategy"] == "fsdp"
        for result in rank:
            assert result["all_to_all"] > 0.05 * result["sent"], result  # a real share of the bytes
            assert result["expert_grads"] > 0.1 * result["sent"], result
            assert result["sent"] == pytest.approx(result["expected"], rel=0.02), result
        # (before torch 2.12 FSDP2 cannot shard them: whole copies under both, all-reduced)
        assert ddp["expert_gathers"] == 0 < fsdp["expert_gathers"] or not fsdp_shards_experts()


@pytest.mark.slow
@pytest.mark.skipif(
    bytes_sent() is None, reason="needs Linux /proc/self/io to count the bytes sent"
)
def test_expert_x_tensor_parallel_bytes_match_the_model(tmp_path):
    """parallel.expert=2 x tensor=2 on 4 ranks, with sequence parallelism and without: each
    tensor-parallel rank exchanges the whole micro-batch's routed rows with the rank of its own
    tensor coordinate; the tensor-parallel exchanges are a dense model's plus the routing
    weights' gradient; FSDP2 reduces the other weights over the 2 data ranks (each expert on one:
    nothing else to reduce)."""
    out = tmp_path / "sent.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[2])}
    r = torchrun(4, [str(WORKER), "expert_tp", str(out)], env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in json.loads(out.read_text()):
        assert [result["sequence_parallel"] for result in rank] == [True, False]
        for result in rank:
            assert (
                result["all_to_all"] > 0.1 * result["sent"]
                and result["tensor"] > 0.1 * result["sent"]
            ), result
            assert result["sent"] == pytest.approx(result["expected"], rel=0.02), result


def test_balanced_expert_parallel_bytes(monkeypatch):
    import lmforge.parallel.comm_volume as comm_volume

    monkeypatch.setattr(comm_volume, "fsdp_shards_experts", lambda: True)  # torch 2.12+
    cfg = PRESETS["mixtral-8x7b"]  # 32 MoE layers, 8 experts, 2 per token, hidden 4096
    one = expert_bytes(cfg, expert=8, data=8, tokens=4096)
    # 4096 tokens x 2 experts, 7/8 of them to other ranks, out and back, forward and backward, bf16
    # rows.
    assert one["all_to_all"] == 32 * 4 * 4096 * 2 * 7 / 8 * 4096 * 2
    assert one["expert_grads"] == 0  # one rank per expert: nothing to all-reduce
    two = expert_bytes(cfg, expert=8, data=16, tokens=4096)
    # 2 (n-1)/n = 1 of one expert per layer, fp32
    assert two["expert_grads"] == 32 * 1 * 3 * 4096 * 14336 * 4
    # FSDP2: the expert sharded over the 2 ranks holding it; two micro-batches, each gathering it
    # twice (bf16).
    expert = 32 * 3 * 4096 * 14336
    fsdp = expert_bytes(cfg, expert=8, data=16, tokens=4096, micro_batches=2, data_parallel="fsdp")
    assert (
        fsdp["expert_gathers"] == 2 * 2 * expert / 2 * 2 and fsdp["expert_grads"] == expert / 2 * 4
    )
    # HSDP 2 x 8: the ep group spans a whole replica, so each expert is replicated over the two: an
    # all-reduce.
    hsdp = expert_bytes(cfg, expert=8, data=16, tokens=4096, data_parallel="fsdp", data_replicate=2)
    assert hsdp["expert_gathers"] == 0 and hsdp["expert_grads"] == two["expert_grads"]
    # Beside tensor parallelism 2: each rank still sends its micro-batch's rows, and holds (and
    # reduces) half of each of its experts' rows.
    tp = expert_bytes(
        cfg, expert=8, data=16, tokens=4096, micro_batches=2, data_parallel="fsdp", tensor=2
    )
    assert tp["all_to_all"] == fsdp["all_to_all"]
    assert (
        tp["expert_gathers"] == fsdp["expert_gathers"] / 2
        and tp["expert_grads"] == fsdp["expert_grads"] / 2
    )
    # Before torch 2.12 FSDP2 cannot shard them (lmforge.parallel.mesh.fsdp_shards_experts): whole
    # copies, DDP's bytes.
    monkeypatch.setattr(comm_volume, "fsdp_shards_experts", lambda: False)
    old = expert_bytes(cfg, expert=8, data=16, tokens=4096, micro_batches=2, data_parallel="fsdp")
    assert old["expert_gathers"] == 0 and old["expert_grads"] == two["expert_grads"]


def test_moe_blocks_count_their_experts():
    """The data-parallel bytes of a MoE model: its MLPs are routers plus experts (Mixtral-8x7B:
    46.7 B parameters, not a dense model's 7 B), and under expert parallelism the experts leave
    the data-parallel reduction for expert parallelism's own."""
    cfg = PRESETS["mixtral-8x7b"]
    blocks, ends = stage_parameters(cfg, Layout(data=8))
    assert 46.6e9 < blocks + ends < 46.8e9
    ep_blocks, _ = stage_parameters(cfg, Layout(data=8, expert=8))
    assert blocks - ep_blocks == 32 * 8 * 3 * 4096 * 14336
    dense = step_bytes(cfg, Layout(data=8), 4096, 64, 1)
    ep = step_bytes(cfg, Layout(data=8, expert=8), 4096, 64, 1)
    assert ep["data"] == pytest.approx(dense["data"] * (ep_blocks + ends) / (blocks + ends))
    assert ep["expert"] == sum(expert_bytes(cfg, 8, 8, 4096, 8).values()) > 0
    assert ep["total"] == pytest.approx(ep["data"] + ep["expert"])


def test_moe_layers_under_tensor_parallelism():
    """A MoE layer's tensor-parallel bytes: a dense layer's, plus the routing weights' gradient
    (all-reduced, fp32), and under sequence parallelism its input's gradient all-reduced where a
    dense layer reduce-scatters."""
    cfg = PRESETS["mixtral-8x7b"]
    sp, plain = (
        step_bytes(cfg, Layout(tensor=8, data=8, sequence_parallel=s), 4096, 64, 1)
        for s in (True, False)
    )
    micro_batches, act = 64 // 8, 4096 * 4096 * 2
    weights = micro_batches * 32 * 4096 * 2 * 4
    assert plain["payload_tensor"] == micro_batches * (4 * 32 + 2) * act + weights
    assert sp["tensor"] - plain["tensor"] == pytest.approx(7 / 8 * micro_batches * 32 * act)


def test_published_layouts():
    # GPT-NeoX-20B as the NeoX-on-Trainium write-up runs it: TP 8, PP 4, seq 2048, global batch
    # 1024.
    cfg = PRESETS["gpt-neox-20b"]
    small = step_bytes(cfg, Layout(tensor=8, pipeline=4, data=4), 2048, 1024, 1)
    large = step_bytes(cfg, Layout(tensor=8, pipeline=4, data=64), 2048, 1024, 1)
    # More replicas: each sees fewer micro batches, so TP and PP bytes per rank fall as 1/data while
    # the gradient all-reduce per rank stays about the same (2 (n-1)/n of the same shard).
    assert large["tensor"] == pytest.approx(small["tensor"] * 4 / 64)
    assert large["data"] == pytest.approx(small["data"] * (63 / 64) / (3 / 4))
    # TP x PP splits the 20.6 B parameters 32 ways: the busiest rank holds about 1/32 of them.
    blocks, ends = small["block_parameters"], small["end_parameters"]
    assert 20.0e9 / 32 < blocks + ends < 20.6e9 / 32 * 1.1
    # Sequence parallelism sends the same bytes as plain TP (all-gather + reduce-scatter =
    # all-reduce).
    no_sp = step_bytes(
        cfg, Layout(tensor=8, pipeline=4, data=4, sequence_parallel=False), 2048, 1024, 1
    )
    assert no_sp["tensor"] == small["tensor"] and no_sp["pipeline"] == small["pipeline"] * 8
