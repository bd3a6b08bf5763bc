"""Rotary scaling kinds (linear, dynamic, YaRN, Phi-3's LongRoPE) against transformers, YaRN's
pass-through dims, and the one line for a kind lmforge does not implement."""

from __future__ import annotations

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models import load_pretrained
from lmforge.models.hf import export_hf, import_hf
from tests.conftest import edited_copy
from tests.models.test_hf_parity import TOL, _ref_logits, _saved

tf = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "dynamic", "factor": 3.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 8.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "truncate": False,
        },
    ],
    ids=["linear", "dynamic", "yarn", "yarn_mscale"],
)
def test_rope_scaling_kinds_match_transformers(rope, tmp_path):
    """Each scaling past its context (48 positions over 32; dynamic grows its base there) and
    within it."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=32,
        rope_parameters={"rope_theta": 10000.0, **rope},
    )
    ref = tf.LlamaForCausalLM(config)
    cfg = import_hf(_saved(ref, tmp_path / "hf"), tmp_path / "lm")
    assert cfg.rope_scaling.type == rope["rope_type"]
    ours = load_pretrained(tmp_path / "lm")
    for length in (48, 20):
        ids = torch.randint(0, 300, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            assert (ours(ids) - _ref_logits(ref, ids)).abs().max().item() <= TOL
    export_hf(tmp_path / "lm", tmp_path / "out")
    before = tf.AutoConfig.from_pretrained(tmp_path / "hf").to_dict()["rope_parameters"]
    assert tf.AutoConfig.from_pretrained(tmp_path / "out").to_dict()["rope_parameters"] == before


def test_unsupported_rope_scaling_names_it_and_the_supported_kinds(hf_dirs, tmp_path):
    def proportional(c):  # Gemma 4's
        c["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 10000.0}

    folder = edited_copy(hf_dirs["llama"], tmp_path / "proportional", proportional)
    with pytest.raises(
        UserError,
        match=r"rope scaling 'proportional' in config.json is not supported: lmforge "
        r"implements default, linear, dynamic, yarn, llama3, longrope$",
    ):
        import_hf(folder, tmp_path / "lm")


def test_yarn_scales_the_rotated_pairs_only():
    """Partial rotary under YaRN: the pass-through dims stay cos 1, sin 0; the rotated ones carry
    the factor."""
    from lmforge.models.config import ModelConfig, RopeScaling
    from lmforge.models.rope import RotaryEmbedding, rotary_attention_factor

    cfg = ModelConfig(
        family="llama",
        vocab_size=10,
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        rotary_pct=0.25,
        rope_scaling=RopeScaling("yarn", 4.0, original_max_position_embeddings=16),
    )
    cos, sin = RotaryEmbedding(cfg)(torch.arange(100)[None], torch.float32)
    half = cfg.head_dim // 2
    rotated = torch.zeros(cfg.head_dim, dtype=torch.bool)
    rotated[: cfg.rotary_dim // 2] = rotated[half : half + cfg.rotary_dim // 2] = True
    assert torch.equal(cos[..., ~rotated], torch.ones_like(cos[..., ~rotated]))
    assert torch.equal(sin[..., ~rotated], torch.zeros_like(sin[..., ~rotated]))
    factor = rotary_attention_factor(cfg)
    assert factor > 1 and torch.allclose(
        cos[..., rotated].pow(2) + sin[..., rotated].pow(2),
        torch.full_like(cos[..., rotated], factor**2),
    )


def test_phi3_longrope_short_and_long_factors_match_transformers(tmp_path):
    """Phi-3 128k / Phi-3.5: the short factors within the 16-position pretraining context, the
    long ones past it (the forward's longest position decides, for every position of that
    forward), cos/sin scaled throughout."""
    from lmforge.inference import generate, left_pad

    g = torch.Generator().manual_seed(8)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": (1 + torch.rand(8, generator=g)).tolist(),
        "long_factor": (1 + 4 * torch.rand(8, generator=g)).tolist(),
    }
    torch.manual_seed(0)
    config = tf.Phi3Config(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=64,
        original_max_position_embeddings=16,
        rope_parameters=rope,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    ref = tf.Phi3ForCausalLM(config)
    cfg = import_hf(_saved(ref, tmp_path / "hf"), tmp_path / "lm")
    assert (
        cfg.rope_scaling.type == "longrope"
        and cfg.rope_scaling.original_max_position_embeddings == 16
    )
    ours = load_pretrained(tmp_path / "lm")
    for length in (12, 40):
        ids = torch.randint(0, 300, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            assert (ours(ids) - _ref_logits(ref, ids)).abs().max().item() <= TOL, length
    # 11 + 12 tokens: generation crosses 16
    prompts = [[5, 17, 33, 2, 99, 150, 7, 41, 8, 3, 4], [8, 9, 10]]
    ids, mask = left_pad(prompts, 0)
    expected = ref.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=12,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert (
        generate(ours, prompts, 12, do_sample=False, stop_token_ids=[])
        == expected[:, ids.shape[1] :].tolist()
    )
    # The continuous-batching engine stays within the short context (where rows cannot switch one
    # another).
    from lmforge.inference.engine import Engine

    assert Engine(ours, None).context == 16
    export_hf(tmp_path / "lm", tmp_path / "out")
    before = tf.AutoConfig.from_pretrained(tmp_path / "hf").to_dict()
    after = tf.AutoConfig.from_pretrained(tmp_path / "out").to_dict()
    # made explicit: 64 / 16
    assert after["rope_parameters"] == {**before["rope_parameters"], "factor": 4.0}
    assert after["original_max_position_embeddings"] == before["original_max_position_embeddings"]
