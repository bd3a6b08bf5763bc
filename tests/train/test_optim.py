"""Optimizer pieces: stochastic rounding is unbiased, AdamWSR is AdamW, decay groups, schedules."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.models import build
from lmforge.train.config import PRECISIONS, OptimConfig
from lmforge.train.optim import AdamWSR, build_optimizer, lr_at, param_groups, stochastic_round_


@pytest.mark.parametrize(
    "value", [1.0 + 2**-10, -3.0 - 2**-9 - 2**-12, 1e-3 * (1 + 2**-11), 7.77e4]
)
def test_stochastic_rounding_is_unbiased(value):
    x = torch.full((400_000,), value, dtype=torch.float32)
    y = torch.empty_like(x, dtype=torch.bfloat16)
    stochastic_round_(y, x, torch.Generator().manual_seed(0))
    lo, hi = (
        sorted(torch.unique(y).float().tolist())[0],
        sorted(torch.unique(y).float().tolist())[-1],
    )
    # the two neighbours only
    assert set(torch.unique(y).float().tolist()) <= {lo, hi} and lo <= value <= hi
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


def test_stochastic_rounding_noise_is_independent_across_values_rows_and_steps():
    """The hash noise rounds halfway values up half of the time, and independently: neighbouring
    values, the three rows rounded together (moments and weights) and two steps' keys agree half
    of the time, not always."""
    from lmforge.train.optim import _hash_keys, _round_bits_, _round_work

    n = 200_000
    # between the bf16 values 1 and 1 + 2^-7
    halfway = torch.full((n,), 1.0 + 2**-8, dtype=torch.float32)

    def ups(seed):
        bits = halfway.repeat(3, 1).view(torch.int32)
        keys = _hash_keys(torch.Generator().manual_seed(seed), 4)
        _round_bits_(bits, 0, keys, _round_work(n, keys, bits.device))
        return bits.view(torch.float32) > 1.0

    a, b = ups(0), ups(1)
    tol = 5 * 0.5 / math.sqrt(n)
    for x, y in ((a[0, 1:], a[0, :-1]), (a[0], a[1]), (a[1], a[2]), (a[0], a[2]), (a[2], b[2])):
        assert abs(x.float().mean().item() - 0.5) < tol
        assert abs((x == y).float().mean().item() - 0.5) < tol


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
    assert lr_at(60, cfg, 110) == pytest.approx(0.55) and lr_at(35, cfg, 110) == pytest.approx(
        0.775
    )
    cfg.schedule = "constant"
    assert lr_at(80, cfg, 110) == 1.0


def test_fp32_optimizer_is_fused_adamw_with_the_reference_trajectory():
    """build_optimizer's fused AdamW (one kernel per tensor) follows torch's single-tensor AdamW."""
    torch.manual_seed(0)
    model, ref = build("tiny-neox", seed=0), build("tiny-neox", seed=0)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    opt = build_optimizer(model, cfg, PRECISIONS["fp32"], seed=0)
    assert opt.defaults["fused"]
    opt_ref = torch.optim.AdamW(
        param_groups(ref, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=cfg.eps, foreach=False
    )
    x = torch.randint(0, 1000, (2, 16))
    for _ in range(3):
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            m(x).float().square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_sr_chunks_do_not_change_the_update(dtype):
    """Updating in chunks (through the work buffers) is exact: with round-to-nearest the result
    is bitwise that of one chunk for all tensors, for any chunk size, and for a non-contiguous
    parameter."""
    torch.manual_seed(0)
    base = [
        torch.randn(37, 11).to(dtype),
        torch.randn(11, 37).to(dtype).t(),
        torch.randn(5).to(dtype),
    ]
    grads = [[torch.randn(p.shape).to(dtype) for p in base] for _ in range(3)]
    results = []
    for chunk in (7, 1 << 20):
        params = [
            torch.nn.Parameter(p.clone() if p.is_contiguous() else p.t().clone().t()) for p in base
        ]
        assert not params[1].is_contiguous()
        opt = AdamWSR(
            params, lr=1e-2, weight_decay=0.1, stochastic_rounding=False, chunk_size=chunk
        )
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
        opt = (
            AdamWSR([p], lr=1e-4, **kw)
            if dtype == torch.bfloat16
            else torch.optim.AdamW([p], lr=1e-4, weight_decay=0.0)
        )
        for _ in range(10):
            p.grad = g.clone().to(dtype)
            opt.step()
        return p.detach().double()

    # 1 - 10 * 1e-4: each update is ~1/40 of a bf16 ulp at 1.0
    exact = run(torch.float32).mean().item()
    sr = torch.stack([run(torch.bfloat16, seed=s) for s in range(8)]).mean().item()
    nearest = run(torch.bfloat16, stochastic_rounding=False).mean().item()
    assert nearest == 1.0
    assert abs(sr - exact) < 0.05 * (1 - exact)


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values either side of fp32 x: toward zero (truncated) and the next one away from
    zero."""
    down = x.view(torch.int32).bitwise_and(-65536).view(torch.float32)
    up = torch.nextafter(down.bfloat16(), x.sign().bfloat16() * float("inf")).float()
    return down, up


