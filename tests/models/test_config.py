"""Config mistakes fail with one line that names the key and suggests the fix."""

from __future__ import annotations

import pytest

from lmforge.errors import UserError
from lmforge.models import ModelConfig, build, preset


def test_unknown_preset_suggests_closest():
    with pytest.raises(
        UserError, match=r"unknown model preset 'pythia-160'.*did you mean 'pythia-160m'"
    ):
        preset("pythia-160")


def test_typo_in_config_key_names_key_and_suggests():
    cfg = {"family": "llama", "vocab_size": 100, "hiden_size": 64, "num_layers": 2, "num_heads": 4}
    expected = r"unknown config key 'model.hiden_size' \(did you mean 'model.hidden_size'\?\)"
    with pytest.raises(UserError, match=expected):
        build(cfg)


def test_unknown_family_and_choice_values():
    with pytest.raises(UserError, match=r"unknown family 'lama'.*did you mean 'llama'"):
        ModelConfig(family="lama", vocab_size=10, hidden_size=8, num_layers=1, num_heads=2)
    with pytest.raises(UserError, match=r"unknown norm 'rmsnrom'.*did you mean 'rmsnorm'"):
        ModelConfig(
            family="llama", vocab_size=10, hidden_size=8, num_layers=1, num_heads=2, norm="rmsnrom"
        )


def test_shape_errors_are_explained():
    with pytest.raises(UserError, match="not divisible by num_heads"):
        ModelConfig(family="llama", vocab_size=10, hidden_size=10, num_layers=1, num_heads=3)
    with pytest.raises(UserError, match="not a multiple of num_kv_heads"):
        ModelConfig(
            family="llama", vocab_size=10, hidden_size=12, num_layers=1, num_heads=6, num_kv_heads=4
        )
    with pytest.raises(UserError, match="rotary"):
        ModelConfig(
            family="gpt_neox",
            vocab_size=10,
            hidden_size=16,
            num_layers=1,
            num_heads=2,
            rotary_pct=0.375,
        )
    # An odd head_dim: the hidden sizes next to the one given that make it even (the first fits, as
    # said).
    with pytest.raises(
        UserError, match=r"head_dim \(now 25 = hidden_size 100 / 4 heads\): hidden_size=104 or 96$"
    ):
        ModelConfig(
            family="gpt_neox",
            vocab_size=10,
            hidden_size=100,
            num_layers=1,
            num_heads=4,
            rotary_pct=0.25,
        )
    ModelConfig(
        family="gpt_neox",
        vocab_size=10,
        hidden_size=104,
        num_layers=1,
        num_heads=4,
        rotary_pct=0.25,
    )
    with pytest.raises(UserError, match=r"even head_dim \(now 25\): head_dim=26$"):
        ModelConfig(
            family="llama", vocab_size=10, hidden_size=64, num_layers=1, num_heads=4, head_dim=25
        )


def test_missing_required_field():
    with pytest.raises(UserError, match="num_heads"):
        build({"family": "llama", "vocab_size": 100, "hidden_size": 64, "num_layers": 2})


def test_padded_vocab_size_follows_megatron():
    cfg = preset("gpt2")
    assert cfg.padded_vocab_size == 50304
    cfg.make_vocab_size_divisible_by = 1
    assert cfg.padded_vocab_size == 50257
    assert preset("llama-2-7b").padded_vocab_size == 32000


def test_shapes_the_family_cannot_export_fail_when_the_config_is_read():
    with pytest.raises(
        UserError, match="transformers rejects such a llama config, even with head_dim set"
    ):
        ModelConfig(
            family="llama", vocab_size=10, hidden_size=100, num_layers=1, num_heads=3, head_dim=32
        )
    with pytest.raises(
        UserError,
        match=r"head_dim 32 does not fit a gpt_neox model: its head_dim is always "
        r"hidden_size / num_heads \(64 / 4\)",
    ):
        ModelConfig(
            family="gpt_neox", vocab_size=10, hidden_size=64, num_layers=1, num_heads=4, head_dim=32
        )


def test_rope_scaling_is_checked_and_survives_a_dict_round_trip():
    from lmforge.config import from_dict, to_dict

    with pytest.raises(UserError, match=r"unknown rope_scaling.type 'yarm'.*did you mean 'yarn'"):
        build(
            {
                "family": "llama",
                "vocab_size": 10,
                "hidden_size": 8,
                "num_layers": 1,
                "num_heads": 2,
                "rope_scaling": {"type": "yarm"},
            }
        )
    with pytest.raises(
        UserError, match="llama3 needs rope_scaling.original_max_position_embeddings"
    ):
        build(
            {
                "family": "llama",
                "vocab_size": 10,
                "hidden_size": 8,
                "num_layers": 1,
                "num_heads": 2,
                "rope_scaling": {"type": "llama3", "factor": 8.0},
            }
        )
    cfg = preset("llama-3.1-8b")
    assert from_dict(ModelConfig, to_dict(cfg)) == cfg
    assert cfg.rope_scaling is not preset("llama-3.1-8b").rope_scaling  # a preset hands out copies


def test_layer_types_are_checked_and_spelled_one_way():
    base = {
        "family": "mistral",
        "vocab_size": 10,
        "hidden_size": 8,
        "num_layers": 2,
        "num_heads": 2,
    }
    with pytest.raises(UserError, match="layer_types has 1 entries for 2 layers"):
        build({**base, "sliding_window": 4, "layer_types": ["sliding_attention"]})
    with pytest.raises(
        UserError, match="unknown layer type 'sliding': choose one of full_attention, sliding_att"
    ):
        build({**base, "sliding_window": 4, "layer_types": ["sliding", "full_attention"]})
    with pytest.raises(
        UserError, match="names sliding_attention layers but sliding_window is not set"
    ):
        build({**base, "layer_types": ["sliding_attention", "full_attention"]})
    uniform = ModelConfig(**base, sliding_window=4, layer_types=["sliding_attention"] * 2)
    assert uniform == ModelConfig(**base, sliding_window=4) and uniform.window(1) == 4
    mixed = ModelConfig(
        **base, sliding_window=4, layer_types=["full_attention", "sliding_attention"]
    )
    assert [mixed.window(0), mixed.window(1)] == [None, 4]
