"""A layout the model or the world cannot take ends every rank non-zero with one clear line, no
hang."""

from __future__ import annotations

import json

import pytest

from tests.parallel.launch import run_ranks


def _run(tmp_path, spec: dict, world: int = 2):
    path = tmp_path / "case.json"
    path.write_text(json.dumps(spec))
    return run_ranks(world, ["error", str(path)], timeout=120)


def _one_error_line(ranks) -> str:
    assert all(r.returncode != 0 for r in ranks), [r.returncode for r in ranks]
    lines = [line for r in ranks for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and ranks[0].stderr.count("error: ") == 1, [
        r.stderr[-2000:] for r in ranks
    ]
    assert "Traceback" not in ranks[0].stderr
    return lines[0]


@pytest.mark.slow
def test_mesh_that_does_not_divide_the_world(tmp_path):
    line = _one_error_line(_run(tmp_path, {"model": "tiny-neox", "parallel": {"tensor": 4}}))
    assert "does not divide the world size 2" in line


@pytest.mark.slow
def test_tensor_parallel_not_dividing_heads(tmp_path):
    spec = {
        "model": "tiny-neox",
        "model_overrides": {"hidden_size": 48, "num_heads": 3, "num_kv_heads": 3},
        "parallel": {"tensor": 2},
    }
    line = _one_error_line(_run(tmp_path, spec))
    assert "model.num_heads=3 is not divisible by parallel.tensor=2" in line


@pytest.mark.slow
def test_expert_parallelism_of_a_dense_model(tmp_path):
    line = _one_error_line(_run(tmp_path, {"model": "tiny-llama", "parallel": {"expert": 2}}))
    assert line == (
        "error: parallel.expert=2 needs a mixture-of-experts model, llama has no experts "
        "(model.num_experts=0): set parallel.expert=1"
    )


@pytest.mark.slow
def test_a_hung_rank_makes_the_others_time_out(tmp_path, monkeypatch):
    """Rank 1 stalls before the step's tensor-parallel collectives (a mesh sub-group, not the
    default group): the others fail once the collective timeout (here 3 s) passes, and rank 1
    fails when it finds them gone. Nobody waits for torch's own 30-minute default."""
    monkeypatch.setenv("LMFORGE_TEST_TIMEOUT_MIN", "0.05")
    spec = {
        "model": "tiny-neox",
        "parallel": {"tensor": 2, "data_shard": 2},
        "stall_on_rank": 1,
        "stall_seconds": 10,
    }
    ranks = _run(tmp_path, spec, world=4)
    assert all(r.returncode == 2 for r in ranks), [r.stderr[-1000:] for r in ranks]
    assert "rank 0:" in ranks[0].stderr
