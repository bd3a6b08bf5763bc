"""Data parallelism under torchrun (gloo, 2 CPU processes; 4 for the sharded experts and expert x
tensor parallelism): the same training as one process with the same global batch, for DDP and
FSDP2, and a checkpoint that resumes on one process (on 2 from 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.parallel.launch import torchrun


def _args(corpus, run_dir, *extra):
    return [
        "pretrain",
        os.devnull,
        "model.preset=tiny-neox",
        f"data.paths=[{corpus}]",
        "data.seq_length=32",
        "trainer.max_steps=4",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        "trainer.val_check_interval=2",
        "trainer.val_batches=1",
        "trainer.precision=fp32",
        "optim.lr=3e-3",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
        f"run_dir={run_dir}",
        *extra,
    ]


def _curve(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"], r.get("val_loss"), r.get("aux_loss")) for r in rows]


def _close(a, b):
    for (la, ga, va, xa), (lb, gb, vb, xb) in zip(a, b, strict=True):
        assert la == pytest.approx(lb, rel=2e-5) and ga == pytest.approx(gb, rel=2e-4)
        assert (va is None) == (vb is None) and (va is None or va == pytest.approx(vb, rel=2e-5))
        assert (xa is None) == (xb is None) and (xa is None or xa == pytest.approx(xb, rel=2e-5))


LORA = ("lora.rank=4", "lora.targets=all-linear")
# A mixture of experts with a load-balancing loss large enough to move the gradient norm.
MOE = ("model.preset=tiny-mixtral", "model.router_aux_loss_coef=0.5")


# each rank holds 2 of the 4 experts (4 ranks: sharded over the 2 holding them)
EP = ("parallel.expert=2",)
MOE_HF = (*MOE, "checkpoint.convert_to_hf=true")  # the export gathers every expert


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, extra, layout",
    [
        ("ddp", (), ()),
        ("fsdp", (), ()),
        ("fsdp", LORA, ()),
        ("fsdp", MOE, ()),
        ("fsdp parallel.tensor=2", MOE, ()),
        # Pipeline microbatches of one process's micro-batches (2 rows): the router losses are per
        # forward, so the same ones.
        ("fsdp parallel.pipeline=2 parallel.microbatches=4", MOE, ()),
        ("fsdp", MOE_HF, EP),
        ("ddp", MOE, EP),
    ],
    ids=["ddp", "fsdp", "fsdp-lora", "fsdp-moe", "tp-moe", "pp-moe", "fsdp-moe-ep", "ddp-moe-ep"],
)
def test_two_processes_train_like_one(strategy, extra, layout, tiny_corpus, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *_args(tiny_corpus, tmp_path / "one", *extra)],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    two = tmp_path / "two"
    r = torchrun(
        2,
        [
            "-m",
            "lmforge.cli",
            *_args(tiny_corpus, two, *f"trainer.data_parallel={strategy}".split(), *extra, *layout),
        ],
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    _close(_curve(two), _curve(tmp_path / "one"))
    # the two processes' export holds the one process's weights, every expert whole
    if MOE_HF == extra:
        from safetensors.torch import load_file

        ours, ref = (load_file(d / "hf" / "model.safetensors") for d in (two, tmp_path / "one"))
        assert ours.keys() == ref.keys()
        for name, t in ref.items():
            # Adam turns fp32 summation noise in tiny gradients into ~1e-6 of a weight over 4 steps:
            # measured 4e-5 of the largest; an expert gathered out of place would be off by the
            # weights themselves.
            assert (ours[name] - t).abs().max() <= 2e-4 * t.abs().max(), name
    before = _curve(two)
    # The 2-process checkpoint (DCP) loads on one process and training continues from step 4 (expert
    # parallelism's experts, split over the two, whole again).
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmforge.cli",
            *_args(tiny_corpus, two, "trainer.max_steps=6", *extra),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "processes 2 -> 1" in r.stderr  # the resume's warning lists the world size it left
    after = _curve(two)
    assert after[:4] == before and len(after) == 6
    # The resumed steps continue training, not restart it (adapters on a random base barely move the
    # loss).
    assert after[4][0] < before[0][0] if not extra else after[4] != before[0]


def _run(processes, args, env):
    r = (
        torchrun(processes, ["-m", "lmforge.cli", *args], env=env, timeout=300)
        if processes > 1
        else subprocess.run(
            [sys.executable, "-m", "lmforge.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_sharded_experts_train_and_resume_like_one_process(tiny_corpus, tmp_path):
    """parallel.expert=2 on 4 FSDP2 processes (each expert sharded over the 2 ranks holding it),
    micro-batches of one row (two per rank: the experts' gradients reduced once, after the
    second): one process's losses, gradient norms, validation and router losses. Its checkpoint
    (weights and optimizer state, sharded) resumes on 2 processes at expert=2 (each rank its half
    of the experts, whole) and continues as one process resumed from its own does."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    small = ("trainer.micro_batch_size=1", *MOE)
    one, four = tmp_path / "one", tmp_path / "four"
    _run(1, _args(tiny_corpus, one, *small), env)
    _run(4, _args(tiny_corpus, four, *small, "trainer.data_parallel=fsdp", *EP), env)
    _close(_curve(four), _curve(one))
    _run(1, _args(tiny_corpus, one, *small, "trainer.max_steps=6"), env)
    _run(
        2,
        _args(tiny_corpus, four, *small, "trainer.data_parallel=fsdp", *EP, "trainer.max_steps=6"),
        env,
    )
    assert len(_curve(four)) == 6
    _close(_curve(four), _curve(one))


@pytest.mark.slow
def test_expert_x_tensor_parallel_trains_and_resumes_like_one_process(tiny_corpus, tmp_path):
    """parallel.expert=2 x tensor=2 (sequence parallel) on 4 processes, two micro-batches per
    data rank: one process's losses, gradient norms, validation and router losses. Its checkpoint
    (the experts split by expert and by rows, their optimizer state too) resumes on 2 processes
    under tensor parallelism alone (every expert on the one data rank, split by rows) and
    continues as one process resumed from its own does."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one, four = tmp_path / "one", tmp_path / "four"
    _run(1, _args(tiny_corpus, one, *MOE), env)
    _run(
        4,
        _args(tiny_corpus, four, *MOE, "trainer.data_parallel=fsdp", *EP, "parallel.tensor=2"),
        env,
    )
    _close(_curve(four), _curve(one))
    _run(1, _args(tiny_corpus, one, *MOE, "trainer.max_steps=6"), env)
    _run(
        2,
        _args(
            tiny_corpus,
            four,
            *MOE,
            "trainer.data_parallel=fsdp",
            "parallel.tensor=2",
            "trainer.max_steps=6",
        ),
        env,
    )
    assert len(_curve(four)) == 6
    _close(_curve(four), _curve(one))
