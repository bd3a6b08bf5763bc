"""A tiny learnable corpus in Megatron format, a helper to make run configs, and a tiny Llama
with chat data."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from lmforge.data.indexed import IndexedDatasetWriter
from lmforge.train.config import load_run_config


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """300 documents of arithmetic sequences mod 1000: structure a tiny model learns in a few
    steps."""
    prefix = tmp_path_factory.mktemp("corpus") / "arith_text_document"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(300):
            n, start, step = rng.integers(5, 200), rng.integers(0, 1000), rng.integers(1, 5)
            writer.add_document((start + step * np.arange(n)) % 1000)
    return prefix


def run_args(corpus, run_dir, *overrides: str) -> list[str]:
    """The overrides of a small run on `corpus` (run_config's, or `lmforge pretrain /dev/null
    ARGS`)."""
    return [
        "model.preset=tiny-neox",
        f"data.paths=[{corpus}]",
        "data.seq_length=32",
        "trainer.max_steps=8",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",
        "trainer.val_check_interval=4",
        "trainer.val_batches=1",
        f"run_dir={run_dir}",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "trainer.progress_bar=false",
        "trainer.precision=fp32",
        "cost.peak_flops=1e11",
        *overrides,
    ]


def run_config(corpus, run_dir, *overrides: str):
    return load_run_config(None, run_args(corpus, run_dir, *overrides))


@pytest.fixture(scope="module")
def tiny_gpt2(shared_data, tmp_path_factory):
    """A small GPT-2-shaped lmforge model with the real GPT-2 tokenizer beside it."""
    from lmforge.models import build
    from lmforge.models.io import save_model

    out = tmp_path_factory.mktemp("gpt2") / "model"
    model = build(
        {
            **build("tiny-gpt2", device="meta").config.__dict__,
            "vocab_size": 50257,
            "max_position_embeddings": 128,
        },
        seed=0,
    )
    save_model(model, out, tokenizer_from=shared_data / "tokenizers" / "gpt2" / "tokenizer.json")
    return out


LICENSES = ("LICENSE", "USE_POLICY.md")


@pytest.fixture(scope="module")
def tiny_llama(shared_data, tmp_path_factory):
    """A small random Llama (a Hugging Face folder) with the real GPT-2 tokenizer beside it (the
    LoRA and QLoRA tests)."""
    tf = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("llama") / "hf"
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=50257,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        bos_token_id=50256,
        eos_token_id=50256,
    )
    tf.LlamaForCausalLM(config).save_pretrained(out)
    shutil.copyfile(shared_data / "tokenizers" / "gpt2" / "tokenizer.json", out / "tokenizer.json")
    # what a Llama folder carries beside its weights; every export of a derivative keeps them
    for name in LICENSES:
        (out / name).write_text(f"{name}: the terms this test model is distributed under\n")
    return out


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """64 chat records, a sum each (the LoRA and QLoRA tests)."""
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
            ]
        }
        for a in range(8)
        for b in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
