"""Partial rotary as one full-head rotation: a rotation, relative, and equal to slicing."""

from __future__ import annotations

import pytest
import torch

from lmforge.models.config import ModelConfig
from lmforge.models.rope import RotaryEmbedding, apply_rotary, rotary_permutation, rotate_half


def _cfg(head_dim: int, pct: float, interleaved: bool = False) -> ModelConfig:
    return ModelConfig(
        family="gpt_neox",
        vocab_size=128,
        hidden_size=head_dim * 2,
        num_layers=1,
        num_heads=2,
        rotary_pct=pct,
        rotary_interleaved=interleaved,
    )


def _rotated(rope: RotaryEmbedding, x: torch.Tensor, pos: int) -> torch.Tensor:
    cos, sin = rope(torch.tensor([[pos]]), torch.float32)
    return apply_rotary(x[None, None, None], cos, sin)[0, 0, 0]


@pytest.mark.parametrize("pct", [0.25, 0.5, 1.0])
def test_qk_depends_only_on_relative_position(pct):
    cfg = _cfg(64, pct)
    rope = RotaryEmbedding(cfg)
    q, k = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    near = _rotated(rope, q, 5) @ _rotated(rope, k, 2)
    far = _rotated(rope, q, 105) @ _rotated(rope, k, 102)
    assert torch.allclose(near, far, atol=1e-4), (near, far)
    # A rotation keeps norms.
    assert torch.allclose(_rotated(rope, q, 77).norm(), q.norm(), atol=1e-5)


def test_unpermuted_pairing_is_the_trap():
    """Feeding checkpoint-ordered dims to a full-head rotate_half (no permutation) pairs a rotated
    dim with a pass-through one: q.k then depends on absolute position. This is what we avoid."""
    head_dim, r = 64, 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))

    def naive(x, pos):  # checkpoint's cos/sin on the first r dims, identity elsewhere
        f = pos * inv_freq
        cos = torch.cat([f.cos(), f.cos(), torch.ones(head_dim - r)])
        sin = torch.cat([f.sin(), f.sin(), torch.zeros(head_dim - r)])
        return x * cos + rotate_half(x) * sin

    q, k = torch.randn(2, head_dim, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(naive(q, 5) @ naive(k, 2), naive(q, 105) @ naive(k, 102), atol=1e-3)


def _neox_sliced(x, pos, r, base=10000.0):
    """transformers' GPT-NeoX: rotate the first r dims (pairs i, i + r/2), pass the rest."""
    inv_freq = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float) / r))
    f = pos[:, None].float() * inv_freq
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], -1)


def _gptj_sliced(x, pos, r):
    """transformers' GPT-J: rotate-every-two on the first r dims (pairs 2i, 2i+1)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.int64) / r))
    f = pos[:, None].float() * inv_freq
    cos, sin = f.cos().repeat_interleave(2, -1), f.sin().repeat_interleave(2, -1)
    rot, rest = x[..., :r], x[..., r:]
    every_two = torch.stack((-rot[..., 1::2], rot[..., ::2]), -1).flatten(-2)
    return torch.cat([rot * cos + every_two * sin, rest], -1)


@pytest.mark.parametrize(
    ("head_dim", "pct", "interleaved"),
    [(64, 0.25, False), (128, 0.25, False), (16, 0.5, False), (256, 0.25, True), (32, 1.0, True)],
)
def test_full_head_rotation_equals_sliced_after_permutation(head_dim, pct, interleaved):
    cfg = _cfg(head_dim, pct, interleaved)
    perm = rotary_permutation(head_dim, cfg.rotary_dim, interleaved)
    x = torch.randn(3, 40, head_dim, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(40) * 7
    cos, sin = RotaryEmbedding(cfg)(pos[None], torch.float32)
    ours = apply_rotary(x[:, :, perm][None], cos, sin)[0]
    sliced = (_gptj_sliced if interleaved else _neox_sliced)(x, pos, cfg.rotary_dim)
    assert (ours - sliced[:, :, perm]).abs().max().item() <= 1e-5


def test_permutation_is_a_bijection_and_trivial_for_full_neox_rotary():
    for head_dim, r, inter in [(64, 16, False), (256, 64, True), (128, 32, False)]:
        perm = rotary_permutation(head_dim, r, inter)
        assert sorted(perm.tolist()) == list(range(head_dim))
    assert torch.equal(rotary_permutation(64, 64, False), torch.arange(64))


def test_a_bf16_model_keeps_fp32_frequencies():
    """model.to(bf16) must not round the rotary frequencies: transformers keeps them fp32, and
    bf16 ones put the angle at position 4095 radians off."""
    from lmforge.models import build
    from lmforge.models.rope import rotary_inv_freq

    model = build("tiny-llama", seed=0).to(torch.bfloat16)
    assert model.rope.inv_freq.dtype == torch.float32
    assert torch.equal(model.rope.inv_freq, rotary_inv_freq(model.config))
    positions = torch.tensor([[0, 2047, 4095]])
    cos, sin = model.rope(positions, torch.bfloat16)
    freqs = positions[..., None].float() * rotary_inv_freq(model.config)
    emb = torch.cat((freqs, freqs), -1)[:, None]
    assert torch.equal(cos, emb.cos().bfloat16()) and torch.equal(sin, emb.sin().bfloat16())
    model.to(torch.float32).to(torch.bfloat16)  # a round trip changes nothing either
    assert torch.equal(model.rope.inv_freq, rotary_inv_freq(model.config))


def test_frequencies_stay_fp32_on_the_test_device(test_device):
    """model.to(device, bf16) keeps the rotary frequencies fp32 on any device
    (LMFORGE_TEST_DEVICE=cuda: CUDA)."""
    from conftest import tolerance

    cfg = _cfg(64, 0.25)
    rope = RotaryEmbedding(cfg).to(test_device, torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32 and rope.inv_freq.device.type == test_device.type
    pos = torch.arange(4090, 4096, device=test_device)[None]
    cos, _ = rope(pos, torch.float32)
    reference, _ = RotaryEmbedding(cfg)(pos.cpu(), torch.float32)
    torch.testing.assert_close(cos.cpu(), reference, **tolerance(test_device, torch.float32))
