"""AdamW with decay only on matrices, an LR schedule, and full-bf16 training with stochastic
rounding.

Full bf16 (the NeoX/Pythia-on-Trainium recipe): weights and both Adam moments live in bf16, and
every value written back is rounded *stochastically* to bf16. Round-to-nearest would drop any
update smaller than half a bf16 ulp of the weight (|w| * 2^-9), so late in training, with small
learning rates, weights stop moving; stochastic rounding keeps each update in expectation.

Under FSDP2 and tensor parallelism the parameters are DTensors: `AdamWSR.step` updates each rank's
local shard in place. A tensor-parallel gradient may be laid out unlike its parameter (a
sequence-parallel norm's is a partial sum, a vocabulary-parallel embedding's replicated): it is laid
out the same first.
"""

from __future__ import annotations

import itertools
import logging
import math

import torch
from torch import nn

from lmforge.train import optim_kernel, optim_triton
from lmforge.train.config import OptimConfig, Precision
from lmforge.train.optim_kernel import HASH_C1, HASH_C2, bf16_rows, kernel_scalars

log = logging.getLogger(__name__)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on 2-D weight matrices only: no decay on norms, biases or embeddings
    (including their vocabulary padding rows), as in Megatron/GPT-NeoX. Each kind is split
    further by by_mesh (expert-parallel experts beside FSDP or DDP weights)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [
        {"params": part, "weight_decay": wd}
        for kind, wd in ((decay, weight_decay), (no_decay, 0.0))
        for part in by_mesh(kind)
    ]
    # A pipeline stage may hold no parameter of a kind; torch's state-dict helpers cannot name an
    # empty group.
    return [g for g in groups if g["params"]]


