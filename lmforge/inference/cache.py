"""A preallocated key/value cache: fixed-size buffers written in place, so shapes never change.

Per layer, k and v buffers of shape (batch, num_kv_heads, max_len, head_dim), allocated once for
prompt + new tokens. Each forward writes its tokens' keys/values to the slots `cache_position`
(`index_copy_`, as transformers' StaticCache does) and attends over the whole buffer; a boolean
`valid` (batch, max_len) marks the slots that hold a real token, so empty slots and left padding
are masked out. With no shape depending on how far generation has got, a decode step can be
captured by torch.compile (or CUDA graphs) once and replayed. A (batch, seq) `cache_position`
gives each row its own slots instead (the serving engine's continuous batching, where rows joined
at different times).

Grouped-query attention keeps num_kv_heads heads in the cache (Llama-2-70B: 8 instead of 64);
SDPA's enable_gqa shares them among the query heads without a copy per step.

The models see it through lmforge.models.kv_cache.KVCache (attention_mask and layer), so they need not
import inference.
"""

from __future__ import annotations

import torch

from lmforge.models.config import ModelConfig
from lmforge.models.layers import LayerCache


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, max_len: int) -> KVCache:
        """A cache in the model's dtype and on its device."""
        p = next(model.parameters())
        return cls(model.config, batch_size, max_len, p.dtype, p.device)

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    def attention_mask(self, attention_mask: torch.Tensor | None, position: torch.Tensor) -> torch.Tensor:
        """Record which new tokens are real, then the SDPA mask (batch, 1, seq, max_len) for them.

        attention_mask (batch, seq): 1 = token, 0 = padding, for the tokens going to slots `position`
        (seq,), or (batch, seq) when each row writes its own slots; None means all are real. A query
        sees the real tokens in slots up to its own and, like lmforge.models.layers.padding_mask,
        always itself, so a padding query never has an empty row (softmax over nothing is NaN); its
        output is never read.
        """
        b, s = self.valid.shape[0], position.shape[-1]
        if attention_mask is None:
            real = torch.ones(b, s, dtype=torch.bool, device=self.valid.device)
        else:
            real = attention_mask.to(device=self.valid.device, dtype=torch.bool)
        slots = torch.arange(self.max_len, device=self.valid.device)
        if position.dim() == 2:  # (batch, seq): each row at its own slots (see LayerCache.write)
            self.valid.scatter_(1, position, real)
            causal = slots <= position[..., None]
            return ((self.valid[:, None, :] & causal) | (slots == position[..., None]))[:, None]
        self.valid.index_copy_(1, position, real)
        causal = slots <= position[:, None]
        return (self.valid[:, None, None, :] & causal) | (slots == position[:, None])

    def view(self, rows: slice, length: int) -> KVCache:
        """The same buffers restricted to `rows` and the first `length` slots (views: writes land in this
        cache). A server keeps one cache for all its request slots and runs each step on the rows in use
        and the slots written so far, instead of on the whole preallocated buffer."""
        view = object.__new__(KVCache)
        view.k = [k[rows, :, :length] for k in self.k]
        view.v = [v[rows, :, :length] for v in self.v]
        view.valid = self.valid[rows, :length]
        return view

    def layer(self, i: int, position: torch.Tensor) -> LayerCache:
        return LayerCache(self.k[i], self.v[i], position)

    def reset(self) -> None:
        """Forget every cached token (the buffers are reused; stale keys are masked, never read)."""
        self.valid.zero_()
