"""Mixture of experts (Mixtral, Qwen3-MoE): a top-k router and SwiGLU experts stored as stacked
weights, computed grouped (the router's training losses: lmforge.models.router_losses).

Each token's router logits pick its experts_per_token experts (softmax over all experts, then the
top k, their weights renormalised to sum 1 when router_norm_topk); its output is the weighted sum of
those experts' outputs.

The experts run grouped: the (token, expert) pairs are sorted by expert once, so each expert's
tokens are one contiguous block of rows, and each expert is one GEMM over its block (a Python loop
over the experts, never over tokens). _GroupedExperts does forward and backward itself: with
autograd over `weight[e]` slices, each expert's weight gradient is a zero tensor of the whole
stacked weight with one slice filled, summed expert by expert (num_experts whole-weight writes per
expert: quadratic in the expert count); here each expert's gradient is written once into its slice.
The per-expert GEMMs are torch's grouped GEMM (F.grouped_mm) on the devices and dtypes GROUPED_MM
names: the same GEMMs as a loop, without a Python round trip (and on a GPU a kernel launch) per
expert, which dominates with many small experts (Qwen3-MoE); elsewhere a loop of torch.mm over the
experts. The CPU's grouped GEMM takes every float dtype and is checked against the loop here; CUDA's
takes bf16 with every row stride a multiple of 16 bytes, and is used from compute capability 9.0
(Hopper), where scripts/gpu_check.py's `moe` check passed (on an H200: the fp32 loop equal to an
fp32 CPU reference within 2.3e-6, bf16 grouped equal to the bf16 loop, outputs and gradients; 1.3x
the loop at Mixtral's width, 4.3x with 64 experts, 8.3x with their adapters). Older GPUs keep the
loop until the check has passed on one.

LoRA on the experts (lmforge.models.lora_experts) runs in the same grouped pass: an adapted weight
adds, for expert e's rows x, scaling * (x A_e^T) B_e^T, two more grouped GEMMs through the rank
(never the merged weight), with their gradients written out beside the experts' own.

QLoRA (lora.base_dtype=nf4) holds gate_up and down as 2-D NF4 tensors (lmforge.models.nf4): the
grouped pass dequantizes them in the compute dtype (stacked) and keeps only the NF4 tensors for
backward, where it dequantizes them again, as torchao's NF4 linear does: a layer's experts are never
held in bf16 between forward and backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.config import ModelConfig
from lmforge.models.nf4 import dequantize, is_nf4

# Device type -> the dtypes whose experts' GEMMs go through torch's grouped GEMM (see the module
# docstring).
GROUPED_MM: dict[str, tuple[torch.dtype, ...]] = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.bfloat16,),
}
# the oldest CUDA compute capability the moe check has passed on
GROUPED_MM_CUDA_CAPABILITY = (9, 0)
_NO_LORA = ({}, None, None, None, None)  # _GroupedExperts' adapter arguments without adapters


class Experts(nn.Module):
    """num_experts SwiGLU MLPs, stacked: gate_up (experts, 2, moe_intermediate, hidden) holds
    each expert's gate rows ([:, 0]) and its up rows ([:, 1]), down (experts, hidden,
    moe_intermediate). Gate and up have a dimension of their own so that one split of the
    intermediate dimension (Shard(2), tensor parallelism) hands every rank the same rows of both,
    as a plain box of the tensor: what DCP, sharded loading and initialisation cut."""

    # what QLoRA quantizes here (lmforge.models.nf4.nf4_weights)
    STACKED_WEIGHTS = ("gate_up", "down")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up = nn.Parameter(torch.empty(e, 2, i, d))
        self.down = nn.Parameter(torch.empty(e, d, i))

    def forward(
        self,
        x: torch.Tensor,
        chosen: torch.Tensor,
        weights: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor],
        run: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """grouped_experts (or `run`, MoE.dispatch) over these weights (and their LoRA factors,
        LoRAExperts): a module call of its own, so that a plan applied to the experts alone
        (FSDP2 sharding them on a mesh of their own, lmforge.parallel.expert) has a forward to
        hook."""
        return (run or grouped_experts)(
            x, chosen, weights, self.gate_up, self.down, act, self.lora()
        )

    @classmethod
    def holding(cls, gate_up: nn.Parameter, down: nn.Parameter) -> Experts:
        """Experts around these (stacked) weight tensors, as they are."""
        experts = cls.__new__(cls)
        nn.Module.__init__(experts)
        experts.gate_up, experts.down = gate_up, down
        return experts

    def lora(self) -> ExpertLoRA | None:
        """The LoRA factors to add in the grouped pass: none here
        (lmforge.models.lora_experts.LoRAExperts)."""
        return None


def expert_dims(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[int, int, int]:
    """(experts, moe_intermediate, hidden) of stacked experts' weights, or of the 2-D forms QLoRA
    holds them in (lmforge.models.nf4)."""
    if gate_up.dim() > 2:
        experts, _, inter, hidden = gate_up.shape
        return experts, inter, hidden
    hidden, inter = gate_up.shape[1], down.shape[1]
    return down.shape[0] // hidden, inter, hidden


def stacked(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts' gate_up (experts, 2, moe_intermediate, hidden) and down (experts, hidden,
    moe_intermediate): the tensors themselves where they are stacked, else from the 2-D forms
    QLoRA holds them in (NF4, dequantized into new tensors of `dtype`, bf16 by default; or
    already dense)."""
    if gate_up.dim() > 2:
        return gate_up, down
    experts, inter, hidden = expert_dims(gate_up, down)
    return _stacked(gate_up, (experts, 2, inter, hidden), dtype), _stacked(
        down, (experts, hidden, inter), dtype
    )


