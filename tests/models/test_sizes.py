"""The sizes lmforge.models.sizes counts from a config alone equal those of the model and cache
it builds: every preset (and its classifier), a mixture of experts with dense layers, sliding
windows with and without rings."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmforge.inference.cache import KVCache
from lmforge.models.build import build, num_parameters
from lmforge.models.presets import PRESETS
from lmforge.models.sizes import human_bytes, kv_cache_bytes, moe_layer_count, parameter_count


def variants():
    for name, cfg in PRESETS.items():
        yield name, cfg
        if name.startswith("tiny"):
            yield f"{name}, classifier", dataclasses.replace(cfg, num_labels=3)
    moe = PRESETS["tiny-qwen3-moe"]
    yield (
        "moe every 2nd layer, one dense",
        dataclasses.replace(moe, num_layers=6, moe_every=2, dense_layers=[3, 0]),
    )
    yield (
        "gpt2 with an untied head and its bias",
        dataclasses.replace(PRESETS["tiny-gpt2"], lm_head_bias=True, tie_embeddings=False),
    )


@pytest.mark.parametrize(("name", "cfg"), list(variants()), ids=[name for name, _ in variants()])
def test_the_parameters_counted_are_those_built(name, cfg):
    model = build(cfg, device="meta")
    assert parameter_count(cfg) == num_parameters(model, exclude_vocab_padding=False)
    assert parameter_count(cfg, padded=False) == num_parameters(model)
    assert moe_layer_count(cfg) == sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


@pytest.mark.parametrize(
    "name", [n for n in PRESETS if n.startswith("tiny") and PRESETS[n].is_decoder]
)
@pytest.mark.parametrize("ring", [True, False])
def test_the_cache_bytes_counted_are_those_allocated(name, ring):
    cfg = PRESETS[name]
    for slots in (4, 8, 9, 100):  # below, at and past the tiny presets' window of 8
        for dtype in (torch.float32, torch.bfloat16):
            cache = KVCache(cfg, 3, slots, dtype, device="meta", ring=ring)
            assert kv_cache_bytes(cfg, 3, slots, dtype, ring) == cache.nbytes


def test_a_million_layers_are_counted_at_once():
    cfg = dataclasses.replace(PRESETS["tiny-llama"], num_layers=10**12)
    # Python integers: no tensor, no loop over the layers; 43,136 a block, 131,136 in the embedding,
    # head and norm
    assert parameter_count(cfg) == 43_136 * 10**12 + 131_136


def test_bytes_read_as_people_write_them():
    assert [human_bytes(n) for n in (17, 2048, 3 << 30, 10**15)] == [
        "17 bytes",
        "2.0 KiB",
        "3.0 GiB",
        "909.5 TiB",
    ]
