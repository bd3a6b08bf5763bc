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
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.models.config import ModelConfig


def rotary_permutation(head_dim: int, rotary_dim: int, interleaved: bool) -> torch.Tensor:
    """perm with lmforge_dim[j] = checkpoint_dim[perm[j]] for one head (see module docstring)."""
    if interleaved:  # GPT-J: pairs (2i, 2i+1)
        rot_a, rot_b = torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)
    else:  # NeoX/Llama: pairs (i, i + r/2)
        rot_a, rot_b = torch.arange(rotary_dim // 2), torch.arange(rotary_dim // 2, rotary_dim)
    passthrough = torch.arange(rotary_dim, head_dim)
    pass_a, pass_b = passthrough.chunk(2) if len(passthrough) else (passthrough, passthrough)
    return torch.cat([rot_a, pass_a, rot_b, pass_b])


def rotary_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """head_dim/2 frequencies: the checkpoint's for the first rotary_dim/2 pairs, zero after."""
    r = cfg.rotary_dim
    # Same expression as GPT-NeoX/Llama/GPT-J in transformers, so fp32 results agree bit for bit.
    inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, r, 2, dtype=torch.float) / r))
    return torch.cat([inv_freq, torch.zeros(cfg.head_dim // 2 - r // 2)])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (batch, 1, seq, head_dim)."""
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Not persistent: derived from the config, so it never goes into checkpoints.
        self.register_buffer("inv_freq", rotary_inv_freq(cfg), persistent=False)
        self._cfg = cfg

    def reset_parameters(self) -> None:
        """Recompute the buffer after a meta-device build (`to_empty` leaves it uninitialised)."""
        self.inv_freq.copy_(rotary_inv_freq(self._cfg).to(self.inv_freq.device))

    def _apply(self, fn, recurse: bool = True):
        """`model.to(torch.bfloat16)` would cast the frequencies too: at position 4095 a bf16 inv_freq is off by
        up to 5 rad. Keep them fp32 (as transformers does), recomputed exactly rather than cast back."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = rotary_inv_freq(self._cfg).to(self.inv_freq.device)
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (batch, 1, seq, head_dim) for position_ids of shape (batch, seq)."""
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)
