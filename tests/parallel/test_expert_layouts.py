"""Expert parallelism on 4 gloo processes, every layout equal to one process on the same global
batch (loss, eval loss, every gradient, the gradient norm, an AdamW and an AdamWSR step), as
tests/parallel/test_parallel.py checks the other layouts; one launch for all of them.

- FSDP2 (4 data ranks, parallel.expert=2): the two ranks holding the same experts shard them
  (torchtitan's "dp_shard_mod_ep"), so a rank holds a quarter of the expert weights and gradients,
  not half;
- HSDP (2 replicas x 2 shards, parallel.expert=2): each expert group is one whole replica, so the
  experts are replicated over the replicas and all-reduced;
- gradient accumulation: the experts' gradients reduced once, after the last micro-batch, in both;
- pipeline parallelism: the data-parallel ranks of each stage form the expert-parallel groups;
- checkpoints saved under these layouts load bit for bit at parallel.expert 1, 2 and 4 and under a
  pipeline;
- without expert parallelism, fewer experts than FSDP2 ranks are split along their rows, every rank
  an equal piece.
"""

from __future__ import annotations

import pytest

from lmforge.models import preset
from lmforge.parallel.mesh import fsdp_shards_experts
from tests.parallel.test_parallel import _check, _launch, check_reshard

L4 = {"num_layers": 4}
ROUTER = {"router_z_loss_coef": 0.01, "router_aux_loss_coef": 0.1}

FOUR = {
    # Each expert on 2 of the 4 ranks, FSDP2-sharded over them (Shard(0) over "ep" then over
    # "ep_shard"); its checkpoint loads under a pipeline (2 stages x expert 2 over their 2 data
    # ranks) and back.
    "ep2_fsdp_qwen3_moe": {
        "model": "tiny-qwen3-moe",
        "parallel": {"expert": 2},
        "model_overrides": ROUTER,
        "reshard": {"parallel": {"pipeline": 2, "expert": 2, "microbatches": 2}},
    },
    # Two experts: one per ep rank, sharded along its rows over the two holding it (FSDP2 would
    # otherwise pad dimension 0: one rank the whole expert, the other nothing); its checkpoint loads
    # without expert parallelism.
    "ep2_fsdp_two_experts": {
        "model": "tiny-mixtral",
        "model_overrides": {"num_experts": 2},
        "parallel": {"expert": 2},
        "reshard": {"parallel": {"expert": 1}},
    },
    # Two micro-batches: FSDP2 holds the experts' unsharded gradients and reduce-scatters once,
    # after the last.
    "ep2_fsdp_mixtral_accumulate": {
        "model": "tiny-mixtral",
        "parallel": {"expert": 2},
        "accumulate": 2,
    },
    # HSDP 2 x 2 with expert=2: an ep group is a whole replica, so the two ranks holding each expert
    # are in two replicas and all-reduce it; its checkpoint loads at expert=4 (one expert per rank)
    # and on one process.
    "ep2_hsdp_mixtral": {
        "model": "tiny-mixtral",
        "parallel": {"expert": 2, "data_replicate": 2, "data_shard": 2},
        "reshard": {"parallel": {"expert": 4}},
    },
    "ep2_hsdp_mixtral_accumulate": {
        "model": "tiny-mixtral",
        "accumulate": 2,
        "parallel": {"expert": 2, "data_replicate": 2, "data_shard": 2},
    },
    # nothing to reduce
    "ep4_qwen3_moe_fsdp": {"model": "tiny-qwen3-moe", "parallel": {"expert": 4}},
    # No expert parallelism, 2 experts over 4 FSDP2 ranks: split along their rows too, not 1 expert
    # on 2 ranks.
    "fsdp_two_experts": {
        "model": "tiny-mixtral",
        "model_overrides": {"num_experts": 2},
        "parallel": {},
    },
    # Pipelines: the router losses across stages, the all-to-alls within each stage's data ranks.
    "ep2_pp2_qwen3_moe_1f1b": {
        "model": "tiny-qwen3-moe",
        "model_overrides": ROUTER,
        "parallel": {"pipeline": 2, "expert": 2, "microbatches": 2},
    },
    "ep2_pp2_mixtral_interleaved": {
        "model": "tiny-mixtral",
        "model_overrides": {**L4, "router_aux_loss_coef": 0.5},
        "parallel": {
            "pipeline": 2,
            "data_replicate": 2,
            "data_shard": 1,
            "expert": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "virtual_stages": 2,
            "microbatches": 4,
        },
    },
}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _launch(4, FOUR, tmp_path_factory.mktemp("ep4"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(FOUR))
def test_expert_layouts_equal_one_process(four, layout):
    _check(four[layout])


def _expert_bytes(case: dict) -> int:
    """The bytes of every expert weight of the case's model (fp32)."""
    cfg = preset(case["model"])
    over = case.get("model_overrides", {})
    experts, layers = (
        over.get("num_experts", cfg.num_experts),
        over.get("num_layers", cfg.num_layers),
    )
    moe = sum(cfg.is_moe_layer(i) for i in range(layers))
    return moe * experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "holders"),
    [
        ("ep2_fsdp_qwen3_moe", 4),
        ("ep2_fsdp_two_experts", 4),
        ("ep2_fsdp_mixtral_accumulate", 4),
        # Replicated where the ranks holding the same experts are replicas: half of them, as every
        # layout before FSDP2 sharded the experts (4 ranks, expert=2).
        ("ep2_hsdp_mixtral", 2),
        ("ep4_qwen3_moe_fsdp", 4),
        ("ep2_pp2_qwen3_moe_1f1b", 2 * 2),
        ("fsdp_two_experts", 4),
    ],
)
def test_each_rank_holds_its_share_of_the_experts(four, layout, holders):
    """The most expert-weight bytes (and gradient bytes) any rank holds: the model's expert
    weights over the ranks they are split over (a pipeline stage holds half the layers, its 2
    data ranks half of each layer's experts)."""
    r = four[layout]
    if layout.startswith("ep2_fsdp") and not fsdp_shards_experts():
        holders = 2  # before torch 2.12 FSDP2 cannot shard them: whole on both ranks holding them
    assert r["expert_bytes"] == _expert_bytes(FOUR[layout]) / holders
    assert r["expert_grad_bytes"] == r["expert_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name, case in FOUR.items() if "reshard" in case])
def test_checkpoints_reshard_between_expert_layouts(four, layout):
    check_reshard(four[layout])
