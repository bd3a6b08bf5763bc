"""`lmforge pretrain` with parallel.context (gloo, CPU): a run trained at C=2, resumed at C=1, then
at C=4, follows the uninterrupted one-process curve (loss, gradient norm and validation loss each
logged step): DCP reshards the model and the Adam moments across context degrees, and the data
position (consumed samples) is the one-process run's, the ranks of a context group reading the
same samples."""

from __future__ import annotations

import os

import pytest
import torch

from lmforge.train.config import load_run_config
from lmforge.train.trainer import Trainer
from tests.parallel.launch import torchrun
from tests.train.test_parallel_training import _close, _curve

# tiny Llama: 4 query heads over 2 key/value heads; seq 32 splits into 2 x 4 chunks
ARGS = [
    "model.preset=tiny-llama",
    "data.seq_length=32",
    "trainer.global_batch_size=4",
    "trainer.micro_batch_size=2",
    "trainer.val_check_interval=1",
    "trainer.val_batches=1",
    "trainer.precision=fp32",
    "optim.lr=3e-3",
    "optim.decay_steps=6",
    "trainer.progress_bar=false",
    "cost.peak_flops=1e11",
]


def _one(*overrides: str) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(load_run_config(None, list(overrides))).fit()
    finally:
        torch.set_num_threads(threads)


def _launch(processes: int, *overrides: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = torchrun(
        processes, ["-m", "lmforge.cli", "pretrain", os.devnull, *overrides], env=env, timeout=420
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r.stderr


@pytest.mark.slow
def test_a_run_resumes_across_context_degrees_2_1_4(tiny_corpus, tmp_path):
    args = [*ARGS, f"data.paths=[{tiny_corpus}]"]
    ref, run = tmp_path / "one", tmp_path / "run"
    _one(*args, "trainer.max_steps=6", f"run_dir={ref}")
    log = _launch(2, *args, "trainer.max_steps=2", "parallel.context=2", f"run_dir={run}")
    assert "dp=1x1 cp=2 tp=1" in log, log[-3000:]
    _close(_curve(run), _curve(ref)[:2])
    _one(*args, "trainer.max_steps=4", f"run_dir={run}")
    _close(_curve(run), _curve(ref)[:4])
    log = _launch(4, *args, "trainer.max_steps=6", "parallel.context=4", f"run_dir={run}")
    assert "dp=1x1 cp=4 tp=1" in log and "resum" in log.lower(), log[-3000:]
    _close(_curve(run), _curve(ref))
