"""The building blocks every family shares: norm, attention, MLP and the transformer block.

Families differ only by switches in ModelConfig (pre/post norm, parallel residual, shared
norm, gating, biases, GQA). Nothing here knows about parallelism: plans are applied from outside.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.models.attention import attention
from lmforge.models.config import ModelConfig
from lmforge.models.documents import Documents
from lmforge.models.moe import MoE
from lmforge.models.rope import apply_rotary


class RMSNorm(nn.Module):
    """Normalise in fp32 whatever the input dtype, then scale: in the input dtype after casting
    back (Llama), or in fp32 before it (scale_fp32: OLMo 2, Gemma), which rounds once instead of
    twice in bf16. unit_offset (Gemma): the scale is 1 + weight, the weight starting at zero (so
    weight decay pulls the scale toward 1)."""

    def __init__(self, dim: int, eps: float, scale_fp32: bool = False, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.scale_fp32, self.unit_offset = scale_fp32, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.unit_offset else nn.init.ones_)(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (y * (1.0 + self.weight.float())).to(x.dtype)
        if self.scale_fp32:
            return (self.weight.float() * y).to(x.dtype)
        return self.weight * y.to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or cfg.hidden_size
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps, cfg.norm_scale_fp32, cfg.norm_unit_offset)
    return nn.LayerNorm(dim, eps=cfg.norm_eps)


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


class LayerCache(NamedTuple):
    """One layer's view of a KV cache: key/value buffers (batch, kv_heads, slots, head_dim) and
    the cache slots (seq,) that the current tokens go to (see lmforge.inference.cache). `window`:
    the buffers are a ring of `window` slots (a sliding-window layer), cache slot p held at p %
    window; None: one buffer slot per cache slot. The slots of one forward are consecutive, as
    generation and the serving engine write them."""

    k: torch.Tensor
    v: torch.Tensor
    position: torch.Tensor
    window: int | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values (batch, kv_heads, seq, head_dim); the keys/values to
        attend over, in the order of the cache's mask for this layer (KVCache.attention_masks).

        A full layer attends over its whole buffer. A ring of one new token writes it first (over
        slot p - window, which is past its window) and attends over the ring; several new tokens
        (a prefill) attend over the ring as it was followed by themselves, and then only their
        last `window` are kept."""
        if self.window is None:
            self._write(self.k, self.v, k, v, self.position)
            return self.k, self.v
        if k.shape[2] == 1:
            self._write(self.k, self.v, k, v, self.position % self.window)
            return self.k, self.v
        keys, values = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)
        keep = min(k.shape[2], self.window)
        self._write(
            self.k,
            self.v,
            k[:, :, -keep:],
            v[:, :, -keep:],
            self.position[..., -keep:] % self.window,
        )
        return keys, values

    @staticmethod
    def _write(
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """k, v at buffer `slots`: (seq,) shared by all rows; (batch, seq) gives each row its own
        slots (continuous batching, where requests that joined at different times sit at
        different lengths)."""
        if slots.dim() == 1:
            k_buf.index_copy_(2, slots, k)
            v_buf.index_copy_(2, slots, v)
            return
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        # Indices split by a slice put their (batch, seq) dims first: (batch, seq, kv_heads,
        # head_dim).
        k_buf[rows, :, slots] = k.transpose(1, 2)
        v_buf[rows, :, slots] = v.transpose(1, 2)


class Attention(nn.Module):
    """Multi-head / grouped-query attention through scaled_dot_product_attention.

    The fused `qkv` projection is laid out per key/value group as
    [num_kv_heads, q_per_kv + 2, head_dim]: the group's query heads, then its key, then its
    value. For plain multi-head attention that is GPT-NeoX's [heads, 3, head_dim] layout, and
    a contiguous column split (tensor parallelism) hands each rank whole groups, as Megatron does.

    `window` (sliding-window layers): the decoder builds the banded mask once per forward and hands
    it to the layers that have one; a packed batch's Documents read it here.
    """

    def __init__(self, cfg: ModelConfig, window: int | None = None):
        super().__init__()
        self.window = window
        self.head_dim = cfg.head_dim
        self.q_per_kv = cfg.num_heads // cfg.num_kv_heads
        self.causal = cfg.causal
        self.dropout = cfg.attention_dropout
        # None: SDPA's
        self.scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None
        self.softcap = cfg.attn_logit_softcapping
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.proj = nn.Linear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias
        )
        self.full_qk_norm = cfg.qk_norm == "full"
        self.q_norm = self.k_norm = None
        if cfg.qk_norm != "none":
            q_dim, k_dim = (
                (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
                if self.full_qk_norm
                else (cfg.head_dim, cfg.head_dim)
            )
            self.q_norm, self.k_norm = make_norm(cfg, q_dim), make_norm(cfg, k_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | Documents | None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """mask: a boolean (batch, 1, q, k) mask, the Documents of a packed batch
        (lmforge.models.documents), or None (causal, or none for an encoder)."""
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, -1, self.q_per_kv + 2, self.head_dim)
        q = qkv[:, :, :, : self.q_per_kv].reshape(b, s, -1, self.head_dim).transpose(1, 2)
        k = qkv[:, :, :, -2].transpose(1, 2)
        v = qkv[:, :, :, -1].transpose(1, 2)
        if self.q_norm is not None:
            q, k = self._norm_qk(q, k)
        if rope is not None:
            q, k = apply_rotary(q, rope[0], rope[1]), apply_rotary(k, rope[0], rope[1])
        dropout = self.dropout if self.training else 0.0
        if isinstance(mask, Documents):
            y = mask.attend(q, k, v, self.window, self.scale, self.softcap, dropout)
            return self.proj(y.transpose(1, 2).reshape(b, s, -1))
        if cache is not None:
            # This step's keys/values into their slots, then attention over the whole fixed-size
            # buffer (the mask hides empty and padding slots): decode steps never change shape.
            k, v = cache.update(k, v)
        y = attention(
            q,
            k,
            v,
            mask,
            self.causal and mask is None and cache is None,
            self.scale,
            self.softcap,
            dropout,
        )
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (batch, heads, seq, head_dim) and k normalised over each head, or over all heads at
        once."""
        if not self.full_qk_norm:
            return self.q_norm(q), self.k_norm(k)

        def whole(norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
            b, h, s, d = t.shape
            return norm(t.transpose(1, 2).reshape(b, s, h * d)).view(b, s, h, d).transpose(1, 2)

        return whole(self.q_norm, q), whole(self.k_norm, k)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.activation]
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.gate = (
            nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
            if cfg.gated_mlp
            else None
        )
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(self.act(self.gate(x)) * self.up(x))
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    """Where the norms sit (norm_position): "pre" norm1 -> attention, norm2 -> MLP (Llama);
    "post" after each residual add (BERT); "output" on each branch's output before its add, none
    on the inputs (OLMo 2): x + post_attn_norm(attn(x)); "sandwich" both, x +
    post_attn_norm(attn(norm1(x))) (Gemma 2/3)."""

    def __init__(self, cfg: ModelConfig, window: int | None = None, moe: bool = False):
        super().__init__()
        self.post_norm = cfg.norm_position == "post"
        self.parallel_residual = cfg.parallel_residual
        inputs = cfg.norm_position != "output"
        outputs = cfg.norm_position in ("output", "sandwich")
        self.norm1 = make_norm(cfg) if inputs else None
        self.attn = Attention(cfg, window)
        self.post_attn_norm = make_norm(cfg) if outputs else None
        self.norm2 = make_norm(cfg) if inputs and not cfg.shared_norm else None
        self.mlp = MoE(cfg, ACTIVATIONS[cfg.activation]) if moe else MLP(cfg)
        self.post_mlp_norm = make_norm(cfg) if outputs else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        if self.post_norm:  # BERT
            x = self.norm1(x + self.drop(self.attn(x, rope, mask, cache)))
            return self.norm2(x + self.drop(self.mlp(x)))
        if self.parallel_residual:  # NeoX: two norms; GPT-J: one norm shared by both branches
            h = self.norm1(x)
            mlp_in = h if self.norm2 is None else self.norm2(x)
            return x + self.drop(self.attn(h, rope, mask, cache)) + self.drop(self.mlp(mlp_in))
        attn = self.attn(x if self.norm1 is None else self.norm1(x), rope, mask, cache)
        if self.post_attn_norm is not None:
            attn = self.post_attn_norm(attn)
        x = x + self.drop(attn)
        mlp = self.mlp(x if self.norm2 is None else self.norm2(x))
        if self.post_mlp_norm is not None:
            mlp = self.post_mlp_norm(mlp)
        return x + self.drop(mlp)


class VocabProjection(nn.Module):
    """Logits over the real vocabulary: h @ weight[:vocab_size].T (+ bias[:vocab_size]), soft-capped
    when the model says so (cap * tanh(logits / cap), Gemma 2).

    `weight` is the LM head or the tied input embedding, padded to padded_vocab_size rows; the
    padding rows are sliced off (a contiguous view, no copy) so they never reach a loss, a softmax
    or a sample. It has no parameters: it is a module only so that tensor parallelism can swap in a
    vocabulary-parallel projection (lmforge.parallel) without touching the model.
    """

    # SoftCappedVocabProjection's cap; the fused loss (lmforge.train.loss) reads it
    softcap: float | None = None

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(
        self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        v = self.vocab_size
        return F.linear(h, weight[:v], bias[:v] if bias is not None else None)


class SoftCappedVocabProjection(VocabProjection):
    """VocabProjection with the logits soft-capped, cap * tanh(logits / cap). The fused linear
    cross-entropy (lmforge.train.loss), which never forms the logits, caps each chunk of them
    itself (its `softcap`)."""

    def __init__(self, vocab_size: int, softcap: float):
        super().__init__(vocab_size)
        self.softcap = softcap

    def forward(
        self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return soft_cap(super().forward(h, weight, bias), self.softcap)


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap


def padding_mask(attention_mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """Boolean SDPA mask (batch, 1, q, k) from a (batch, seq) 1 = token / 0 = padding mask.

    Each query may always see itself, so a padding query (left padding) never has an empty row,
    which would make softmax return NaN; its output is ignored anyway.
    """
    keep = attention_mask.bool()[:, None, None, :]
    if not causal:
        return keep
    s = attention_mask.shape[1]
    causal_mask = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    return (keep & causal_mask) | torch.eye(s, dtype=torch.bool, device=attention_mask.device)


def window_band(query_slots: torch.Tensor, key_slots: torch.Tensor, window: int) -> torch.Tensor:
    """True where a key is among the `window` slots up to and including its query's (not after
    it: AND it with a causal mask). query_slots (seq,) or (batch, seq), key_slots (keys,): (seq,
    keys) or (batch, 1, seq, keys). Slots, not position ids: a left-padded row's real tokens sit
    in consecutive slots, so counting slots counts its tokens, and transformers' sliding-window
    masks count the same way (cache positions)."""
    band = key_slots > query_slots[..., None] - window
    return band[:, None] if band.dim() == 3 else band
