"""Optimizer pieces: stochastic rounding is unbiased, AdamWSR is AdamW, decay groups, schedules."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.models import build
from lmforge.train.config import PRECISIONS, OptimConfig
from lmforge.train.optim import AdamWSR, build_optimizer, lr_at, param_groups, stochastic_round_


@pytest.mark.parametrize("value", [1.0 + 2**-10, -3.0 - 2**-9 - 2**-12, 1e-3 * (1 + 2**-11), 7.77e4])
def test_stochastic_rounding_is_unbiased(value):
    x = torch.full((400_000,), value, dtype=torch.float32)
    y = torch.empty_like(x, dtype=torch.bfloat16)
    stochastic_round_(y, x, torch.Generator().manual_seed(0))
    lo, hi = sorted(torch.unique(y).float().tolist())[0], sorted(torch.unique(y).float().tolist())[-1]
    assert set(torch.unique(y).float().tolist()) <= {lo, hi} and lo <= value <= hi  # the two neighbours only
    # Mean within 5 standard errors of the exact value; round-to-nearest is off by far more.
    stderr = (hi - lo) / 2 / math.sqrt(len(x))
    assert abs(y.double().mean().item() - value) < 5 * stderr + 1e-12
    nearest = torch.tensor(value).to(torch.bfloat16).double().item()
    assert nearest == value or abs(nearest - value) > 20 * stderr


def test_stochastic_rounding_keeps_updates_that_nearest_rounding_loses():
    w = torch.ones(10_000, dtype=torch.bfloat16)
    sr = w.clone()
    gen = torch.Generator().manual_seed(0)
    for _ in range(100):  # each update is far below half a bf16 ulp at 1.0 (2^-8)
        w.copy_(w.float() - 1e-4)
        stochastic_round_(sr, sr.float() - 1e-4, gen)
    assert torch.all(w == 1.0)  # round-to-nearest never moved
    assert abs(sr.float().mean().item() - (1 - 100 * 1e-4)) < 1e-3


def test_adamw_sr_in_fp32_matches_torch_adamw():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt_b = AdamWSR(b.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    for _ in range(5):
        x = torch.randn(4, 16)
        for m, o in ((a, opt_a), (b, opt_b)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_weight_decay_only_on_matrices():
    model = build("tiny-gpt2", device="meta")
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed and all(n.endswith("weight") and "norm" not in n for n in decayed)
    assert "embed.weight" not in decayed and "pos_embed.weight" not in decayed
    assert no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_schedules_warm_up_then_decay_to_min_lr():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(0, cfg, 110) == pytest.approx(0.1) and lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.55)
    assert lr_at(110, cfg, 110) == pytest.approx(0.1) and lr_at(500, cfg, 110) == pytest.approx(0.1)
    cfg.schedule = "linear"
    assert lr_at(60, cfg, 110) == pytest.approx(0.55) and lr_at(35, cfg, 110) == pytest.approx(0.775)
    cfg.schedule = "constant"
    assert lr_at(80, cfg, 110) == 1.0


def test_fp32_optimizer_is_fused_adamw_with_the_reference_trajectory():
    """build_optimizer's fused AdamW (one kernel per tensor) follows torch's single-tensor AdamW."""
    torch.manual_seed(0)
    model, ref = build("tiny-neox", seed=0), build("tiny-neox", seed=0)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(model, cfg, PRECISIONS["fp32"], seed=0)
    assert opt.defaults["fused"]
    opt_ref = torch.optim.AdamW(param_groups(ref, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=cfg.eps, foreach=False)
    x = torch.randint(0, 1000, (2, 16))
    for _ in range(3):
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            m(x).float().square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_sr_blocks_do_not_change_the_update(dtype):
    """Updating in blocks (through the work buffers) is exact: with round-to-nearest the result is
    bitwise that of one block per tensor, for any block size, and for a non-contiguous parameter."""
    torch.manual_seed(0)
    base = [torch.randn(37, 11).to(dtype), torch.randn(11, 37).to(dtype).t(), torch.randn(5).to(dtype)]
    grads = [[torch.randn(p.shape).to(dtype) for p in base] for _ in range(3)]
    results = []
    for block in (7, 1 << 20):
        params = [torch.nn.Parameter(p.clone() if p.is_contiguous() else p.t().clone().t()) for p in base]
        assert not params[1].is_contiguous()
        opt = AdamWSR(params, lr=1e-2, weight_decay=0.1, stochastic_rounding=False, block_size=block)
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_adamw_sr_keeps_bf16_updates_in_expectation():
    """Full bf16 with stochastic rounding: over many seeds, the mean bf16 weight after some small
    AdamW steps is the fp32 AdamW weight; round-to-nearest loses the updates entirely."""
    w0 = torch.full((4096,), 1.0)
    g = torch.full((4096,), 1e-3)

    def run(dtype, **kw):
        p = torch.nn.Parameter(w0.clone().to(dtype))
        opt = (AdamWSR([p], lr=1e-4, **kw) if dtype == torch.bfloat16 else torch.optim.AdamW([p], lr=1e-4,
                                                                                              weight_decay=0.0))
        for _ in range(10):
            p.grad = g.clone().to(dtype)
            opt.step()
        return p.detach().double()

    exact = run(torch.float32).mean().item()  # 1 - 10 * 1e-4: each update is ~1/40 of a bf16 ulp at 1.0
    sr = torch.stack([run(torch.bfloat16, seed=s) for s in range(8)]).mean().item()
    nearest = run(torch.bfloat16, stochastic_rounding=False).mean().item()
    assert nearest == 1.0
    assert abs(sr - exact) < 0.05 * (1 - exact)
