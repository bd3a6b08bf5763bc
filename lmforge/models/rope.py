"""Rotary position embedding, partial rotary included, as one rotation over the whole head.

GPT-NeoX/Pythia rotate only the first `rotary_dim` = rotary_pct * head_dim dims of each head
and pass the rest through; transformers slices the head, rotates one part, concatenates.
Like the NeoX-on-Trainium work, we instead rotate the *whole* head with zero frequency on the
dims that must not move (cos = 1, sin = 0 there): one fused multiply-add, no slicing.

The trap: `rotate_half` pairs dim j with dim j + head_dim/2. In the checkpoint's layout the
rotated pairs are (i, i + rotary_dim/2) for NeoX (or (2i, 2i+1) for GPT-J), so a full-head
rotate_half would pair a rotated dim with a pass-through one. That is not a rotation, and q.k
would then depend on absolute position. We fix the pairing once, at import: the q and k rows of
each head are permuted so that every rotated pair (a, b) of the checkpoint lands at (j, j + D/2),
and the pass-through dims fill the rest of each half, where they pair with each other at zero
frequency. Because q and k get the same permutation, q.k (and so attention) is unchanged;
export applies the inverse. Layout inside lmforge, per head of size D with r = rotary_dim:

    [ rot_a (r/2) | pass_a ((D-r)/2) | rot_b (r/2) | pass_b ((D-r)/2) ]      rot_a[j] pairs rot_b[j]

Context extension (ModelConfig.rope_scaling: linear, dynamic, yarn, llama3) changes only the
frequencies of the rotated pairs (and, for yarn, scales their cos/sin); each is the same float32
expression as transformers' modeling_rope_utils, so fp32 results agree with it bit for bit.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lmforge.models.config import ModelConfig, RopeScaling


def rotary_permutation(head_dim: int, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """perm with lmforge_dim[j] = checkpoint_dim[perm[j]] for one head (see module docstring)."""
    if interleaved:  # GPT-J: pairs (2i, 2i+1)
        rot_a, rot_b = torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)
    else:  # NeoX/Llama: pairs (i, i + r/2)
        rot_a, rot_b = torch.arange(rotary_dim // 2), torch.arange(rotary_dim // 2, rotary_dim)
    passthrough = torch.arange(rotary_dim, head_dim)
    pass_a, pass_b = passthrough.chunk(2) if len(passthrough) else (passthrough, passthrough)
    return torch.cat([rot_a, pass_a, rot_b, pass_b])


def rotary_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """head_dim/2 frequencies: the checkpoint's for the first rotary_dim/2 pairs, zero after.

    local: the sliding-window layers' own plain rotary (Gemma 3's rotary_base_local), never scaled.
    """
    r = cfg.rotary_dim
    base = cfg.rotary_base_local if local else cfg.rotary_base
    # Same expression as GPT-NeoX/Llama/GPT-J in transformers, so fp32 results agree bit for bit.
    inv_freq = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float) / r))
    scaling = None if local else cfg.rope_scaling
    if scaling is not None and scaling.type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif scaling is not None and scaling.type == "yarn":
        inv_freq = _yarn(base, r, scaling)
    # the short factors until a forward passes the context
    elif scaling is not None and scaling.type == "longrope":
        inv_freq = _longrope(base, r, scaling.short_factor)
    # dynamic: the unscaled frequencies until a forward passes max_position_embeddings
    # (RotaryEmbedding.forward)
    return torch.cat([inv_freq, torch.zeros(cfg.head_dim // 2 - r // 2)])


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: wavelengths above original/low_freq_factor slowed by `factor`, those below
    original/high_freq_factor kept, a linear blend in 1/wavelength between."""
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * slowed / s.factor + smooth * slowed
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, slowed)


def _yarn(base: float, dim: int, s: RopeScaling) -> torch.Tensor:
    """YaRN (Peng et al. 2023, eq. 17-19): per pair, interpolated (/ factor) where it turns fewer
    than beta_slow times over the original context, original where more than beta_fast, a ramp
    between."""
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:  # the pair index that turns `rotations` times
        return (
            dim
            * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate is None or s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp needs two distinct ends
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def _longrope(
    base: float, dim: int, factors: list[float], device: torch.device | None = None
) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * base**exponents)


