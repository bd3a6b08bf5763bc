"""Expert parallelism (parallel.expert): the all-to-all dispatch against the dense expert-by-expert reference, on
2 gloo processes, and the layout checks in one process. EP 2 = EP 1 over whole models (with DDP, FSDP, HSDP,
checkpoints resharded between EP degrees) is in test_parallel.py's layouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.errors import UserError
from lmforge.models import preset
from lmforge.parallel import ParallelConfig, check_model
from tests.parallel.launch import run_ranks


@pytest.fixture(scope="module")
def dispatch(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep") / "out.json"
    ranks = run_ranks(2, [str(out)], script=Path(__file__).with_name("expert_worker.py"))
    for i, r in enumerate(ranks):
        assert r.returncode == 0, f"rank {i} failed:\n{r.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_dispatched_and_combined_output_equals_the_dense_reference(dispatch, routing):
    """Every (token, expert) pair goes to its expert's rank and comes back weighted, gradients included; 'skewed'
    sends every token to rank 0's experts (rank 1 receives no rows, its experts no gradient)."""
    r = dispatch[routing]
    for key in ("out", "x_grad", "router_grad", "gate_up_grad", "down_grad"):
        assert r[key] < 1e-5, (key, r)
    if routing == "skewed":
        assert r["top_expert"] == 1


@pytest.mark.slow
def test_a_router_that_duplicates_an_expert_fails_the_comparison(dispatch):
    assert dispatch["duplicating"]["out"] > 1e-2


@pytest.mark.parametrize(("model", "cfg", "world", "message"), [
    ("tiny-llama", ParallelConfig(expert=2), 2,
     r"^parallel.expert=2 needs a mixture-of-experts model, llama has no experts .*set parallel.expert=1$"),
    ("tiny-mixtral", ParallelConfig(expert=3), 3, r"^model.num_experts=4 is not divisible by parallel.expert=3"),
    ("tiny-qwen3-moe", ParallelConfig(expert=4, data_shard=2), 2,
     r"^parallel.expert=4 does not divide the data-parallel size 2 \(data_replicate=1 x data_shard=2\)"),
    ("tiny-qwen3-moe", ParallelConfig(expert=2, data_shard=2, pipeline=2), 4, "set parallel.tensor=1 and "
                                                                              "parallel.pipeline=1$"),
])
def test_expert_layouts_that_do_not_fit(model, cfg, world, message):
    with pytest.raises(UserError, match=message):
        check_model(cfg.resolved(world), preset(model))


def test_expert_degree_must_be_positive():
    with pytest.raises(UserError, match="parallel.expert must be >= 1, got 0"):
        ParallelConfig(expert=0)
