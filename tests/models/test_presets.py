"""Presets have the published shapes: parameter counts equal transformers' for the same config."""

from __future__ import annotations

import pytest
import torch

from lmforge.models import PRESETS, build, num_parameters, preset
from lmforge.models.hf import adapter_for

tf = pytest.importorskip("transformers")

PUBLISHED = [name for name in PRESETS if not name.startswith("tiny-")]


def _hf_count(name: str) -> int:
    cfg = preset(name)
    hf = adapter_for(cfg.family).config_to_hf(cfg)
    config = tf.AutoConfig.for_model(**hf)
    auto = tf.AutoModelForMaskedLM if cfg.family == "bert" else tf.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", PUBLISHED)
def test_meta_build_matches_transformers_parameter_count(name):
    assert num_parameters(build(name, device="meta")) == _hf_count(name)


@pytest.mark.parametrize(
    ("name", "count"),
    [
        # Figures as published with the checkpoints / counted on the released models.
        ("pythia-70m", 70_426_624),
        ("pythia-6.9b", 6_857_302_016),
        ("gpt-neox-20b", 20_554_567_680),
        ("llama-2-7b", 6_738_415_616),
        ("llama-2-70b", 68_976_648_192),
        ("llama-3.1-8b", 8_030_261_248),
        ("llama-3.1-70b", 70_553_706_496),
        ("llama-3.2-1b", 1_235_814_400),
        ("llama-3.2-3b", 3_212_749_824),
        ("qwen2.5-0.5b", 494_032_768),
        ("qwen2.5-7b", 7_615_616_512),
        ("qwen2.5-72b", 72_706_203_648),
        ("qwen3-0.6b", 596_049_920),
        ("qwen3-8b", 8_190_735_360),
        ("mistral-7b", 7_241_732_096),
        ("mistral-7b-v0.3", 7_248_023_552),
        ("olmo-2-1b", 1_484_916_736),
        ("olmo-2-7b", 7_298_617_344),
        ("phi-3-mini", 3_821_079_552),
        ("gemma-2-2b", 2_614_341_888),
        ("gemma-2-9b", 9_241_705_984),
        ("gemma-2-27b", 27_227_128_320),
        ("gemma-3-1b", 999_885_952),
        ("gpt2", 124_439_808),
        ("gpt-j-6b", 6_050_882_784),
        ("bert-base-uncased", 109_514_298),
        ("mixtral-8x7b", 46_702_792_704),
        ("qwen3-30b-a3b", 30_532_122_624),
    ],
)
def test_known_published_counts(name, count):
    assert num_parameters(build(name, device="meta")) == count


def test_padding_rows_are_extra_storage_only():
    model = build("gpt2", device="meta")
    assert model.embed.weight.shape[0] == 50304
    assert num_parameters(model, exclude_vocab_padding=False) - num_parameters(model) == 47 * 768


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("tiny-")])
def test_tiny_presets_run_forward_and_backward(name):
    model = build(name, seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    out = model(ids)
    out.float().pow(2).mean().backward()
    assert torch.isfinite(out).all()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