def rotary_attention_factor(cfg: ModelConfig) -> float:
    """The scale YaRN and LongRoPE put on cos and sin (unless given: YaRN 0.1 ln(factor) + 1,
    LongRoPE sqrt(1 + ln(factor) / ln(original context))), 1 for every other kind."""
    s = cfg.rope_scaling
    if s is None or s.type not in ("yarn", "longrope"):
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.type == "longrope":
        context = s.original_max_position_embeddings
        return 1.0 if s.factor <= 1.0 else math.sqrt(1 + math.log(s.factor) / math.log(context))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return float(mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim))
    return mscale(s.factor)


def dynamic_inv_freq(
    cfg: ModelConfig, position_ids: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """Dynamic NTK: once a forward reaches past max_position_embeddings (its longest position +
    1), the base grows to base * (factor * len / max - (factor - 1)) ** (r / (r - 2)); up to
    there, `inv_freq` as it is. transformers keeps the largest frequencies it has seen in the
    module's state; here they come from each forward's own positions: the same for generation
    (positions only grow), and stateless under activation recompute, pipelines and compile."""
    r, limit = cfg.rotary_dim, cfg.max_position_embeddings
    seq_len = torch.max(position_ids) + 1
    longer = torch.maximum(seq_len, torch.tensor(limit, dtype=seq_len.dtype, device=seq_len.device))
    factor = cfg.rope_scaling.factor
    base = cfg.rotary_base * ((factor * longer / limit) - (factor - 1)) ** (r / (r - 2))
    exponents = (
        torch.arange(0, r, 2, dtype=torch.int64, device=position_ids.device).to(dtype=torch.float)
        / r
    )
    grown = 1.0 / (base**exponents)
    grown = torch.cat([grown, grown.new_zeros(cfg.head_dim // 2 - r // 2)])
    # no host sync: the choice stays on the device
    return torch.where(seq_len > limit, grown, inv_freq)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (batch, 1, seq, head_dim)."""
    return x * cos + rotate_half(x) * sin


def longrope_inv_freq(
    cfg: ModelConfig, position_ids: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """LongRoPE: the long factors for a forward reaching past the pretraining context (its
    longest position + 1), the short ones (`inv_freq`) otherwise; per forward, as transformers
    picks them."""
    s, r = cfg.rope_scaling, cfg.rotary_dim
    long = _longrope(cfg.rotary_base, r, s.long_factor, position_ids.device)
    long = torch.cat([long, long.new_zeros(cfg.head_dim // 2 - r // 2)])
    return torch.where(
        torch.max(position_ids) + 1 > s.original_max_position_embeddings, long, inv_freq
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, local: bool = False):
        super().__init__()
        # Not persistent: derived from the config, so it never goes into checkpoints.
        self.register_buffer("inv_freq", rotary_inv_freq(cfg, local), persistent=False)
        self._cfg, self._local = cfg, local
        scaling = None if local else cfg.rope_scaling
        kind = None if scaling is None else scaling.type
        self._per_forward = {"dynamic": dynamic_inv_freq, "longrope": longrope_inv_freq}.get(kind)
        # YaRN's and LongRoPE's cos/sin scale, on the rotated pairs only (the pass-through dims keep
        # cos 1, sin 0).
        self._attention_factor = 1.0 if local else rotary_attention_factor(cfg)

    def reset_parameters(self) -> None:
        """Recompute the buffer after a meta-device build (`to_empty` leaves it uninitialised)."""
        self.inv_freq.copy_(rotary_inv_freq(self._cfg, self._local).to(self.inv_freq.device))

    def _apply(self, fn, recurse: bool = True):
        """`model.to(torch.bfloat16)` would cast the frequencies too: at position 4095 a bf16
        inv_freq is off by up to 5 rad. Keep them fp32 (as transformers does), recomputed exactly
        rather than cast back."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = rotary_inv_freq(self._cfg, self._local).to(self.inv_freq.device)
        return self

    def forward(
        self, position_ids: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (batch, 1, seq, head_dim) for position_ids of shape (batch, seq)."""
        inv_freq = self.inv_freq
        # dynamic, longrope: frequencies that depend on the forward's positions
        if self._per_forward is not None:
            inv_freq = self._per_forward(self._cfg, position_ids, inv_freq)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        cos, sin = emb.cos(), emb.sin()
        if self._attention_factor != 1.0:
            # partial rotary: the zero-frequency dims pass through
            rotated = torch.cat((inv_freq, inv_freq)) != 0
            f = self._attention_factor
            cos, sin = torch.where(rotated, cos * f, cos), torch.where(rotated, sin * f, sin)
        return cos.to(dtype), sin.to(dtype)
