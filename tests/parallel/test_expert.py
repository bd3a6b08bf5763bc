"""Expert parallelism (parallel.expert): the all-to-all dispatch against the dense
expert-by-expert reference, on 2 gloo processes; the layout checks and each rank's expert shards
of a fresh model in one process. Whole models under expert parallelism equal to one process (DDP,
FSDP2 sharding the experts, HSDP, pipelines, checkpoints resharded between expert degrees) are in
test_parallel.py's and test_expert_layouts.py's layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models import preset
from lmforge.parallel import ParallelConfig, check_model
from tests.conftest import TORCH_VERSION, needs_torch
from tests.parallel.launch import run_ranks


@pytest.fixture(scope="module")
def dispatch(tmp_path_factory):
    if TORCH_VERSION < (2, 7):
        pytest.skip(
            f"the workers' layout, EP under FSDP2, needs torch 2.7+, this is {torch.__version__}"
        )
    out = tmp_path_factory.mktemp("ep") / "out.json"
    ranks = run_ranks(2, [str(out)], script=Path(__file__).with_name("expert_worker.py"))
    for i, r in enumerate(ranks):
        assert r.returncode == 0, f"rank {i} failed:\n{r.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_dispatched_and_combined_output_equals_the_dense_reference(dispatch, routing):
    """Every (token, expert) pair goes to its expert's rank and comes back weighted, gradients
    included; 'skewed' sends every token to rank 0's experts (rank 1 receives no rows, its
    experts no gradient)."""
    r = dispatch[routing]
    for key in ("out", "x_grad", "router_grad", "gate_up_grad", "down_grad"):
        assert r[key] < 1e-5, (key, r)
    if routing == "skewed":
        assert r["top_expert"] == 1


@pytest.mark.slow
def test_a_router_that_duplicates_an_expert_fails_the_comparison(dispatch):
    assert dispatch["duplicating"]["out"] > 1e-2


@pytest.mark.parametrize(
    ("model", "cfg", "world", "message"),
    [
        (
            "tiny-llama",
            ParallelConfig(expert=2),
            2,
            r"^parallel.expert=2 needs a mixture-of-experts model, llama has no experts .*set parallel.expert=1$",
        ),
        (
            "tiny-mixtral",
            ParallelConfig(expert=3),
            3,
            r"^model.num_experts=4 is not divisible by parallel.expert=3",
        ),
        (
            "tiny-qwen3-moe",
            ParallelConfig(expert=4, data_shard=2),
            2,
            r"^parallel.expert=4 does not divide the data-parallel size 2 \(data_replicate=1 x data_shard=2\)",
        ),
    ],
)
def test_expert_layouts_that_do_not_fit(model, cfg, world, message):
    with pytest.raises(UserError, match=message):
        check_model(cfg.resolved(world), preset(model))


def test_expert_degree_must_be_positive():
    with pytest.raises(UserError, match="parallel.expert must be >= 1, got 0"):
        ParallelConfig(expert=0)


MIXTRAL_2_WIDE = {"model": "tiny-mixtral", "num_experts": 2, "moe_intermediate_size": 256}


# Before torch 2.13 FSDP2 cannot shard expert-parallel weights
# (lmforge.parallel.mesh.fsdp_shards_experts): the ranks holding the same experts keep whole copies,
# "ep_shard" is one rank and comes before "ep" (rank order).
OLD_TORCH = {
    "(Replicate(), Shard(dim=0), Shard(dim=0))": "(Replicate(), Replicate(), Shard(dim=0))",
    "(Replicate(), Shard(dim=0), Replicate())": "(Replicate(), Replicate(), Shard(dim=0))",
    "(Replicate(), Shard(dim=0), Shard(dim=2), Shard(dim=0))": "(Replicate(), Replicate(), Shard(dim=0), "
    "Shard(dim=2))",
    "(Replicate(), Shard(dim=0), Shard(dim=2), Shard(dim=2))": "(Replicate(), Replicate(), Shard(dim=0), "
    "Shard(dim=2))",
}


@needs_torch((2, 7), "expert parallelism under FSDP2")
@pytest.mark.parametrize(
    ("layout", "world", "holders", "placements", "model", "old_holders"),
    [
        # FSDP2 over 4, expert=2: the two ranks holding the same experts shard them, by expert
        # (Shard(0) twice).
        (ParallelConfig(expert=2), 4, 4, "(Replicate(), Shard(dim=0), Shard(dim=0))", {}, 2),
        # HSDP 2 x 2: an ep group is a whole replica, the same experts are on two replicas:
        # replicated.
        (
            ParallelConfig(expert=2, data_replicate=2, data_shard=2),
            4,
            2,
            "(Replicate(), Shard(dim=0), Shard(dim=0))",
            {},
            2,
        ),
        # Two pipeline stages over 2 data ranks each: expert=2 over a stage's 2, nothing to shard;
        # half the layers.
        (
            ParallelConfig(expert=2, pipeline=2),
            4,
            4,
            "(Replicate(), Shard(dim=0), Replicate())",
            {},
            4,
        ),
        # Expert x tensor parallelism over 8 ("ep_replicate", "ep", "tp", "ep_shard"): half the
        # experts per ep rank, half of each one's intermediate rows per tensor rank, and FSDP2
        # halves that over the 2 data ranks holding the same.
        (
            ParallelConfig(expert=2, tensor=2),
            8,
            8,
            "(Replicate(), Shard(dim=0), Shard(dim=2), Shard(dim=0))",
            {},
            4,
        ),
        # One expert per ep rank: FSDP2 splits its intermediate rows (the widest dim) within the
        # tensor rank's: a box.
        (
            ParallelConfig(expert=2, tensor=2),
            8,
            8,
            "(Replicate(), Shard(dim=0), Shard(dim=2), Shard(dim=2))",
            MIXTRAL_2_WIDE,
            4,
        ),
    ],
)
def test_a_fresh_model_is_initialised_in_its_expert_shards(
    layout, world, holders, placements, model, old_holders
):
    """Each rank (fake process group, one process) initialises only its pieces of a meta-built
    model (DDP takes no meta model): they equal the one-process model's, and a rank holds the
    experts' elements over the ranks they are split over. Several fake worlds in one process: the
    experts' mesh must be each world's own (_parameter)."""
    from lmforge.parallel.mesh import fsdp_shards_experts

    if not fsdp_shards_experts():
        holders, placements = old_holders, OLD_TORCH[placements]
    from dataclasses import replace

    import torch

    from lmforge.models import build
    from lmforge.models.build import local_piece
    from lmforge.parallel import build_mesh, parallelize
    from lmforge.parallel.fake import fake_world
    from lmforge.parallel.load import init_sharded

    model = dict(model)
    cfg = replace(preset(model.pop("model", "tiny-qwen3-moe")), **model)
    whole = dict(build(cfg, seed=5).named_parameters())
    experts = sum(p.numel() for n, p in whole.items() if ".experts." in n)
    cpu = torch.device("cpu")
    for rank in range(world):
        with fake_world(cpu, world, rank):
            pm = parallelize(
                build(cfg, device="meta"),
                layout,
                build_mesh(layout, cfg, device_type="cpu"),
                device=cpu,
            )
            init_sharded(pm, seed=5)
            held = 0
            for part in pm.parts:
                for name, p in part.named_parameters():
                    if model and ".experts." not in name:
                        # 2 router rows over 4 FSDP2 shards: in the later fake worlds of one process
                        # DTensor's cached mesh gives an empty shard another world's coordinate
                        # (real runs: test_expert_layouts.py).
                        continue
                    local, box = local_piece(p)
                    assert torch.equal(local, whole[name].detach()[box]), (rank, name)
                    if ".experts." in name:
                        held += local.numel()
                        assert str(p.placements) == placements
            assert held == experts // holders