def _sr_params(seed: int = 0) -> list[torch.nn.Parameter]:
    """Tensors of many shapes: matrices, a non-contiguous one, vectors, a scalar, an empty shard."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 33), (33, 64), (7,), (), (0,), (300,), *[(5,)] * 20]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in shapes]
    params[1] = torch.nn.Parameter(params[1].detach().t().contiguous().t())
    return params


@pytest.mark.parametrize("chunk", [None, 100, 1000])
def test_adamw_sr_step_is_fp32_adamw_rounded_to_a_neighbour_without_bias(chunk):
    """Each step of AdamWSR on bf16 weights and moments equals torch's AdamW in fp32 on the same
    values (weights, gradients, moments, step), rounded to one of the two neighbouring bf16
    values, the weights' and both moments'; the rounding errors sum to ~0 (unbiased), where
    round-to-nearest is exact."""
    params = _sr_params()
    assert not params[1].is_contiguous()
    gen = torch.Generator().manual_seed(1)
    opt = AdamWSR(
        params, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, seed=3, chunk_size=chunk
    )
    errors, spreads = [], []
    for step in range(4):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        before = {
            p: (
                p.detach().float(),
                {k: v.float() if k != "step" else v.clone() for k, v in opt.state[p].items()},
            )
            for p in params
        }
        opt.step()
        for p in params:
            w, state = before[p]
            ref = torch.nn.Parameter(w.clone())
            ref.grad = p.grad.float()
            ref_opt = torch.optim.AdamW(
                [ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, foreach=False
            )
            if state:
                ref_opt.state[ref] = state
            ref_opt.step()
            pairs = [(p.detach(), ref.detach())] + [
                (opt.state[p][k], ref_opt.state[ref][k]) for k in ("exp_avg", "exp_avg_sq")
            ]
            for got, want in pairs:
                assert got.dtype == torch.bfloat16 and got.shape == want.shape
                down, up = _bf16_neighbours(want)
                got = got.float()
                assert torch.all((got == down) | (got == up)), (step, p.shape)
                errors.append((got - want).double().flatten())
                spreads.append((up - down).double().flatten())
    err, spread = torch.cat(errors), torch.cat(spreads)
    # Unbiased: the sum of errors within 5 standard deviations (each error has variance <= spread^2
    # / 4).
    assert abs(err.sum().item()) < 5 * (spread.square().sum() / 4).sqrt().item()
    assert (err != 0).float().mean() > 0.5  # and it did round: most results are not the fp32 value


def test_adamw_sr_is_deterministic_under_a_seed_and_resumes_bit_exact():
    """The same seed draws the same noise (also for a run resumed from the state dict at step 2);
    another seed rounds differently."""

    def run(seed, steps=4, resume_at=None):
        params = _sr_params()
        gen = torch.Generator().manual_seed(1)
        grads = [
            [torch.randn(p.shape, generator=gen).bfloat16() for p in params] for _ in range(steps)
        ]
        opt = AdamWSR(params, lr=1e-2, weight_decay=0.1, seed=seed)
        for i, step in enumerate(grads):
            # a new optimizer over copies of the weights, loaded from the state dict
            if i == resume_at:
                saved, weights = opt.state_dict(), [p.detach().clone() for p in params]
                params = [torch.nn.Parameter(w) for w in weights]
                opt = AdamWSR(params, lr=1e-2, weight_decay=0.1, seed=seed)
                opt.load_state_dict(saved)
            for p, g in zip(params, step, strict=True):
                p.grad = g
            opt.step()
        return torch.cat([p.detach().float().flatten() for p in params])

    a = run(0)
    assert torch.equal(a, run(0)) and torch.equal(a, run(0, resume_at=2))
    assert not torch.equal(a, run(1))


def test_adamw_sr_dispatches_a_few_ops_per_chunk_not_per_tensor():
    """One step over 400 small tensors (one chunk) launches as many kernels as over 4: the update
    is fused over the group (one foreach copy per operand), not ~27 launches per tensor as a loop
    over tensors. Counted: ops that are no views and touch more than the (host-side, 0-dim) step
    counters."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
            if not func.is_view and any(x.dim() for x in tensors):
                Count.ops += 1
            return func(*args, **(kwargs or {}))

    def ops(n_tensors):
        params = [torch.nn.Parameter(torch.randn(50).bfloat16()) for _ in range(n_tensors)]
        for p in params:
            p.grad = torch.randn(50).bfloat16()
        opt = AdamWSR(params, lr=1e-2)
        opt.step()  # the state is made
        Count.ops = 0
        with Count():
            opt.step()
        return Count.ops

    few, many = ops(4), ops(400)
    assert many == few < 40, (few, many)