def _stacked(w: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    return (dequantize(w, dtype) if is_nf4(w) else w).view(shape)


@dataclass
class ExpertLoRA:
    """LoRA factors of stacked experts: expert e's rows x through an adapted weight W give x
    W_e^T + scaling * (x A_e^T) B_e^T. `factors` by name, those present of "lora_A.gate_up"
    (experts, rank, hidden), "lora_B.gate_up" (experts, 2, moe_intermediate, rank: its rows like
    gate_up's), "lora_A.down" (experts, rank, moe_intermediate), "lora_B.down" (experts, hidden,
    rank); `scaling` by weight ("gate_up", "down")."""

    factors: dict[str, torch.Tensor]
    scaling: dict[str, float]

    def map(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> ExpertLoRA:
        return ExpertLoRA({name: fn(name, t) for name, t in self.factors.items()}, self.scaling)

    def args(self) -> tuple:
        """_GroupedExperts' adapter arguments: the scalings, then A and B of gate_up and of down
        (None if absent)."""
        f = self.factors
        return (
            self.scaling,
            f.get("lora_A.gate_up"),
            f.get("lora_B.gate_up"),
            f.get("lora_A.down"),
            f.get("lora_B.down"),
        )


class MoE(nn.Module):
    """Router + experts in place of a block's MLP. In training (grad enabled) the layer keeps its
    router logits of the last forward in `router_logits`, which router_losses reads and clears."""

    def __init__(self, cfg: ModelConfig, activation: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk = (
            cfg.num_experts,
            cfg.experts_per_token,
            cfg.router_norm_topk,
        )
        self.act = activation
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        self.router_logits: torch.Tensor | None = None
        # grouped_experts' stand-in when expert parallelism lays the experts out over ranks (same
        # arguments): lmforge.parallel.expert sets it, the layer itself knows nothing of ranks.
        self.dispatch: Callable[..., torch.Tensor] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits (tokens, experts), routing weights (tokens, k) in fp32, chosen experts
        (tokens, k))."""
        logits = self.router(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, weights, chosen = self.route(x)
        if not (self.training and torch.is_grad_enabled()):
            self.router_logits = None
        # activation checkpointing's recompute in backward: the loss has its logits
        # already
        elif not _recomputing():
            self.router_logits = logits
        out = _outside_compile(self.experts, x, chosen, weights, self.act, self.dispatch)
        return out.view(shape)


def _recomputing() -> bool:
    """Whether this forward runs inside a backward: activation checkpointing recomputing a block.
    Its router logits must not be kept then: they would hold the recomputed block's graph, and so
    its activations, until the next forward, every layer's at once by the end of backward (what
    checkpointing exists to free)."""
    return torch._C._current_graph_task_id() != -1


@torch.compiler.disable
def _outside_compile(run: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """The experts run eagerly inside a compiled block (trainer.compile): how many rows each
    expert gets is read on the host and decides the GEMMs' shapes (and expert parallelism's
    all-to-all), and torch's fake kernel of F.grouped_mm accepts bf16 only, so tracing them
    failed; the block's attention, norms and router still compile."""
    return run(*args)


