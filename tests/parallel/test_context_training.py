"""parallel.context=C trains like one process: the trainer's step (lmforge.train.transforms.
lay_out_model, ParallelTraining.step) on a packed grouped-query batch at C = 2 and 4, and C = 2
beside FSDP2 (data_shard 2), HSDP (data_replicate 2) and tensor parallelism 2 (sequence parallel,
vocabulary-parallel loss), against the same step on one process: loss, gradient norm and every
parameter's gradient within 1e-5 (fp32, gloo). The refusals of what it does not compose with are
one UserError line each."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lmforge.errors import UserError
from lmforge.parallel import ParallelConfig
from lmforge.parallel.mesh import check_model
from tests.parallel import context_train_worker as ctw
from tests.parallel.launch import torchrun

WORKER = Path(ctw.__file__)
CASES = {
    2: {
        "c2_ring": "parallel.context=2",
        "c2_allgather": "parallel.context=2,parallel.context_method=allgather",
    },
    4: {
        "c4_ring": "parallel.context=4",
        "c4_allgather": "parallel.context=4,parallel.context_method=allgather",
        "c2_fsdp2": "parallel.context=2,parallel.data_shard=2",
        "c2_hsdp2": "parallel.context=2,parallel.data_replicate=2",
        "c2_tp2": "parallel.context=2,parallel.tensor=2",
        "c2_tp2_plain": (
            "parallel.context=2,parallel.tensor=2,parallel.sequence_parallel=false,"
            "parallel.loss_parallel=false"
        ),
    },
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        training, loss, norm = ctw.train_step([], 1, tmp_path_factory.mktemp("one"))
    finally:
        torch.set_num_threads(threads)
    return {"loss": loss, "norm": norm, "grads": ctw.gradients(training)}


@pytest.fixture(scope="module", params=[2, 4])
def launched(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"context{request.param}")
    cases = [f"{name}={spec}" for name, spec in CASES[request.param].items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[2])}
    r = torchrun(request.param, [str(WORKER), str(out), *cases], env=env, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    return {name: torch.load(out / f"{name}.pt") for name in CASES[request.param]}


@pytest.mark.slow
def test_context_parallel_steps_equal_one_process(launched, one_process):
    ref = one_process
    for name, got in launched.items():
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-6), name
        assert got["norm"] == pytest.approx(ref["norm"], rel=1e-5), name
        assert got["grads"].keys() == ref["grads"].keys(), name
        for key, g in ref["grads"].items():
            torch.testing.assert_close(
                got["grads"][key], g, atol=1e-5, rtol=1e-5, msg=f"{name}: {key}"
            )


def test_the_one_process_reference_is_the_summed_loss_over_the_global_labels(one_process):
    """The reference step itself against a hand computation: the decoder on whole packed rows
    (Documents.of), cross-entropy summed over the shifted labels, divided by their count."""
    import torch.nn.functional as F

    from lmforge.models import build
    from lmforge.train.config import load_run_config

    model = build(load_run_config(None, ctw.BASE).model.resolve(), seed=0)
    batch = {k: torch.cat([b[k] for b in ctw.global_batch()]) for k in ctw.global_batch()[0]}
    labels = torch.cat([batch["labels"][:, 1:], torch.full((4, 1), -100)], 1)
    logits = model(
        batch["input_ids"], segment_ids=batch["segment_ids"], position_ids=batch["position_ids"]
    )
    loss = (
        F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        / (labels != -100).sum()
    )
    assert one_process["loss"] == pytest.approx(loss.item(), rel=1e-6)


@pytest.mark.parametrize(
    "layout, model, words",
    [
        (ParallelConfig(context=2, pipeline=2), "tiny-llama", "parallel.pipeline=1"),
        (ParallelConfig(context=2), "tiny-mixtral", "mixture-of-experts"),
        (ParallelConfig(context=2), "tiny-bert", "causal attention"),
    ],
)
def test_unsupported_combinations_are_one_line(layout, model, words):
    from lmforge.models import preset

    with pytest.raises(UserError, match=words) as e:
        check_model(layout, preset(model))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["data.task=dpo"], "data.task=dpo is not supported"),
        (["trainer.compile=true"], "trainer.compile=false"),
    ],
)
def test_runs_context_parallelism_does_not_serve_are_refused(overrides, words):
    from lmforge.train.config import load_run_config, parallel_layout
    from lmforge.train.context import check_context_run
    from lmforge.train.tasks import get_task

    cfg = load_run_config(None, [*ctw.BASE, "parallel.context=2", *overrides])
    with pytest.raises(UserError, match=words):
        check_context_run(cfg, parallel_layout(cfg, 2), get_task(cfg.data.task))


def test_the_layout_multiplies_context_into_the_world():
    assert ParallelConfig(context=2, tensor=2).resolved(8).data_shard == 2
    with pytest.raises(UserError, match="context=4 x tensor=2 = 8 does not divide"):
        ParallelConfig(context=4, tensor=2).resolved(12)
