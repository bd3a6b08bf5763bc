"""Causal attention over a sequence split across the ranks of a context-parallel group
(lmforge.parallel.context): the per-block math, its exact merge by log-sum-exp, and the two ways
keys/values reach the queries.

Each rank holds two of the sequence's 2C chunks (ContextShard); its queries must see the keys/values
of every rank. Two autograd Functions move them:

* all-gather (`method="allgather"`): one all-gather of K and V per layer, then local blocks; the
  backward computes dK/dV for the whole sequence and reduce-scatters them to their owners. Cheap
  when the model has few key/value heads (grouped-query attention): K/V are then a fraction of the
  queries' size. Memory: the whole sequence's K/V (and their gradients) on every rank for the
  layer's duration.
* ring (`method="ring"`): the K/V block travels rank to rank (isend/irecv), the next block's
  transfer posted before this block's compute so the two overlap; the backward sends the blocks
  round again and with them the dK/dV accumulated so far, which reach their owner after C-1 hops.
  Memory: two blocks at a time.

K/V travel in their own dtype; their gradients accumulate and travel in fp32 (the bytes:
lmforge.parallel.comm_volume.context_bytes). A (query chunk, key chunk) pair that the causal rule
(or a sliding window) masks whole is skipped, read from the chunks' slot ranges on the host, so with
the load-balanced split every rank computes the same number of pairs; the queries go QUERY_TILE at a
time, which bounds a block's memory. The mask inside a pair is built from the tokens' global slots
and segment ids, and is lmforge.models.documents.document_mask's rule: causal, within a document,
within the window; a padding token (segment 0) sees itself only.

Each block needs its output and log-sum-exp, which SDPA's public call does not return. On the CPU,
SDPA's own flash kernel (aten._scaled_dot_product_flash_attention_for_cpu) returns both, reads
grouped key/value heads as they are, takes the mask as an additive one, and its backward takes the
merged output and log-sum-exp: blocks go through it (7-9x faster than the explicit math on one 1024
x 4096 block). With a soft cap, off the CPU, or with KERNEL = "explicit", the block is explicit fp32
math, whose backward is flash attention's (Dao 2022): with the merged log-sum-exp L and delta =
rowsum(dO * O), P = exp(S - L), dV = P^T dO, dS = P * (dO V^T - delta), dQ = dS K, dK = dS^T Q
(times the scale; times 1 - tanh^2 under a soft cap). The CUDA flash and memory-efficient kernels
return the log-sum-exp too: the piece to add for GPUs. Dropout is refused: the masks of a dropped
block would have to travel too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lmforge.errors import UserError

METHODS = ("allgather", "ring")
# Queries per score block: the fp32 scores of one block are QUERY_TILE x chunk per head, whatever
# the chunk.
QUERY_TILE = 1024
KV_TAG, GRAD_TAG = 0, 1
# Per block: "auto" takes SDPA's CPU flash kernel where it serves (the CPU, no soft cap), else the
# explicit fp32 math; "explicit" always the latter (the reference the kernel is tested against).
KERNEL = "auto"
_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = (
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
)  # point-to-point tags: a block's K/V and its accumulated dK/dV travel the same edge


@dataclass
class ContextPlan:
    """What one attention call needs to know beyond q, k, v: the group, which chunks each rank
    holds, every rank's segment ids (gathered once per forward), and the layer's window, scale
    and cap."""

    group: dist.ProcessGroup | None
    context: int
    rank: int
    chunk: int  # tokens per chunk: the sequence is 2 * context chunks
    # (context, batch, 2 * chunk) every rank's segment ids; None: one document
    segments: torch.Tensor | None
    window: int | None = None
    scale: float | None = None
    softcap: float | None = None

    def ranges(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The global slots [start, end) of the two chunks `rank` holds: chunk rank and chunk
        2C-1-rank."""
        a, b = rank, 2 * self.context - 1 - rank
        return (a * self.chunk, (a + 1) * self.chunk), (b * self.chunk, (b + 1) * self.chunk)

    def live(self, q: tuple[int, int], k: tuple[int, int]) -> bool:
        """Whether any query of slots q may see any key of slots k (causal, within the window)."""
        if k[0] > q[1] - 1:
            return False
        return self.window is None or k[1] - 1 > q[0] - self.window

    def kind(self, rows: slice, k_rank: int, k_piece: int) -> str:
        """How this rank's queries of local `rows` see k_rank's chunk `k_piece`: "full" (every
        key, no mask), "causal" (the same slots: SDPA's is_causal) or "masked"."""
        c = self.chunk
        if self.segments is not None:
            return "masked"
        q0 = self.ranges(self.rank)[rows.start // c][0] + rows.start % c
        q1 = q0 + rows.stop - rows.start
        k0, k1 = self.ranges(k_rank)[k_piece]
        if k1 - 1 <= q0 and (self.window is None or k0 > q1 - 1 - self.window):
            return "full"
        if (q0, q1) == (k0, k1) and self.window is None:
            return "causal"
        return "masked"

    def mask(self, q_rank: int, rows: slice, k_rank: int, k_piece: int) -> torch.Tensor:
        """(batch or 1, len(rows), chunk) bool for the queries of local `rows` (inside one of
        q_rank's chunks) against k_rank's chunk `k_piece`: True where the query may attend to the
        key (see the docstring)."""
        c = self.chunk
        qs = self.ranges(q_rank)[rows.start // c][0] + rows.start % c
        ks = self.ranges(k_rank)[k_piece][0]
        device = self.segments.device if self.segments is not None else None
        q_slots = torch.arange(qs, qs + rows.stop - rows.start, device=device)[:, None]
        k_slots = torch.arange(ks, ks + c, device=device)[None, :]
        allowed = k_slots <= q_slots
        if self.window is not None:
            allowed = allowed & (k_slots > q_slots - self.window)
        allowed = allowed[None]
        if self.segments is not None:
            q_seg = self.segments[q_rank][:, rows]
            k_seg = self.segments[k_rank][:, k_piece * c : (k_piece + 1) * c]
            allowed = allowed & (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] != 0)
        return allowed | (q_slots == k_slots)[None]


# host-side loops over blocks and point-to-point sends: run between a block's graphs
@torch.compiler.disable
def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: ContextPlan,
    method: str = "ring",
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention output (batch, heads, 2 * chunk, head_dim) of this rank's queries over the whole
    sequence, for q (batch, heads, 2 * chunk, head_dim) and k, v (batch, kv_heads, 2 * chunk,
    head_dim) of its two chunks."""
    if method not in METHODS:
        raise UserError(
            f"context-parallel attention method {method!r} is not one of {', '.join(METHODS)}"
        )
    if dropout:
        raise UserError(
            "attention dropout under context parallelism is not supported: set attention_dropout=0"
        )
    if q.shape[2] != 2 * plan.chunk or k.shape[2] != 2 * plan.chunk:
        raise ValueError(
            f"q and k must hold 2 chunks of {plan.chunk} tokens, got {q.shape[2]} and {k.shape[2]}"
        )
    fn = _AllGatherAttention if method == "allgather" else _RingAttention
    return fn.apply(q, k, v, plan)


# -- per block math, grouped layout: q (batch, kv_heads, q_per_kv, n, d), k and v (batch, kv_heads,
# m, d), fp32


def _scores(q, k, plan: ContextPlan):
    s = (q @ k[:, :, None].transpose(-1, -2)) * (plan.scale or q.shape[-1] ** -0.5)
    if plan.softcap is None:
        return s, None
    t = torch.tanh(s / plan.softcap)
    return t * plan.softcap, t


def _block_forward(q, k, v, mask, plan: ContextPlan):
    """Normalised output (b, g, r, n, d) and log-sum-exp (b, g, r, n) of one block; rows the mask
    empties give 0 and -inf, which the merge ignores."""
    s, _ = _scores(q, k, plan)
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True)
    out = (p @ v[:, :, None]) / torch.where(total > 0, total, torch.ones_like(total))
    return out, (m + torch.log(total)).squeeze(-1)


def _merge(out, lse, block_out, block_lse):
    """out, lse updated in place with a block's partial result: softmax over the union of their
    keys."""
    new = torch.logaddexp(lse, block_lse)
    # both empty: weights 0, not nan
    ref = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    out.mul_(torch.exp(lse - ref)[..., None]).add_(
        block_out * torch.exp(block_lse - ref)[..., None]
    )
    lse.copy_(new)


def _block_backward(q, k, v, mask, plan: ContextPlan, dout, lse, delta):
    """dq (b, g, r, n, d), dk and dv (b, g, m, d) of one block, from the merged lse and delta."""
    s, t = _scores(q, k, plan)
    p = torch.exp(s.masked_fill(~mask[:, None, None], float("-inf")) - lse[..., None])
    dv = torch.einsum("bgrnm,bgrnd->bgmd", p, dout)
    ds = p * (dout @ v[:, :, None].transpose(-1, -2) - delta[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    ds = ds * (plan.scale or q.shape[-1] ** -0.5)
    return ds @ k[:, :, None], torch.einsum("bgrnm,bgrnd->bgmd", ds, q), dv


def _sdpa_forward(q, k, v, mask, kind: str, plan: ContextPlan):
    """_block_forward through SDPA's CPU flash kernel, which returns the log-sum-exp too and
    reads grouped key/value heads as they are (query head h on key head h // q_per_kv, the
    grouped layout's order)."""
    b, g, r, n, d = q.shape
    bias = None if kind != "masked" else _bias(mask)
    out, lse = _CPU_FLASH(
        q.reshape(b, g * r, n, d), k, v, 0.0, kind == "causal", attn_mask=bias, scale=plan.scale
    )
    lse = lse.view(b, g, r, n)
    if kind == "masked":  # the kernel gives a row without keys lse 0; the merge needs -inf
        lse = lse.masked_fill(~mask.any(-1)[:, None, None], float("-inf"))
    return out.view(b, g, r, n, d), lse


def _sdpa_backward(q, k, v, mask, kind: str, plan: ContextPlan, dout, out, lse):
    """_block_backward through the CPU flash kernel's backward, given the merged output and
    log-sum-exp."""
    b, g, r, n, d = q.shape
    bias = None if kind != "masked" else _bias(mask)
    flat = (b, g * r, n, d)
    dq, dk, dv = _CPU_FLASH_BACKWARD(
        dout.reshape(flat),
        q.reshape(flat),
        k,
        v,
        out.reshape(flat),
        lse.reshape(b, g * r, n),
        0.0,
        kind == "causal",
        attn_mask=bias,
        scale=plan.scale,
    )
    return dq.view(b, g, r, n, d), dk, dv


def _bias(mask: torch.Tensor) -> torch.Tensor:
    """The boolean mask as the additive fp32 one the CPU kernel takes (batch, 1, q, k)."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(
        ~mask, float("-inf")
    )[:, None]


def _use_sdpa(q: torch.Tensor, plan: ContextPlan) -> bool:
    return KERNEL == "auto" and q.device.type == "cpu" and plan.softcap is None


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, n, d = q.shape
    return q.float().reshape(b, kv_heads, h // kv_heads, n, d)


def _tiles(plan: ContextPlan, k_rank: int):
    """(local query rows, key chunk) of this rank's queries against `k_rank`'s keys, QUERY_TILE
    rows at most, skipping those the causal rule or the window masks whole."""
    c = plan.chunk
    for qp, (qs, _) in enumerate(plan.ranges(plan.rank)):
        for t in range(0, c, QUERY_TILE):
            n = min(QUERY_TILE, c - t)
            for kp, kr in enumerate(plan.ranges(k_rank)):
                if plan.live((qs + t, qs + t + n), kr):
                    yield slice(qp * c + t, qp * c + t + n), kp


def _keys(t: torch.Tensor, piece: int, chunk: int) -> torch.Tensor:
    return t[..., piece * chunk : (piece + 1) * chunk, :].float()


def _forward_block(out, lse, q, k, v, plan: ContextPlan, k_rank: int) -> None:
    c = plan.chunk
    sdpa = _use_sdpa(q, plan)
    for rows, kp in _tiles(plan, k_rank):
        kind = plan.kind(rows, k_rank, kp) if sdpa else "masked"
        mask = plan.mask(plan.rank, rows, k_rank, kp) if kind == "masked" else None
        qt, kc, vc = q[..., rows, :], _keys(k, kp, c), _keys(v, kp, c)
        if sdpa:
            block_out, block_lse = _sdpa_forward(qt, kc, vc, mask, kind, plan)
        else:
            block_out, block_lse = _block_forward(qt, kc, vc, mask, plan)
        _merge(out[..., rows, :], lse[..., rows], block_out, block_lse)


def _backward_block(
    dq, dk, dv, q, k, v, plan: ContextPlan, k_rank: int, dout, out, lse, delta
) -> None:
    """Accumulates this rank's queries' gradients against `k_rank`'s block into dq and that
    block's dk, dv."""
    c = plan.chunk
    sdpa = _use_sdpa(q, plan)
    for rows, kp in _tiles(plan, k_rank):
        kind = plan.kind(rows, k_rank, kp) if sdpa else "masked"
        mask = plan.mask(plan.rank, rows, k_rank, kp) if kind == "masked" else None
        qt, kc, vc = q[..., rows, :], _keys(k, kp, c), _keys(v, kp, c)
        if sdpa:
            g = _sdpa_backward(
                qt, kc, vc, mask, kind, plan, dout[..., rows, :], out[..., rows, :], lse[..., rows]
            )
        else:
            g = _block_backward(
                qt, kc, vc, mask, plan, dout[..., rows, :], lse[..., rows], delta[..., rows]
            )
        dq[..., rows, :].add_(g[0])
        dk[..., kp * c : (kp + 1) * c, :].add_(g[1])
        dv[..., kp * c : (kp + 1) * c, :].add_(g[2])


def _start(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, n, d = q.shape
    out = torch.zeros(b, k.shape[1], h // k.shape[1], n, d, dtype=torch.float32, device=q.device)
    return out, torch.full(out.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)


def _grads(ctx, dq, dk, dv):
    q_dtype, k_dtype, v_dtype = ctx.dtypes
    return dq.reshape(ctx.shape).to(q_dtype), dk.to(k_dtype), dv.to(v_dtype), None


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: ContextPlan):
        qg = _grouped(q, k.shape[1])
        kv = torch.stack([k, v])
        blocks = _all_gather(kv, plan)
        out, lse = _start(q, k)
        for r in _own_first(plan):
            _forward_block(out, lse, qg, blocks[r][0], blocks[r][1], plan, r)
        ctx.plan, ctx.shape, ctx.dtypes = plan, q.shape, (q.dtype, k.dtype, v.dtype)
        # The whole sequence's K/V stay for the backward (small under GQA: the reason to pick this
        # method).
        ctx.save_for_backward(q, out, lse, *blocks)
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        q, out, lse, *blocks = ctx.saved_tensors
        # q kept in its own dtype, not as the fp32 copy the blocks use
        qg = _grouped(q, out.shape[1])
        dout = _grouped(grad, qg.shape[1])
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qg)
        dkv = [torch.zeros_like(b, dtype=torch.float32) for b in blocks]
        for r in _own_first(plan):
            _backward_block(
                dq,
                dkv[r][0],
                dkv[r][1],
                qg,
                blocks[r][0],
                blocks[r][1],
                plan,
                r,
                dout,
                out,
                lse,
                delta,
            )
        own = _reduce_scatter(dkv, plan)
        return _grads(ctx, dq, own[0], own[1])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: ContextPlan):
        qg = _grouped(q, k.shape[1])
        out, lse = _start(q, k)
        kv = torch.stack([k, v])
        for step in range(plan.context):
            works = []
            # the next block's transfer posted before this block's compute
            if step < plan.context - 1:
                nxt = torch.empty_like(kv)
                works = _exchange(kv, nxt, plan, KV_TAG)
            _forward_block(out, lse, qg, kv[0], kv[1], plan, (plan.rank - step) % plan.context)
            for w in works:
                w.wait()
            if works:
                kv = nxt
        ctx.plan, ctx.shape, ctx.dtypes = plan, q.shape, (q.dtype, k.dtype, v.dtype)
        ctx.save_for_backward(q, out, lse, k, v)
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        """The K/V blocks go round once more. Block j's dK/dV start at rank j+1, gather each
        rank's part as they travel beside it, and reach j from j-1 after C-1 hops; j adds its own
        part."""
        plan = ctx.plan
        q, out, lse, k, v = ctx.saved_tensors
        qg = _grouped(q, out.shape[1])
        dout = _grouped(grad, qg.shape[1])
        delta = (dout * out).sum(-1)
        kv = torch.stack([k, v])
        dq = torch.zeros_like(qg)
        # this rank's queries' part of its own block's dK/dV
        own = torch.zeros_like(kv, dtype=torch.float32)
        received, grad_works = None, []
        for step in range(plan.context):
            works = []
            if step < plan.context - 1:
                nxt = torch.empty_like(kv)
                works = _exchange(kv, nxt, plan, KV_TAG)
            part = own if step == 0 else torch.zeros_like(own)
            _backward_block(
                dq,
                part[0],
                part[1],
                qg,
                kv[0],
                kv[1],
                plan,
                (plan.rank - step) % plan.context,
                dout,
                out,
                lse,
                delta,
            )
            if step > 0:
                # what rank-1 accumulated for this block (none at step 1: it
                # starts here)
                for w in grad_works:
                    w.wait()
                if received is not None:
                    part.add_(received)
                # Sent on; what arrives is the next block's, or at the last step this rank's own
                # block's.
                received = torch.empty_like(own)
                grad_works = _exchange(part, received, plan, GRAD_TAG)
            for w in works:
                w.wait()
            if works:
                kv = nxt
        for w in grad_works:
            w.wait()
        if received is not None:
            own.add_(received)
        return _grads(ctx, dq, own[0], own[1])


def _own_first(plan: ContextPlan) -> list[int]:
    """Ranks in the ring's order from this one: each query's first block holds its own key (no
    empty row)."""
    return [(plan.rank - s) % plan.context for s in range(plan.context)]


def _peer(plan: ContextPlan, offset: int) -> int:
    r = (plan.rank + offset) % plan.context
    return dist.get_global_rank(plan.group, r) if plan.group is not None else r


def _exchange(send: torch.Tensor, recv: torch.Tensor, plan: ContextPlan, tag: int) -> list:
    """send to the next rank, receive from the previous one: the works to wait on."""
    return [
        dist.isend(send.contiguous(), _peer(plan, 1), group=plan.group, tag=tag),
        dist.irecv(recv, _peer(plan, -1), group=plan.group, tag=tag),
    ]


def _all_gather(t: torch.Tensor, plan: ContextPlan) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(plan.context)]
    dist.all_gather(parts, t.contiguous(), group=plan.group)
    return parts


def _reduce_scatter(parts: list[torch.Tensor], plan: ContextPlan) -> torch.Tensor:
    out = torch.empty_like(parts[plan.rank])
    dist.reduce_scatter(out, [p.contiguous() for p in parts], group=plan.group)
    return out
