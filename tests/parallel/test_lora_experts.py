"""LoRA on the stacked experts under expert and tensor parallelism, on 2 gloo processes: loss,
every gradient (adapter factors gathered with full_tensor), the gradient norm and an AdamW step
equal one process's on the global batch (tests/parallel/worker.py), and each factor is laid out
like the weight it adapts."""

from __future__ import annotations

import pytest

from tests.conftest import expert_placements
from tests.parallel.test_parallel import _check, _launch

# attention, router, experts (gate_up at rank 8)
ALL = {"rank": 4, "alpha": 8.0, "targets": "all-linear"}
# rank 2: the rank GEMMs take the loop, not grouped_mm
EXPERTS = {"rank": 2, "alpha": 4.0, "targets": "experts"}

CASES = {
    # Every expert split on its intermediate rows: gate_up's B split with them and its A replicated
    # (gradient summed over the ranks), down's A split and its B replicated (likewise); the router's
    # adapters replicated.
    "tp_mixtral_lora_sp": {"model": "tiny-mixtral", "parallel": {"tensor": 2}, "lora": ALL},
    "tp_qwen3_moe_lora_plain": {
        "model": "tiny-qwen3-moe",
        "parallel": {"tensor": 2, "sequence_parallel": False, "loss_parallel": False},
        "lora": EXPERTS,
    },
    # Half the experts per rank, their factors with them (Shard(0) over "ep"), FSDP2 or DDP for the
    # rest.
    "ep_mixtral_lora_fsdp": {"model": "tiny-mixtral", "parallel": {"expert": 2}, "lora": ALL},
    "ep_qwen3_moe_lora_ddp": {
        "model": "tiny-qwen3-moe",
        "parallel": {"expert": 2, "data_replicate": 2, "data_shard": 1},
        "accumulate": 2,
        "lora": EXPERTS,
    },
}
FOUR = {
    # Two ranks hold each expert (HSDP 2 x 2): the factors' gradients summed over them, once, after
    # the second micro-batch; and tensor parallelism under FSDP2.
    "ep2_hsdp_mixtral_lora_accumulate": {
        "model": "tiny-mixtral",
        "accumulate": 2,
        "lora": ALL,
        "parallel": {"expert": 2, "data_replicate": 2, "data_shard": 2},
    },
    "fsdp_tp_qwen3_moe_lora": {
        "model": "tiny-qwen3-moe",
        "parallel": {"tensor": 2, "data_shard": 2},
        "lora": ALL,
    },
    # Two ranks hold each expert and FSDP2 shards the experts and their factors between them
    # (ep_shard 2).
    "ep2_fsdp4_qwen3_moe_lora": {
        "model": "tiny-qwen3-moe",
        "lora": ALL,
        "parallel": {"expert": 2, "data_shard": 4},
    },
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _launch(2, CASES, tmp_path_factory.mktemp("lora_experts"))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _launch(4, FOUR, tmp_path_factory.mktemp("lora_experts_four"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(CASES))
def test_expert_adapters_train_like_one_process(results, layout):
    _check(results[layout])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(FOUR))
def test_expert_adapters_train_like_one_process_on_four(four, layout):
    _check(four[layout])


@pytest.mark.slow
def test_expert_adapters_are_split_like_their_weights(results):
    tp = {
        n.split("layers.0.", 1)[1]: p
        for n, p in results["tp_mixtral_lora_sp"]["lora_layout"].items()
        if n.startswith("layers.0.mlp.")
    }
    assert tp == {
        "mlp.router.lora_A.router": "R",
        "mlp.router.lora_B.router": "R",
        "mlp.experts.lora_A.gate_up": "R",
        "mlp.experts.lora_B.gate_up": "S(2)",
        "mlp.experts.lora_A.down": "S(2)",
        "mlp.experts.lora_B.down": "R",
    }
    for layout in ("ep_mixtral_lora_fsdp", "ep_qwen3_moe_lora_ddp"):
        experts = {n: p for n, p in results[layout]["lora_layout"].items() if ".experts." in n}
        # ("ep_replicate", "ep", "ep_shard"): split by expert; FSDP2 shards them further where other
        # ranks hold the same experts (none here: 2 ranks, expert=2), so their placement stays
        # Replicate on "ep_shard"
        assert experts and set(experts.values()) == {expert_placements("RS(0)R")}, experts
