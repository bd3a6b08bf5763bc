"""Scaled dot-product attention as every layer computes it: SDPA, or Gemma 2's soft-capped
scores, with grouped key/value heads shared rather than repeated."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    softcap: float | None,
    dropout: float,
) -> torch.Tensor:
    """softmax(q.k * scale [soft-capped], masked) . v for q (batch, heads, q, head_dim) and k, v
    (batch, kv_heads, k, head_dim): query head h reads key/value head h // (heads / kv_heads),
    which are shared, never repeated (SDPA's enable_gqa, or a broadcast in the capped path).
    `causal` without a mask: the causal mask aligned to the last key (SDPA's is_causal, so its
    fused kernels skip the blocks above the diagonal)."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=causal,
            scale=scale,
            enable_gqa=gqa,
        )
    return _capped_attention(q, k, v, mask, causal, scale, softcap, dropout)


def _capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
    softcap: float,
    dropout: float,
) -> torch.Tensor:
    """Gemma 2's soft-capped scores, cap * tanh(q.k * scale / cap), which SDPA has no place for:
    scores, cap, mask, softmax in fp32, dropout, values, as transformers' eager attention does
    them. The query heads are grouped (batch, kv_heads, q_per_kv, q, head_dim) over their
    key/value head, broadcast."""
    b, h, n, d = q.shape
    groups = k.shape[1]
    qg = q.reshape(b, groups, h // groups, n, d)
    scores = (qg @ k[:, :, None].transpose(-1, -2)) * (scale or d**-0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and causal:
        m = scores.shape[-1]
        mask = torch.ones(n, m, dtype=torch.bool, device=scores.device).tril(m - n)
    if mask is not None:
        scores = scores.masked_fill(~(mask[:, :, None] if mask.dim() == 4 else mask), float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return (weights @ v[:, :, None]).reshape(b, h, n, d)
