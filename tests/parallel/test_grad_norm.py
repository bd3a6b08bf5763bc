"""The global gradient norm does not depend on how a gradient is cut into shards (clipping, and
so every step after it, would otherwise differ between layouts), and is accurate to fp64 on an
embedding-sized gradient."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lmforge.parallel.state import _sum_of_squares, grad_norm


def _skewed_gradient(rows: int = 50432, width: int = 64) -> torch.Tensor:
    """An lm_head-like gradient: millions of small entries, a few frequent tokens' rows much
    larger."""
    g = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)) * 1e-4
    g[:2000] *= 100
    return g


def test_sum_of_squares_is_accurate_and_the_same_for_every_cut():
    g = _skewed_gradient()
    exact = g.double().pow(2).sum().item()
    whole = _sum_of_squares(g).item()
    # torch's fp32 vector_norm on CPU: ~2e-3 off in squares here
    assert abs(whole - exact) / exact < 2e-6
    for shards in (2, 4, 8):  # FSDP / vocab-parallel shards of the same rows
        cut = sum(_sum_of_squares(part).item() for part in g.chunk(shards))
        assert abs(cut - exact) / exact < 2e-6, shards


def test_grad_norm_of_a_single_process_model():
    model = torch.nn.Linear(64, 50432, bias=True)
    model.weight.grad = _skewed_gradient().clone()
    model.bias.grad = torch.full((50432,), 1e-3)
    pm = SimpleNamespace(parts=[model], device=torch.device("cpu"), mesh=None)
    exact = (model.weight.grad.double().pow(2).sum() + 50432e-6).sqrt().item()
    assert abs(grad_norm(pm).item() - exact) / exact < 1e-6
