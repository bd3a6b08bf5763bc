"""AdamW with decay only on matrices, an LR schedule, and full-bf16 training with stochastic rounding.

Full bf16 (the NeoX/Pythia-on-Trainium recipe): weights and both Adam moments live in bf16, and
every value written back is rounded *stochastically* to bf16. Round-to-nearest would drop any
update smaller than half a bf16 ulp of the weight (|w| * 2^-9), so late in training, with small
learning rates, weights stop moving; stochastic rounding keeps each update in expectation.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lmforge.train.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on 2-D weight matrices only: no decay on norms, biases or embeddings
    (including their vocabulary padding rows), as in Megatron/GPT-NeoX."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """dst (bf16) <- src (fp32) rounded up or down with probability proportional to proximity.

    bf16 is the top 16 bits of fp32: adding uniform noise in [0, 2^16) to the low 16 bits and
    truncating rounds away from zero with probability (low bits)/2^16, so E[result] = src.
    """
    bits = src.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    rounded = (bits + noise) & -65536  # 0xFFFF0000 as a signed int32
    dst.copy_(rounded.view(torch.float32))  # exact: the low 16 bits are zero


class AdamWSR(torch.optim.Optimizer):
    """AdamW for bf16 parameters with bf16 moments, math in fp32, results stochastically rounded.

    With `stochastic_rounding=False` it rounds to nearest (plain bf16, the baseline that drifts).
    The noise comes from a generator reseeded from (seed, step), so a resumed run draws the same
    noise as an uninterrupted one without saving generator state.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 stochastic_rounding: bool = True, seed: int = 0):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed

    def _store(self, dst: torch.Tensor, value: torch.Tensor, gen: torch.Generator) -> None:
        if self.stochastic_rounding and dst.dtype == torch.bfloat16:
            stochastic_round_(dst, value, gen)
        else:
            dst.copy_(value)

    @torch.no_grad()
    def step(self, closure=None):
        gen = None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = int(state["step"].item())
                if gen is None:  # one stream per step, consumed in parameter order
                    gen = torch.Generator(device=p.device).manual_seed(self.seed * 1_000_003 + t)
                g = p.grad.float()
                m = state["exp_avg"].float().lerp_(g, 1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                w = p.float().mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
                w.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**t))
                self._store(state["exp_avg"], m, gen)
                self._store(state["exp_avg_sq"], v, gen)
                self._store(p, w, gen)


def build_optimizer(model: nn.Module, cfg: OptimConfig, precision: str, seed: int) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if precision in ("bf16-sr", "bf16"):
        return AdamWSR(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, stochastic_rounding=precision == "bf16-sr",
                       seed=seed)
    # foreach=True: one fused pass per group instead of one kernel chain per tensor.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=True)


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup to lr, then cosine/linear decay to min_lr over decay_steps, then min_lr."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    decay_steps = cfg.decay_steps or max_steps
    span = max(1, decay_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * factor