def grouped_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{chosen[t, j]}(x[t]) for every token t: x (tokens, hidden),
    chosen and weights (tokens, k), gate_up and down Experts' (or a slice of their experts or
    intermediate rows), with `lora`'s updates (sliced alike); the experts' GEMMs in the compute
    dtype (autocast's, else x's)."""
    dtype = (
        torch.get_autocast_dtype(x.device.type)
        if torch.is_autocast_enabled(x.device.type)
        else x.dtype
    )
    nf4 = is_nf4(gate_up)  # QLoRA's 2-D NF4 experts: dequantized inside the pass (module docstring)
    num_experts = expert_dims(gate_up, down)[0]
    flat = chosen.reshape(-1)
    # Stable, so each expert's rows keep token order (the same GEMM rows whatever the sort's
    # implementation).
    order = torch.sort(flat, stable=True).indices
    counts = expert_counts(flat, num_experts)
    adapters = _NO_LORA if lora is None else lora.map(lambda _, t: t.to(dtype)).args()
    if not nf4:
        gate_up, down = gate_up.to(dtype), down.to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        return _GroupedExperts.apply(
            x.to(dtype), weights.to(dtype), gate_up, down, order, counts, act, *adapters
        )


def expert_counts(flat: torch.Tensor, num_experts: int) -> list[int]:
    """How many of the routed rows (`flat`: each row's expert) each expert gets, read on the
    host: they decide the GEMMs' shapes."""
    return torch.bincount(flat, minlength=num_experts).tolist()


def expert_rows(
    rows: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts: list[int],
    act: Callable[[torch.Tensor], torch.Tensor],
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """Each row through its expert, unweighted: rows (n, hidden) already grouped by expert
    (counts[e] rows of expert e, experts in order), gate_up/down the experts' stacked weights
    (and `lora`'s factors), all in one dtype. The GEMMs of grouped_experts, for a caller that
    grouped the rows itself (expert parallelism, after the all-to-all)."""
    order = torch.arange(rows.shape[0], device=rows.device)
    return _GroupedExperts.apply(
        rows,
        rows.new_ones(rows.shape[0], 1),
        gate_up,
        down,
        order,
        counts,
        act,
        *(_NO_LORA if lora is None else lora.args()),
    )


def _segments(counts: list[int]):
    start = 0
    for e, n in enumerate(counts):
        yield e, start, start + n
        start += n


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _grouped_offsets(t: torch.Tensor, counts: list[int], *widths: int) -> torch.Tensor | None:
    """The groups' end rows (on t's device) for torch's grouped GEMM where lmforge uses it
    (GROUPED_MM), else None: the loop over experts. Off the CPU every row of every operand
    (`widths`: their column counts) must be a multiple of 16 bytes long."""
    if not hasattr(F, "grouped_mm") or t.dtype not in GROUPED_MM.get(t.device.type, ()):
        return None
    if t.device.type == "cuda" and _capability(t.device) < GROUPED_MM_CUDA_CAPABILITY:
        return None
    if t.device.type != "cpu" and any(w * t.element_size() % 16 for w in widths):
        return None
    return (
        torch.tensor(counts, dtype=torch.int64)
        .cumsum(0)
        .to(torch.int32)
        .to(t.device, non_blocking=True)
    )


def _rank_offsets(offs: torch.Tensor | None, a: torch.Tensor | None) -> torch.Tensor | None:
    """offs for the GEMMs through LoRA factor `a`'s rank (a: (experts, rank, in)), or None (the
    loop over experts) where a row of rank values is not a multiple of 16 bytes, which every
    stride of torch's grouped GEMM must be."""
    return (
        offs
        if offs is not None and a is not None and a.shape[1] * a.element_size() % 16 == 0
        else None
    )


def _per_expert(
    a: torch.Tensor, b: torch.Tensor, counts: list[int], offs: torch.Tensor | None
) -> torch.Tensor:
    """a's rows of each expert times that expert's matrix: a (rows, K), b (experts, K, N) ->
    (rows, N)."""
    if offs is not None:
        return F.grouped_mm(a, b, offs=offs)
    out = a.new_empty(a.shape[0], b.shape[2])
    for e, lo, hi in _segments(counts):
        if hi > lo:
            torch.mm(a[lo:hi], b[e], out=out[lo:hi])
    return out


def _per_expert_outer(
    a: torch.Tensor,
    c: torch.Tensor,
    counts: list[int],
    offs: torch.Tensor | None,
) -> torch.Tensor:
    """Each expert's a rows transposed times its c rows, (experts, a columns, c columns): a
    weight gradient, written once per expert (zero for an expert without tokens)."""
    if offs is not None:
        return F.grouped_mm(a.t(), c, offs=offs)
    out = a.new_empty(len(counts), a.shape[1], c.shape[1])
    for e, lo, hi in _segments(counts):
        if hi > lo:
            torch.mm(a[lo:hi].t(), c[lo:hi], out=out[e])
        else:
            out[e].zero_()
    return out


class _GroupedExperts(torch.autograd.Function):
    """The experts' forward and backward over rows sorted by expert (see the module docstring).
    With LoRA factors (`scaling` by weight; a_gu, b_gu, a_down, b_down, each None where absent),
    an adapted weight's rows also go through its rank: u = scaling * x_e A_e^T, and u B_e^T joins
    the weight's output; backward, B's gradient is gh_e^T u, the rank's gradient scaling * gh_e
    B_e gives A's (with x_e) and x's (through A)."""

    @staticmethod
    def forward(
        ctx, x, weights, gate_up, down, order, counts, act, scaling, a_gu, b_gu, a_down, b_down
    ):
        ctx.nf4 = is_nf4(gate_up)
        # what backward gets: QLoRA's NF4 tensors, not their dequantized copies
        held = (gate_up, down)
        experts, inter, hidden = expert_dims(gate_up, down)
        ctx.gate_up_shape = (experts, 2, inter, hidden)
        # each dequantized where it is used: one layer's weights in the compute dtype at a
        # time
        if ctx.nf4:
            gate_up = _stacked(gate_up, ctx.gate_up_shape, x.dtype)
        gate_up = gate_up.flatten(1, 2)  # (experts, [gate; up] rows, hidden): one GEMM for both
        # (experts, [gate; up] rows, rank) likewise
        b_gu = b_gu.flatten(1, 2) if b_gu is not None else None
        tokens, k = weights.shape
        offs = _grouped_offsets(x, counts, x.shape[1], gate_up.shape[1], inter)
        slot_token = order // k  # the token of each sorted (token, expert) pair
        rows = x.index_select(0, slot_token)
        h = _per_expert(rows, gate_up.transpose(1, 2), counts, offs)
        # the dequantized gate_up dropped as soon as its GEMM is done: before h's adapter
        # update and
        if ctx.nf4:
            gate_up = None  # down's dequantization, which would otherwise hold it too
        h, u_gu = _low_rank_into(h, rows, a_gu, b_gu, scaling.get("gate_up"), counts, offs)
        a = act(h[:, :inter]) * h[:, inter:]
        if ctx.nf4:
            down = _stacked(down, (experts, hidden, inter), x.dtype)
        y = _per_expert(a, down.transpose(1, 2), counts, offs)
        y, u_down = _low_rank_into(y, a, a_down, b_down, scaling.get("down"), counts, offs)
        del rows, a
        w = weights.reshape(-1)[order]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0], device=order.device)
        # Back to (token, k) order and summed over k: a gather and a sum, no scatter (deterministic
        # on every device).
        out = (y * w[:, None])[inverse].view(tokens, k, y.shape[1]).sum(1)  # explicit: 0 tokens too
        ctx.save_for_backward(
            x,
            weights,
            *(held if ctx.nf4 else (gate_up, down)),
            order,
            inverse,
            h,
            y,
            a_gu,
            b_gu,
            a_down,
            b_down,
            u_gu,
            u_down,
        )
        ctx.counts, ctx.act, ctx.offs, ctx.scaling = counts, act, offs, scaling
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (
            x,
            weights,
            gate_up,
            down,
            order,
            inverse,
            h,
            y,
            a_gu,
            b_gu,
            a_down,
            b_down,
            u_gu,
            u_down,
        ) = ctx.saved_tensors
        counts, act, offs, scaling = ctx.counts, ctx.act, ctx.offs, ctx.scaling
        if ctx.nf4:  # QLoRA's NF4 experts, dequantized again where each is used
            experts, _, inter, hidden = ctx.gate_up_shape
            nf4_gate_up, gate_up = gate_up, None
            down = _stacked(down, (experts, hidden, inter), x.dtype)
        need_x, need_w, need_gu, need_down = ctx.needs_input_grad[:4]
        need_lora = ctx.needs_input_grad[8:12]
        tokens, k = weights.shape
        inter = ctx.gate_up_shape[2]
        slot_token = order // k
        # each pair's share of the gradient, before its routing weight
        go = grad_out.index_select(0, slot_token)
        grad_weights = (go * y).sum(-1)[inverse].view(tokens, k) if need_w else None
        gy = go * weights.reshape(-1)[order][:, None]
        del go
        g, up = h[:, :inter], h[:, inter:]
        if act is F.silu:
            act_g = F.silu(g)
        else:  # any other activation: its derivative through autograd
            with torch.enable_grad():
                g_leaf = g.detach().requires_grad_()
                act_leaf = act(g_leaf)
            act_g = act_leaf.detach()
        a = act_g * up if need_down or a_down is not None else None
        grad_down = _per_expert_outer(gy, a, counts, offs) if need_down else None
        ga = _per_expert(gy, down, counts, offs)
        grad_a_down, grad_b_down = _low_rank_grads(
            ga, gy, a, a_down, b_down, u_down, scaling.get("down"), counts, offs, need_lora[2:]
        )
        del gy, a
        gh = h.new_empty(h.shape)  # [d gate | d up], written in place (no concatenation)
        torch.mul(ga, act_g, out=gh[:, inter:])
        grad_act = ga.mul_(up)
        if act is F.silu:
            torch.ops.aten.silu_backward.grad_input(grad_act, g, grad_input=gh[:, :inter])
        else:
            gh[:, :inter] = torch.autograd.grad(act_leaf, g_leaf, grad_act)[0]
        del grad_act, ga, act_g
        need_rows = need_gu or (a_gu is not None and need_lora[0])
        rows = x.index_select(0, slot_token) if need_rows else None
        grad_gate_up = (
            _per_expert_outer(gh, rows, counts, offs).view(ctx.gate_up_shape) if need_gu else None
        )
        if ctx.nf4:
            del down
            gate_up = (
                _stacked(nf4_gate_up, ctx.gate_up_shape, x.dtype).flatten(1, 2) if need_x else None
            )
        grad_rows = _per_expert(gh, gate_up, counts, offs) if need_x else None
        grad_a_gu, grad_b_gu = _low_rank_grads(
            grad_rows,
            gh,
            rows,
            a_gu,
            b_gu,
            u_gu,
            scaling.get("gate_up"),
            counts,
            offs,
            need_lora[:2],
        )
        if grad_b_gu is not None:
            grad_b_gu = grad_b_gu.view(*ctx.gate_up_shape[:3], -1)
        grad_x = grad_rows[inverse].view(tokens, k, x.shape[1]).sum(1) if need_x else None
        return (
            grad_x,
            grad_weights,
            grad_gate_up,
            grad_down,
            None,
            None,
            None,
            None,
            grad_a_gu,
            grad_b_gu,
            grad_a_down,
            grad_b_down,
        )


