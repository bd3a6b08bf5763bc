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

from lmforge.train.config import OptimConfig, Precision


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on 2-D weight matrices only: no decay on norms, biases or embeddings
    (including their vocabulary padding rows), as in Megatron/GPT-NeoX."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # A pipeline stage may hold no parameter of a kind; torch's state-dict helpers cannot name an empty group.
    return [g for g in groups if g["params"]]


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None,
                      work: dict[str, torch.Tensor] | None = None) -> None:
    """dst (bf16) <- src (fp32) rounded up or down with probability proportional to proximity.

    bf16 is the top 16 bits of fp32: adding uniform noise in [0, 2^16) to the low 16 bits and
    truncating rounds away from zero with probability (low bits)/2^16, so E[result] = src.
    The noise is 2^15 + a uniform int16, cut from full 64-bit draws: four values per draw of the
    Mersenne twister, ~3x faster than torch.randint(0, 2^16). `work` (AdamWSR's): preallocated
    "draws" (int64) and "bits" (int32) buffers at least this large, instead of new tensors.
    """
    bits = src.contiguous().view(torch.int32).reshape(-1)
    n = bits.numel()
    if work is None:
        work = {"draws": torch.empty((n + 3) // 4, dtype=torch.int64, device=bits.device),
                "bits": torch.empty(n, dtype=torch.int32, device=bits.device)}
    draws = work["draws"][: (n + 3) // 4].random_(-(2**63), None, generator=generator)
    rounded = torch.add(bits, draws.view(torch.int16)[:n], out=work["bits"][:n])
    rounded.add_(1 << 15).bitwise_and_(-65536)  # & 0xFFFF0000 as a signed int32
    dst.copy_(rounded.view(torch.float32).view(dst.shape))  # exact: the low 16 bits are zero


class AdamWSR(torch.optim.Optimizer):
    """AdamW for bf16 parameters with bf16 moments, math in fp32, results stochastically rounded.

    With `stochastic_rounding=False` it rounds to nearest (plain bf16, the baseline that drifts).
    The noise comes from a generator reseeded from (seed, step), so a resumed run draws the same
    noise as an uninterrupted one without saving generator state.

    Tensors are updated in blocks of `block_size` elements through fp32 work buffers allocated once,
    so blocks stay in cache and no op allocates. Whole-tensor fp32 temporaries (which glibc maps
    afresh, page fault by page fault, for every op on a 50k-row embedding) and torch.randint noise
    made a Pythia-70m step take ~3.1 s of CPU time (one thread); blocks and cheaper noise ~0.7 s.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 stochastic_rounding: bool = True, seed: int = 0, block_size: int = 1 << 18):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self.block_size = block_size
        # lmforge plan's fake trace updates each tensor's first block only: every block goes through the same
        # work buffers, so the memory is the same, and a 20B model's blocks on fake tensors take minutes.
        self.first_block_only = False
        self._work: dict[str, torch.Tensor] = {}

    def _workspace(self, device: torch.device) -> dict[str, torch.Tensor]:
        n = self.block_size
        if not self._work or self._work["g"].device != device:
            self._work = {k: torch.empty(n, dtype=torch.float32, device=device) for k in ("g", "m", "v", "w", "d")}
            self._work["draws"] = torch.empty((n + 3) // 4, dtype=torch.int64, device=device)
            self._work["bits"] = torch.empty(n, dtype=torch.int32, device=device)
        return self._work

    @torch.no_grad()
    def step(self, closure=None):
        gen = None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                t = int(state["step"].item())
                if gen is None:  # one stream per step, consumed in parameter order
                    gen = torch.Generator(device=p.device).manual_seed(self.seed * 1_000_003 + t)
                # FSDP2 and tensor-parallel parameters are DTensors: update each rank's local shard in place.
                # A tensor-parallel gradient may be laid out unlike its parameter (a sequence-parallel norm's
                # is a partial sum, a vocabulary-parallel embedding's replicated): lay it out the same first.
                grad = p.grad
                if hasattr(grad, "placements") and grad.placements != p.placements:
                    grad = grad.redistribute(p.device_mesh, p.placements)
                w, g, m, v = (x.to_local() if hasattr(x, "to_local") else x
                              for x in (p, grad, state["exp_avg"], state["exp_avg_sq"]))
                # Blocks are flat views of w, m, v themselves: a non-contiguous one is updated as a copy.
                flat = [x if x.is_contiguous() else x.contiguous() for x in (w, m, v)]
                self._update(flat[0], g, flat[1], flat[2], group, t, gen)
                for x, f in zip((w, m, v), flat, strict=True):
                    if f is not x:
                        x.copy_(f)

    def _update(self, w, g, m, v, group: dict, t: int, gen: torch.Generator) -> None:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        work = self._workspace(w.device)
        w, g, m, v = (x.reshape(-1) for x in (w, g, m, v))  # views of w, m, v (contiguous)
        for i in range(0, self.block_size if self.first_block_only else w.numel(), self.block_size):
            j = min(w.numel(), i + self.block_size)
            g32, m32, v32, w32, d32 = (work[k][: j - i] for k in ("g", "m", "v", "w", "d"))
            g32.copy_(g[i:j])
            m32.copy_(m[i:j]).lerp_(g32, 1 - beta1)
            v32.copy_(v[i:j]).mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            w32.copy_(w[i:j]).mul_(1 - lr * group["weight_decay"])
            torch.sqrt(v32, out=d32).div_(math.sqrt(1 - beta2**t)).add_(group["eps"])
            w32.addcdiv_(m32, d32, value=-lr / (1 - beta1**t))
            for dst, value in ((m[i:j], m32), (v[i:j], v32), (w[i:j], w32)):
                if self.stochastic_rounding and dst.dtype == torch.bfloat16:
                    stochastic_round_(dst, value, gen, work)
                else:
                    dst.copy_(value)


def build_optimizer(model: nn.Module, cfg: OptimConfig, precision: Precision, seed: int) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if precision.param_dtype == torch.bfloat16:  # bf16 weights and moments: AdamWSR keeps the update in fp32
        return AdamWSR(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                       stochastic_rounding=precision.stochastic_rounding, seed=seed)
    # fused=True: one pass over each tensor (CPU and GPU kernels). foreach falls back to a chain of
    # per-tensor ops on CPU: ~7x slower for Pythia-70m (BENCHMARKS.md, training section).
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)


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
