"""`lmforge compile` fills a persistent cache that the following run loads instead of compiling."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lmforge.train.trainer import Trainer
from tests.train.conftest import run_config


@pytest.mark.slow
def test_compile_step_then_run_step_hits_the_cache(tiny_corpus, tmp_path):
    args = ["model.preset=tiny-neox", f"data.paths=[{tiny_corpus}]", "data.seq_length=32",
            "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.val_check_interval=2",
            "trainer.val_batches=1", "trainer.precision=fp32", "trainer.progress_bar=false",
            "cost.peak_flops=1e11", f"run_dir={tmp_path / 'run'}"]
    r = subprocess.run([sys.executable, "-m", "lmforge.cli", "compile", os.devnull, *args], capture_output=True,
                       text=True, timeout=600)  # same environment (threads) as this process: part of the key
    assert r.returncode == 0, r.stderr[-2000:]
    cache = tmp_path / "run" / "compile_cache"
    assert any(cache.rglob("*")) and not (tmp_path / "run" / ".compile-job").exists()

    from torch._dynamo.utils import counters

    counters.clear()
    torch._dynamo.reset()  # nothing compiled in this process: every graph must come from the disk cache
    cfg = run_config(tiny_corpus, tmp_path / "run", "trainer.compile=true", "trainer.max_steps=2",
                     "trainer.val_check_interval=2")
    Trainer(cfg).fit()
    assert counters["inductor"]["fxgraph_cache_hit"] > 0
    assert counters["inductor"]["fxgraph_cache_miss"] == 0
