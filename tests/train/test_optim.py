"""Optimizer pieces: stochastic rounding is unbiased, AdamWSR is AdamW, decay groups, schedules."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.models import build
from lmforge.train.config import OptimConfig
from lmforge.train.optim import AdamWSR, lr_at, param_groups, stochastic_round_


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
