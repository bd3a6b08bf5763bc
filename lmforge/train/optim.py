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


# Elements per chunk of AdamWSR's fused update: on a CPU the work buffers (~26 bytes per element) stay in
# cache; on an accelerator a chunk is large enough that launches are not the cost (~30 per chunk).
CPU_CHUNK = 1 << 18
ACCELERATOR_CHUNK = 1 << 24


def _stochastic_bits(src: torch.Tensor, generator: torch.Generator | None, work: dict[str, torch.Tensor]
                     ) -> torch.Tensor:
    """The bits of flat fp32 `src` rounded stochastically to bf16 (low 16 bits zero), in work["bits"]."""
    bits = src.view(torch.int32)
    n = bits.numel()
    draws = work["draws"][: (n + 3) // 4].random_(-(2**63), None, generator=generator)
    rounded = torch.add(bits, draws.view(torch.int16)[:n], out=work["bits"][:n])
    return rounded.add_(1 << 15).bitwise_and_(-65536)  # & 0xFFFF0000 as a signed int32


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """dst (bf16) <- src (fp32) rounded up or down with probability proportional to proximity.

    bf16 is the top 16 bits of fp32: adding uniform noise in [0, 2^16) to the low 16 bits and
    truncating rounds away from zero with probability (low bits)/2^16, so E[result] = src.
    The noise is 2^15 + a uniform int16, cut from full 64-bit draws: four values per draw of the
    Mersenne twister, ~3x faster than torch.randint(0, 2^16).
    """
    flat = src.contiguous().reshape(-1)
    n = flat.numel()
    work = {"draws": torch.empty((n + 3) // 4, dtype=torch.int64, device=flat.device),
            "bits": torch.empty(n, dtype=torch.int32, device=flat.device)}
    dst.copy_(_stochastic_bits(flat, generator, work).view(torch.float32).view(dst.shape))  # exact in bf16


def _chunks(tensors: list[tuple[torch.Tensor, ...]], size: int, first_only: bool = False):
    """The flat tensors laid end to end, cut every `size` elements: per chunk, its pieces (slices of each
    tuple's tensors alike), in order."""
    pieces, n = [], 0
    for row in tensors:
        numel, i = row[0].numel(), 0
        while i < numel:
            j = min(numel, i + size - n)
            pieces.append(tuple(x[i:j] for x in row))
            n += j - i
            i = j
            if n == size:
                yield pieces
                if first_only:
                    return
                pieces, n = [], 0
    if pieces:
        yield pieces


class AdamWSR(torch.optim.Optimizer):
    """AdamW for bf16 parameters with bf16 moments, math in fp32, results stochastically rounded.

    With `stochastic_rounding=False` it rounds to nearest (plain bf16, the baseline that drifts).
    The noise comes from a generator reseeded from (seed, step), so a resumed run draws the same
    noise as an uninterrupted one without saving generator state.

    One fused update per parameter group: the group's tensors are laid end to end and cut into chunks
    of `chunk_size` elements; a chunk is gathered into flat fp32 work buffers (one `_foreach_copy_` per
    operand, however many tensors it spans), updated by ~25 whole-chunk ops, and scattered back the same
    way. The per-tensor loop over 256K-element blocks it replaces made ~27 launches per block (~108k per
    step at 1B): host-bound on a GPU, where a chunk is now 16M elements (~2k launches per step at 1B; work
    buffers ~26 bytes per element, ~420 MB). On a CPU a chunk is 256K elements, so the work buffers stay in
    cache: whole-tensor fp32 temporaries (which glibc maps afresh, page fault by page fault, for every op on
    a 50k-row embedding) made a Pythia-70m step ~4x slower.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 stochastic_rounding: bool = True, seed: int = 0, chunk_size: int | None = None):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        self.chunk_size = chunk_size  # None: CPU_CHUNK or ACCELERATOR_CHUNK by the parameters' device
        # lmforge plan's fake trace updates the first chunk of each group only: every chunk goes through the
        # same work buffers, so the memory is the same, and a 20B model's chunks on fake tensors take minutes.
        self.first_chunk_only = False
        self._work: dict[str, torch.Tensor] = {}

    def _workspace(self, n: int, device: torch.device) -> dict[str, torch.Tensor]:
        if not self._work or self._work["g"].device != device or self._work["g"].numel() < n:
            self._work = {k: torch.empty(n, dtype=torch.float32, device=device) for k in ("g", "m", "v", "w", "d")}
            self._work["draws"] = torch.empty((n + 3) // 4, dtype=torch.int64, device=device)
            self._work["bits"] = torch.empty(n, dtype=torch.int32, device=device)
        return self._work

    @torch.no_grad()
    def step(self, closure=None):
        gen = None
        for group in self.param_groups:
            by_step: dict[int, list[tuple[torch.Tensor, ...]]] = {}  # flat (w, g, m, v) by step count
            copies = []  # (tensor, its contiguous copy): written back after the update
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["step"] += 1
                t = int(state["step"].item())  # a CPU tensor: no device sync
                if gen is None:  # one stream per step, consumed in chunk order
                    gen = torch.Generator(device=p.device).manual_seed(self.seed * 1_000_003 + t)
                # FSDP2 and tensor-parallel parameters are DTensors: update each rank's local shard in place.
                # A tensor-parallel gradient may be laid out unlike its parameter (a sequence-parallel norm's
                # is a partial sum, a vocabulary-parallel embedding's replicated): lay it out the same first.
                grad = p.grad
                if hasattr(grad, "placements") and grad.placements != p.placements:
                    grad = grad.redistribute(p.device_mesh, p.placements)
                row = []
                for x in (p, grad, state["exp_avg"], state["exp_avg_sq"]):
                    x = x.to_local() if hasattr(x, "to_local") else x
                    if not x.is_contiguous():  # chunks are flat views: a non-contiguous tensor goes via a copy
                        copies.append((x, x.contiguous()))
                        x = copies[-1][1]
                    row.append(x.view(-1))
                by_step.setdefault(t, []).append(tuple(row))
            for t, rows in by_step.items():
                self._update(rows, group, t, gen)
            for x, c in copies:
                x.copy_(c)

    def _update(self, rows: list[tuple[torch.Tensor, ...]], group: dict, t: int, gen: torch.Generator) -> None:
        """One AdamW step on flat (w, g, m, v) rows of one group and step count, chunk by chunk."""
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        device = rows[0][0].device
        size = self.chunk_size or (CPU_CHUNK if device.type == "cpu" else ACCELERATOR_CHUNK)
        size = min(size, sum(row[0].numel() for row in rows))
        work = self._workspace(size, device)
        for pieces in _chunks(rows, size, first_only=self.first_chunk_only):
            sizes = [piece[0].numel() for piece in pieces]
            n = sum(sizes)
            w32, g32, m32, v32, d32 = (work[k][:n] for k in ("w", "g", "m", "v", "d"))
            for i, buf in enumerate((w32, g32, m32, v32)):  # gather: one foreach copy per operand
                torch._foreach_copy_(list(buf.split(sizes)), [piece[i] for piece in pieces])
            m32.lerp_(g32, 1 - beta1)
            v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            w32.mul_(1 - lr * group["weight_decay"])
            torch.sqrt(v32, out=d32).div_(math.sqrt(1 - beta2**t)).add_(group["eps"])
            w32.addcdiv_(m32, d32, value=-lr / (1 - beta1**t))
            for i, value in ((2, m32), (3, v32), (0, w32)):  # the moments, then the weights
                dsts = [piece[i] for piece in pieces]
                if self.stochastic_rounding and any(d.dtype == torch.bfloat16 for d in dsts):
                    rounded = _stochastic_bits(value, gen, work).view(torch.float32)  # exact in bf16
                    srcs = [r if d.dtype == torch.bfloat16 else x for d, r, x in
                            zip(dsts, rounded.split(sizes), value.split(sizes), strict=True)]
                else:
                    srcs = list(value.split(sizes))
                torch._foreach_copy_(dsts, srcs)  # scatter


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