def _low_rank_into(
    out: torch.Tensor,
    rows: torch.Tensor,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    scaling: float | None,
    counts: list[int],
    offs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out + (scaling * rows_e A_e^T) B_e^T per expert, u = scaling * rows A^T for the backward)
    where the weight has an adapter (a (experts, rank, in), b (experts, out, rank)), else (out,
    None). Out of place: selective activation checkpointing keeps the grouped GEMMs' outputs for
    the recompute and refuses a kept tensor changed in place (an adapter on the experts failed
    every selective run)."""
    if a is None:
        return out, None
    roffs = _rank_offsets(offs, a)
    u = _per_expert(rows, a.transpose(1, 2), counts, roffs) * scaling
    return out + _per_expert(u, b.transpose(1, 2), counts, roffs), u


def _low_rank_grads(
    grad_rows: torch.Tensor | None,
    grad_out: torch.Tensor,
    rows: torch.Tensor | None,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    u: torch.Tensor | None,
    scaling: float | None,
    counts: list[int],
    offs: torch.Tensor | None,
    need: tuple[bool, bool],
):
    """The gradients of an adapter's A and B (each None unless needed) from grad_out, its
    weight's output gradient (rows, out); its share of the input rows' gradient is added into
    grad_rows (in place, where given)."""
    if a is None:
        return None, None
    roffs = _rank_offsets(offs, a)
    grad_b = _per_expert_outer(grad_out, u, counts, roffs) if need[1] else None
    # d(rows A^T): through u = scaling * rows A^T
    grad_u = _per_expert(grad_out, b, counts, roffs).mul_(scaling)
    grad_a = _per_expert_outer(grad_u, rows, counts, roffs) if need[0] else None
    if grad_rows is not None:
        grad_rows.add_(_per_expert(grad_u, a, counts, roffs))
    return grad_a, grad_b


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE output computed the slow, obvious way: every expert on every token, each token's
    output the sum of its chosen experts' outputs times their routing weights (tests hold the
    grouped path to it)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    _, weights, chosen = moe.route(x)
    out = torch.zeros_like(x)
    for e in range(moe.num_experts):
        gate, up = moe.experts.gate_up[e]
        y = F.linear(moe.act(F.linear(x, gate)) * F.linear(x, up), moe.experts.down[e])
        share = (weights * (chosen == e)).sum(-1, keepdim=True).to(x.dtype)
        out = out + share * y
    return out.view(shape)