def by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` split by the DeviceMesh they are DTensors on (plain tensors together), in order
    of first appearance: torch's foreach and fused optimizer kernels take one list of tensors
    that must be all plain or all DTensors of one mesh."""
    from torch.distributed.tensor import DTensor

    out: dict[object, list[torch.Tensor]] = {}
    for p in params:
        out.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(out.values()) or [[]]


# Elements per chunk of AdamWSR's fused update: on a CPU the work buffers (~36 bytes per element, ~9
# MB) stay in the last-level cache (16K-64K chunks, in L2, measured slower: the per-op dispatch); on
# an accelerator a chunk is large enough that launches are not the cost (~23 per chunk).
CPU_CHUNK = 1 << 18
ACCELERATOR_CHUNK = 1 << 24
# With compiled=None, the compiled CPU update (optim_kernel.py) is used from this many parameters
# on: it costs seconds to build once per machine, and below this a whole eager step takes
# milliseconds.
KERNEL_MIN_PARAMS = 1 << 22


# Noise for stochastic rounding: a counter-based hash, (((counter + k0) * C1) ^ k) * C2, whose top
# 16 bits are the noise. Both multipliers are odd, so for a uniform key each step is a bijection of
# 32-bit integers and the noise is exactly uniform in [0, 2^16): the rounding stays unbiased. It is
# no cryptographic generator, but it costs ~6 int32 passes over a chunk in cache (~0.4 ns per
# element on one CPU core), where drawing 16 bits per element from torch's Mersenne twister cost ~1
# ns and adding its int16 draws to int32 bits ~3 ns. HASH_C1 and HASH_C2 live in optim_kernel.py,
# which the compiled updates share.


def _int32(x: int) -> int:
    """x modulo 2^32 as a signed int32 (torch refuses scalars outside an int32 tensor's range)."""
    return (x + 2**31) % 2**32 - 2**31


def _hash_keys(generator: torch.Generator | None, n: int) -> list[int]:
    """n 32-bit keys from `generator` (a CPU generator: the same keys, and noise, on every
    device)."""
    return torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=generator).tolist()


def _round_bits_(
    bits: torch.Tensor, first: int, keys: list[int], work: dict[str, torch.Tensor]
) -> None:
    """Round fp32 values (their int32 bit patterns, `bits`, shape (r, n)) stochastically to bf16
    in place: row j gets the noise of key keys[j + 1] at counters first, first+1, ... (keys[0]
    offsets the counters; the key column work["keys"] holds keys[1:r + 1])."""
    rows, n = bits.shape
    # (counter + k0) * C1 = counter * C1 + k0 * C1 (mod 2^32): work["counter"] holds counter * C1
    base = torch.add(work["counter"][:n], _int32((first + keys[0]) * HASH_C1), out=work["base"][:n])
    noise = torch.bitwise_xor(base, work["keys"][:rows], out=work["noise"][:rows, :n]).mul_(HASH_C2)
    noise.bitwise_right_shift_(16).bitwise_and_(0xFFFF)  # the top 16 bits, in [0, 2^16)
    bits.add_(noise).bitwise_and_(-65536)  # & 0xFFFF0000 as a signed int32: truncate to bf16


def _round_work(n: int, keys: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """Buffers for _round_bits_ on up to n counters, one noise row per key after the first."""
    return {
        "counter": torch.arange(n, dtype=torch.int32, device=device).mul_(HASH_C1),
        "base": torch.empty(n, dtype=torch.int32, device=device),
        "noise": torch.empty(len(keys) - 1, n, dtype=torch.int32, device=device),
        "keys": torch.tensor([_int32(k) for k in keys[1:]], dtype=torch.int32)
        .view(-1, 1)
        .to(device),
    }


def stochastic_round_(
    dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None
) -> None:
    """dst (bf16) <- src (fp32) rounded up or down with probability proportional to proximity.

    bf16 is the top 16 bits of fp32: adding uniform noise in [0, 2^16) to the low 16 bits and
    truncating rounds away from zero with probability (low bits)/2^16, so E[result] = src.
    The noise is the hash above, keyed by two draws of `generator` (a CPU generator).
    """
    bits = src.to(torch.float32, copy=True).reshape(1, -1).view(torch.int32)
    keys = _hash_keys(generator, 2)
    _round_bits_(bits, 0, keys, _round_work(bits.shape[1], keys, bits.device))
    dst.copy_(bits.view(torch.float32).view(dst.shape))  # exact in bf16


def correct_sqrt(
    x: torch.Tensor, out: torch.Tensor, work: torch.Tensor | None = None
) -> torch.Tensor:
    """out <- the fp32 square root of fp32 x, correctly rounded (IEEE), as the compiled update
    and CUDA compute it.

    torch's CPU sqrt goes through MKL's vector math on x86 builds and is one fp32 ulp off for
    ~20% of inputs (torch 2.13, AVX-512): AdamW's denominator would then depend on the build and
    the machine. In fp64 then rounded to fp32 it is exact: 53 bits leave the double rounding no
    room to err for a square root. `work` is an fp64 buffer like x (made when not given); on an
    accelerator torch's fp32 sqrt is correctly rounded already."""
    if x.device.type != "cpu":
        return torch.sqrt(x, out=out)
    work = torch.empty_like(x, dtype=torch.float64) if work is None else work
    return out.copy_(work.copy_(x).sqrt_())


def _chunks(tensors: list[tuple[torch.Tensor, ...]], size: int, first_only: bool = False):
    """The flat tensors laid end to end, cut every `size` elements: per chunk, its pieces (slices
    of each tuple's tensors alike), in order."""
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
    The noise is a hash of each value's place in the step (its counter) under keys drawn from a
    generator reseeded from (seed, step): a resumed run draws the same noise as an uninterrupted one
    without saving generator state, and every rank and device the same keys (replicated shards stay
    equal).

    One fused update per parameter group: the group's tensors are laid end to end and cut into
    chunks of `chunk_size` elements; a chunk is gathered into flat fp32 work buffers (one
    `_foreach_copy_` per operand, however many tensors it spans), updated by ~16 whole-chunk ops
    (the moments and weights rounded together, as one (3, n) block), and scattered back the same
    way. The per-tensor loop over 256K-element blocks it replaces made ~27 launches per block (~108k
    per step at 1B): host-bound on a GPU, where a chunk is now 16M elements (~1.5k launches per step
    at 1B; work buffers ~36 bytes per element, ~600 MB). On a CPU a chunk is 256K elements, so the
    work buffers stay in cache: whole-tensor fp32 temporaries (which glibc maps afresh, page fault
    by page fault, for every op on a 50k-row embedding) made a Pythia-70m step ~4x slower.

    The update of each bf16 tensor is instead one compiled pass (lmforge.train.optim_kernel, as
    torch's fused AdamW makes): a C++ loop on a CPU (the eager update's bits), torch.compile's
    Triton kernel on a GPU (the same arithmetic); `compiled=True` always, `False` never, None
    (default) from KERNEL_MIN_PARAMS parameters on. Where it cannot be built, or fails to compile,
    the eager update runs, with a warning. On a GPU with Triton the compiled update is one launch
    per group over all its bf16 tensors (lmforge.train.optim_triton: the C++ loop's arithmetic and
    bits), where a compiled function called per tensor paid its Python wrappers 196 times a step at
    Pythia-1B; `multi_tensor=False` (or LMFORGE_ADAMWSR_MULTI_TENSOR=0) keeps the per-tensor calls.
    """

    def __init__(
        self,
        params,
        lr: float,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        stochastic_rounding: bool = True,
        seed: int = 0,
        chunk_size: int | None = None,
        compiled: bool | None = None,
        multi_tensor: bool = True,
    ):
        super().__init__(
            params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        )
        self.compiled = compiled
        # on a GPU with Triton: one launch per group (optim_triton)
        self.multi_tensor = multi_tensor
        # the multi-tensor kernel failed once: the per-tensor calls from then on
        self._multi_failed = False
        self.stochastic_rounding = stochastic_rounding
        self.seed = seed
        # None: CPU_CHUNK or ACCELERATOR_CHUNK by the parameters' device
        self.chunk_size = chunk_size
        # lmforge plan's fake trace updates each group's first chunk only: every chunk uses the same
        # work buffers (the same memory), and a 20B model's chunks on fake tensors take minutes.
        self.first_chunk_only = False
        self._work: dict[str, torch.Tensor] = {}
        # the accelerator's compiled update failed once: eager from then on
        self._compile_failed = False
        # the compiled update's per-row noise keys, on its device
        self._keys: list[torch.Tensor] = []

    def _workspace(self, n: int, device: torch.device, keys: list[int]) -> dict[str, torch.Tensor]:
        if not self._work or self._work["g"].device != device or self._work["g"].numel() < n:
            self._work = {k: torch.empty(n, dtype=torch.float32, device=device) for k in ("g", "d")}
            # rounded in one go
            self._work["mvw"] = torch.empty(3, n, dtype=torch.float32, device=device)
            if device.type == "cpu":
                # for correct_sqrt
                self._work["d64"] = torch.empty(n, dtype=torch.float64, device=device)
            self._work |= _round_work(n, keys, device)
            # the denominator is spent by then
            self._work["base"] = self._work["d"].view(torch.int32)
        else:
            self._work["keys"].copy_(
                torch.tensor([_int32(k) for k in keys[1:]], dtype=torch.int32).view(-1, 1)
            )
        return self._work

    @torch.no_grad()
    def step(self, closure=None):
        keys = None
        self._counter = 0  # the noise's counters run on over the step's chunks, group after group
        for group in self.param_groups:
            # flat (w, g, m, v) by step count
            by_step: dict[int, list[tuple[torch.Tensor, ...]]] = {}
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
                if keys is None:  # the step's noise keys, the same on every rank and device
                    keys = _hash_keys(torch.Generator().manual_seed(self.seed * 1_000_003 + t), 4)
                # DTensors (FSDP2, TP): the local shard updated in place, the gradient first laid
                # out like it (a sequence-parallel norm's is a partial sum; module docstring).
                grad = p.grad
                if hasattr(grad, "placements") and grad.placements != p.placements:
                    grad = grad.redistribute(p.device_mesh, p.placements)
                row = []
                for x in (p, grad, state["exp_avg"], state["exp_avg_sq"]):
                    x = x.to_local() if hasattr(x, "to_local") else x
                    # chunks are flat views: a non-contiguous tensor goes via
                    # a copy
                    if not x.is_contiguous():
                        copies.append((x, x.contiguous()))
                        x = copies[-1][1]
                    row.append(x.view(-1))
                by_step.setdefault(t, []).append(tuple(row))
            for t, rows in by_step.items():
                self._update(rows, group, t, keys)
            for x, c in copies:
                x.copy_(c)

    def _kernel(self, device: torch.device):
        """The compiled update where this step should use it, as fn(row, scalars, keys, sr), else
        None: the C++ loop on a CPU, torch.compile's (Triton) kernel on a GPU."""
        if self.compiled is False or self.first_chunk_only or self._compile_failed:
            return None
        if device.type != "cpu" and device.type not in optim_kernel.COMPILED_DEVICES:
            return None
        if (
            self.compiled is None
            and sum(p.numel() for g in self.param_groups for p in g["params"]) < KERNEL_MIN_PARAMS
        ):
            return None
        if device.type in optim_kernel.COMPILED_DEVICES:
            update = optim_kernel.compiled_update(device.type)
            return None if update is None else lambda row, s, k, sr: update(*row, s, k, sr)
        kernel = optim_kernel.cpu_kernel()
        return (
            None
            if kernel is None
            else lambda row, s, k, sr: kernel(*row, s, k, row[0].numel(), int(sr))
        )

    def _update(
        self, rows: list[tuple[torch.Tensor, ...]], group: dict, t: int, keys: list[int]
    ) -> None:
        """One AdamW step on flat (w, g, m, v) rows of one group and step count: each bf16 row by
        the compiled update where there is one, the others chunk by chunk (the noise's counters
        run on alike)."""
        device = rows[0][0].device
        kernel = self._kernel(device)
        if kernel is None:
            return self._update_chunks(rows, group, t, keys)
        scalars = _to_device(
            kernel_scalars(group["lr"], group["betas"], group["eps"], group["weight_decay"], t),
            device,
        )
        # Per row: its first counter, hashed, then the three keys.
        firsts = list(itertools.accumulate((row[0].numel() for row in rows), initial=self._counter))
        table = torch.tensor(
            [
                [_int32((first + keys[0]) * HASH_C1)] + [_int32(k) for k in keys[1:4]]
                for first, _ in zip(firsts, rows)
            ],
            dtype=torch.int32,
        )
        fits = bf16_rows(rows)
        done = self._run_rows(device, rows, fits, scalars, table)
        if len(done) < len(rows):
            table = self._row_keys(_to_device(table, device))
        for i, row in enumerate(rows):  # each row from its own first counter, whichever way it goes
            # an empty bf16 row (a shard with nothing here) is done as it is
            self._counter = firsts[i]
            if not (
                i in done
                or fits[i]
                and (not row[0].numel() or self._run(kernel, row, scalars, table[i]))
            ):
                self._update_chunks([row], group, t, keys)
        self._counter = firsts[-1]

    def _run_rows(
        self,
        device: torch.device,
        rows: list[tuple[torch.Tensor, ...]],
        fits: list[bool],
        scalars: torch.Tensor,
        table: torch.Tensor,
    ) -> set[int]:
        """On a GPU with Triton: the bf16 rows stepped by one launch of the multi-tensor kernel
        (their indices; `table` holds every row's keys, on the CPU), else none. A first failure
        is logged once; the per-tensor calls go on."""
        take = [i for i, row in enumerate(rows) if fits[i] and row[0].numel()]
        if not (
            take and self.multi_tensor and not self._multi_failed and optim_triton.usable(device)
        ):
            return set()
        try:
            optim_triton.update_rows(
                [rows[i] for i in take], scalars, table[take], self.stochastic_rounding
            )
        # a Triton failure: the per-tensor update gives the same step
        except optim_triton.PartlyDone as e:
            if isinstance(e.cause, torch.OutOfMemoryError):
                raise e.cause from None
            self._multi_failed = True
            log.warning(
                "AdamWSR: the multi-tensor Triton update failed on %s (%s: %s): one compiled call per tensor "
                "runs instead (the same arithmetic)",
                device,
                type(e.cause).__name__,
                (str(e.cause).strip().splitlines() or [""])[0][:200],
            )
            # stepped by a launch before the one that failed: not again
            return {take[i] for i in e.done}
        return set(take)

    def _row_keys(self, table: torch.Tensor) -> list[torch.Tensor]:
        """The rows of a key table on the device as tensors of their own, filled by one foreach
        copy: torch.compile guards on a view's storage offset where it equals another input's
        size, and views of one table made it compile again for some rows."""
        n, pool = table.shape[0], self._keys
        if len(pool) < n or pool[0].device != table.device:
            pool = self._keys = [
                torch.empty(4, dtype=torch.int32, device=table.device) for _ in range(n)
            ]
        torch._foreach_copy_(pool[:n], list(table.unbind(0)))
        return pool[:n]

    def _run(
        self, kernel, row: tuple[torch.Tensor, ...], scalars: torch.Tensor, keys: torch.Tensor
    ) -> bool:
        """Whether the compiled update stepped this row: after a first failure (a compiler error:
        it raises before writing anything) the eager update takes this and every later row, with
        one warning."""
        if self._compile_failed:
            return False
        try:
            kernel(row, scalars, keys, self.stochastic_rounding)
            return True
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 (any compiler failure: the eager update gives the same step)
            self._compile_failed = True
            log.warning(
                "AdamWSR: the compiled update failed on %s (%s: %s): the eager update runs instead (the same "
                "arithmetic, ~30 passes per value)",
                row[0].device,
                type(e).__name__,
                (str(e).strip().splitlines() or [""])[0][:200],
            )
            return False

    def _update_chunks(
        self, rows: list[tuple[torch.Tensor, ...]], group: dict, t: int, keys: list[int]
    ) -> None:
        """One AdamW step on flat (w, g, m, v) rows of one group and step count, chunk by chunk."""
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        device = rows[0][0].device
        size = self.chunk_size or (CPU_CHUNK if device.type == "cpu" else ACCELERATOR_CHUNK)
        size = min(size, sum(row[0].numel() for row in rows))
        work = self._workspace(size, device, keys)
        for pieces in _chunks(rows, size, first_only=self.first_chunk_only):
            sizes = [piece[0].numel() for piece in pieces]
            n = sum(sizes)
            mvw = work["mvw"][:, :n]
            m32, v32, w32 = mvw
            g32, d32 = work["g"][:n], work["d"][:n]
            # gather: one foreach copy per operand
            for i, buf in ((0, w32), (1, g32), (2, m32), (3, v32)):
                torch._foreach_copy_(list(buf.split(sizes)), [piece[i] for piece in pieces])
            # torch's AdamW, op for op (its single-tensor form), with a correctly rounded square
            # root.
            m32.lerp_(g32, 1 - beta1)
            v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            w32.mul_(1 - lr * group["weight_decay"])
            correct_sqrt(v32, out=d32, work=work["d64"][:n] if "d64" in work else None)
            d32.div_(math.sqrt(1 - beta2**t)).add_(group["eps"])
            w32.addcdiv_(m32, d32, value=-lr / (1 - beta1**t))
            # the moments, then the weights
            dsts = [[piece[i] for piece in pieces] for i in (2, 3, 0)]
            take = range(len(pieces))
            if self.stochastic_rounding and any(d.dtype == torch.bfloat16 for d in dsts[0]):
                # a parameter and its moments share a dtype; fp32 ones take the fp32 results, before
                # the rounding
                keep = [i for i, d in enumerate(dsts[0]) if d.dtype != torch.bfloat16]
                for d, parts in zip(dsts, (value.split(sizes) for value in mvw), strict=True):
                    if keep:
                        torch._foreach_copy_([d[i] for i in keep], [parts[i] for i in keep])
                _round_bits_(mvw.view(torch.int32), self._counter, keys, work)  # exact in bf16 now
                take = [i for i, d in enumerate(dsts[0]) if d.dtype == torch.bfloat16]
            for d, parts in zip(dsts, (value.split(sizes) for value in mvw), strict=True):
                torch._foreach_copy_([d[i] for i in take], [parts[i] for i in take])  # scatter
            self._counter += n


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU tensor on `device` without waiting for the device: a copy from pageable memory
    would synchronise the stream each step (pinned memory: an asynchronous copy, the buffer held
    until it is done)."""
    if device.type == "cpu":
        return x
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, precision: Precision, seed: int
) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    # bf16 weights and moments: AdamWSR keeps the update in fp32
    if precision.param_dtype == torch.bfloat16:
        return AdamWSR(
            groups,
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            stochastic_rounding=precision.stochastic_rounding,
            seed=seed,
        )
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
