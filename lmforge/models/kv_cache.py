"""What a model's forward needs of a key/value cache, so that the models do not depend on inference.

The cache itself (preallocated buffers, views over the rows and slots in use, reset) is
lmforge.inference.cache.KVCache, which has this shape; a model only asks it for the attention mask of
the new tokens and for each layer's buffers.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lmforge.models.layers import LayerCache


class KVCache(Protocol):
    def attention_mask(self, attention_mask: torch.Tensor | None, position: torch.Tensor) -> torch.Tensor:
        """Record which new tokens (going to slots `position`) are real; the SDPA mask over the cache for them."""
        ...

    def layer(self, i: int, position: torch.Tensor) -> LayerCache:
        """Layer i's key/value buffers, its new tokens written to slots `position`."""
        ...
