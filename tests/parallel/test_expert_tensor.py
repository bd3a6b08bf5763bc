"""Expert parallelism beside tensor parallelism (parallel.expert=2 x parallel.tensor=2 on 4 gloo
processes; with parallel.pipeline=2 too on 8), every layout equal to one process on the same global
batch: loss, eval loss, every gradient, the gradient norm, the router's aux and z-loss, an AdamW and
an AdamWSR step (tests/parallel/worker.py), with sequence parallelism and without, with gradient
accumulation, and with LoRA on the experts; checkpoints saved under EP2 x TP2 load bit for bit on
one process, under TP alone and under expert parallelism alone, and back. One launch for all of
them.

Each expert lives on one rank of its ep group (the data-parallel ranks of one tensor-parallel
coordinate) and its intermediate rows are split over the tensor-parallel ranks: a rank holds a
quarter of the expert weights.
"""

from __future__ import annotations

import pytest

from tests.conftest import expert_placements
from tests.parallel.test_expert_layouts import _expert_bytes
from tests.parallel.test_parallel import _check, _launch, check_reshard

ROUTER = {"router_z_loss_coef": 0.01, "router_aux_loss_coef": 0.1}
EP_TP = {"expert": 2, "tensor": 2}
PLAIN = {**EP_TP, "sequence_parallel": False, "loss_parallel": False}
# attention, router, experts (gate_up at rank 8)
ALL = {"rank": 4, "alpha": 8.0, "targets": "all-linear"}
EXPERTS = {"rank": 2, "alpha": 4.0, "targets": "experts"}

FOUR = {
    # Sequence parallel: the MoE input gathered over the tensor ranks, routed once per
    # tensor-parallel group, rows exchanged among the ranks of one tensor coordinate, the combine
    # reduce-scattered. Its checkpoint loads under tensor parallelism alone (FSDP2 over 2 x TP 2,
    # every expert on both data ranks) and back.
    "ep2_tp2_sp_mixtral": {
        "model": "tiny-mixtral",
        "parallel": EP_TP,
        "model_overrides": {"router_aux_loss_coef": 0.5},
        "reshard": {"parallel": {"tensor": 2}},
    },
    # Without sequence parallelism (one all-reduce after the combine), z-loss on; loads at expert=4,
    # no TP.
    "ep2_tp2_qwen3_moe_plain": {
        "model": "tiny-qwen3-moe",
        "parallel": PLAIN,
        "model_overrides": ROUTER,
        "reshard": {"parallel": {"expert": 4}},
    },
    # Two micro-batches: the experts' gradients kept from the first, reduced with the last's.
    "ep2_tp2_sp_qwen3_moe_accumulate": {
        "model": "tiny-qwen3-moe",
        "parallel": EP_TP,
        "accumulate": 2,
        "model_overrides": ROUTER,
    },
    # LoRA: each expert's factors with it (split by expert), gate_up's B and down's A on the
    # intermediate rows, gate_up's A and down's B whole on every tensor rank (their gradients summed
    # over the tensor ranks).
    "ep2_tp2_sp_mixtral_lora": {"model": "tiny-mixtral", "parallel": EP_TP, "lora": ALL},
    "ep2_tp2_qwen3_moe_lora_plain": {
        "model": "tiny-qwen3-moe",
        "parallel": PLAIN,
        "lora": EXPERTS,
        "accumulate": 2,
    },
}


# Expert x tensor x pipeline, its smallest layout: 2 stages of 4 ranks, each stage's 2 data ranks an
# ep group per tensor coordinate. Mixtral (a layer per stage) with the router losses; Qwen3-MoE's
# experts with LoRA.
EIGHT = {
    "ep2_tp2_pp2_sp_mixtral": {
        "model": "tiny-mixtral",
        "parallel": {**EP_TP, "pipeline": 2},
        "model_overrides": ROUTER,
    },
    "ep2_tp2_pp2_qwen3_moe_lora_plain": {
        "model": "tiny-qwen3-moe",
        "parallel": {**PLAIN, "pipeline": 2},
        "lora": EXPERTS,
    },
}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _launch(4, FOUR, tmp_path_factory.mktemp("ep_tp"))


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return _launch(8, EIGHT, tmp_path_factory.mktemp("ep_tp_pp"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(FOUR))
def test_expert_x_tensor_parallel_equals_one_process(four, layout):
    r = four[layout]
    _check(r)
    assert r["router_losses"] == pytest.approx(r["ref_router_losses"], rel=1e-5)  # aux and z-loss


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name, case in FOUR.items() if "lora" not in case])
def test_each_rank_holds_a_quarter_of_the_experts(four, layout):
    """The most expert-weight (and gradient) bytes any rank holds: half the experts (expert=2),
    half of each one's intermediate rows (tensor=2)."""
    r = four[layout]
    assert r["expert_bytes"] == _expert_bytes(FOUR[layout]) / 4
    assert r["expert_grad_bytes"] == r["expert_bytes"]


@pytest.mark.slow
def test_expert_adapters_are_split_by_expert_and_rows(four):
    """On ("ep_replicate", "ep", "tp", "ep_shard"): split by expert over "ep"; over "tp" on the
    intermediate rows where the factor has them (gate_up's B, down's A), whole on both tensor
    ranks where not."""
    for layout in ("ep2_tp2_sp_mixtral_lora", "ep2_tp2_qwen3_moe_lora_plain"):
        experts = {
            n.split("layers.0.", 1)[1]: p
            for n, p in four[layout]["lora_layout"].items()
            if n.startswith("layers.0.mlp.experts.")
        }
        want = {
            "mlp.experts.lora_A.gate_up": "RS(0)RR",
            "mlp.experts.lora_B.gate_up": "RS(0)S(2)R",
            "mlp.experts.lora_A.down": "RS(0)S(2)R",
            "mlp.experts.lora_B.down": "RS(0)RR",
        }
        assert experts == {n: expert_placements(p) for n, p in want.items()}, layout


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name, case in FOUR.items() if "reshard" in case])
def test_checkpoints_reshard_to_and_from_expert_x_tensor(four, layout):
    check_reshard(four[layout])


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(EIGHT))
def test_expert_x_tensor_x_pipeline_equals_one_process(eight, layout):
    """8 gloo processes: each pipeline stage's experts split over its ep groups and their rows
    over its tensor ranks, the router losses summed over the stages; loss, gradients,
    AdamW/AdamWSR steps and router losses equal one process's."""
    r = eight[layout]
    _check(r)
    assert r["router_losses"] == pytest.approx(r["ref_router_losses"], rel=1e-5)
