"""What a model's forward needs of a key/value cache, so that the models do not depend on inference.

The cache itself (preallocated buffers, rings for the sliding-window layers, views over the rows and
slots in use, reset) is lmforge.inference.cache.KVCache, which has this shape; a model only asks it
for the attention masks of the new tokens and for each layer's buffers.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lmforge.models.layers import LayerCache


class KVCache(Protocol):
    def attention_masks(
        self, attention_mask: torch.Tensor | None, position: torch.Tensor
    ) -> dict[int | None, torch.Tensor]:
        """Record which new tokens (going to slots `position`) are real; the SDPA masks for them,
        per window (None: the layers without one), over the keys those layers attend to."""
        ...

    def mask_of(self, i: int) -> int | None:
        """Which of attention_masks' masks layer i takes."""
        ...

    def layer(self, i: int, position: torch.Tensor) -> LayerCache:
        """Layer i's key/value buffers, its new tokens going to slots `position`
        (LayerCache.update)."""
        ...
