"""A tiny learnable corpus in Megatron format, and a helper to make run configs."""

from __future__ import annotations

import numpy as np
import pytest

from lmforge.data.indexed import IndexedDatasetWriter
from lmforge.train.config import load_run_config


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """300 documents of arithmetic sequences mod 1000: structure a tiny model learns in a few steps."""
    prefix = tmp_path_factory.mktemp("corpus") / "arith_text_document"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(300):
            n, start, step = rng.integers(5, 200), rng.integers(0, 1000), rng.integers(1, 5)
            writer.add_document((start + step * np.arange(n)) % 1000)
    return prefix


def run_args(corpus, run_dir, *overrides: str) -> list[str]:
    """The overrides of a small run on `corpus` (run_config's, or `lmforge pretrain /dev/null ARGS`)."""
    return [
        "model.preset=tiny-neox", f"data.paths=[{corpus}]", "data.seq_length=32", "trainer.max_steps=8",
        "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "trainer.val_check_interval=4",
        "trainer.val_batches=1", f"run_dir={run_dir}", "optim.lr=3e-3", "optim.warmup_steps=2",
        "trainer.progress_bar=false", "trainer.precision=fp32", "cost.peak_flops=1e11", *overrides,
    ]


def run_config(corpus, run_dir, *overrides: str):
    return load_run_config(None, run_args(corpus, run_dir, *overrides))


@pytest.fixture(scope="module")
def tiny_gpt2(shared_data, tmp_path_factory):
    """A small GPT-2-shaped lmforge model with the real GPT-2 tokenizer beside it."""
    from lmforge.models import build
    from lmforge.models.io import save_model

    out = tmp_path_factory.mktemp("gpt2") / "model"
    model = build({**build("tiny-gpt2", device="meta").config.__dict__, "vocab_size": 50257,
                   "max_position_embeddings": 128}, seed=0)
    save_model(model, out, tokenizer_from=shared_data / "tokenizers" / "gpt2" / "tokenizer.json")
    return out
