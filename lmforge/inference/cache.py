"""A preallocated key/value cache: fixed-size buffers written in place, so shapes never change.

Per layer, k and v buffers of shape (batch, num_kv_heads, max_len, head_dim), allocated once for
prompt + new tokens. Each forward writes its tokens' keys/values to the slots `cache_position`
(`index_copy_`, as transformers' StaticCache does) and attends over the whole buffer; a boolean
`valid` (batch, max_len) marks the slots that hold a real token, so empty slots and left padding
are masked out. With no shape depending on how far generation has got, a decode step can be
captured by torch.compile (or CUDA graphs) once and replayed. A (batch, seq) `cache_position`
gives each row its own slots instead (the serving engine's continuous batching, where rows joined
at different times).

Sliding-window layers (Mistral, Gemma 2/3's local layers, Qwen2's upper layers) keep a ring of
`window` slots instead (cache slot p at p % window), so a long generation's memory grows only in the
layers that see everything: at their whole context Gemma 2 (4096 window, 8192 slots, every other
layer local) holds 3/4 of the keys/values, Gemma 3 (5 local layers to 1 global) 0.15-0.17x, Mistral
(4096 window, 32k) 1/8 (BENCHMARKS.md). `ring_slots` (batch, window) says which cache slot each ring
slot holds (-1: none yet); the masks of the ring layers are built from it and `ring_real` (whether
it holds a real token, not padding); see LayerCache.update for what a ring layer attends over.

Grouped-query attention keeps num_kv_heads heads in the cache (Llama-2-70B: 8 instead of 64);
SDPA's enable_gqa shares them among the query heads without a copy per step.

The models see it through lmforge.models.kv_cache.KVCache (attention_masks and layer), so they need
not import inference.
"""

from __future__ import annotations

import torch

from lmforge.models.config import ModelConfig
from lmforge.models.layers import LayerCache, window_band


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        ring: bool = True,
    ):
        """ring=False: every layer keeps max_len slots, windowed or not (the ring's reference in
        tests)."""
        windows = [cfg.window(i) for i in range(cfg.num_layers)]
        # A window that covers the whole cache is no window for it: those layers keep every slot.
        self.windows = [w if w is not None and w < max_len else None for w in windows]
        self.rings = [w if ring else None for w in self.windows]
        shapes = [(batch_size, cfg.num_kv_heads, w or max_len, cfg.head_dim) for w in self.rings]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        ring_windows = set(self.rings) - {None}
        self.ring_slots = {
            w: torch.full((batch_size, w), -1, dtype=torch.long, device=device)
            for w in ring_windows
        }
        self.ring_real = {
            w: torch.zeros(batch_size, w, dtype=torch.bool, device=device) for w in ring_windows
        }

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, batch_size: int, max_len: int, ring: bool = True
    ) -> KVCache:
        """A cache in the model's dtype and on its device."""
        p = next(model.parameters())
        return cls(model.config, batch_size, max_len, p.dtype, p.device, ring)

    @property
    def max_len(self) -> int:
        return self.valid.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the key/value buffers."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def attention_masks(
        self, attention_mask: torch.Tensor | None, position: torch.Tensor
    ) -> dict[int | None, torch.Tensor]:
        """Record which new tokens are real, then per window (None: the full layers) the SDPA mask
        (batch, 1, seq, keys) for them over the keys that window's layers attend to.

        attention_mask (batch, seq): 1 = token, 0 = padding, for the tokens going to slots
        `position` (seq,), or (batch, seq) when each row writes its own slots; None means all are
        real. A query sees the real tokens in slots up to its own (the last `window` of them in a
        windowed layer) and, like lmforge.models.layers.padding_mask, always itself, so a padding
        query never has an empty row (softmax over nothing is NaN); its output is never read.
        """
        b, s = self.valid.shape[0], position.shape[-1]
        if attention_mask is None:
            real = torch.ones(b, s, dtype=torch.bool, device=self.valid.device)
        else:
            real = attention_mask.to(device=self.valid.device, dtype=torch.bool)
        if position.dim() == 2:  # (batch, seq): each row at its own slots (see LayerCache.update)
            self.valid.scatter_(1, position, real)
        else:
            self.valid.index_copy_(1, position, real)
        slots = torch.arange(self.max_len, device=self.valid.device)
        masks = {None: _visible(slots, self.valid, position)}
        for w in set(self.windows) - {None} - set(self.ring_slots):
            masks[w] = masks[None] & window_band(position, slots, w)
        for w in self.ring_slots:
            masks[w] = self._ring_mask(w, position, real)
        return masks

    def _ring_mask(self, window: int, position: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """The mask of a ring of `window` slots over what LayerCache.update attends to; then the
        ring's new slots.

        A row that starts again at slot 0 (a re-encode, a server's next request in the row) needs
        no reset of its ring: a prefill sees none of the ring's slots at or past its first one,
        and the ring slot p % window a stale key sits at is rewritten when the row gets to p %
        window, before it gets to p."""
        ring_slots, ring_real = self.ring_slots[window], self.ring_real[window]
        new = position if position.dim() == 2 else position.expand(ring_slots.shape[0], -1)
        keep = min(new.shape[1], window)
        old = (ring_slots.clone(), ring_real.clone()) if new.shape[1] > 1 else None
        index = new[:, -keep:] % window
        ring_slots.scatter_(1, index, new[:, -keep:])
        ring_real.scatter_(1, index, real[:, -keep:].expand(new.shape[0], -1))
        if old is None:  # one new token, written over the ring before it attends
            return _visible(ring_slots, ring_real, position, window)
        old_slots, old_real = old
        # A query's own key is among the new ones: an old slot equal to it (a stale one) is never
        # "itself".
        held = old_real & (old_slots < new[:, :1])
        return torch.cat(
            [
                _visible(old_slots, held, position, window, itself=False),
                _visible(new, real, position, window),
            ],
            -1,
        )

    def view(self, rows: slice, length: int) -> KVCache:
        """The same buffers restricted to `rows` and the first `length` slots (views: writes land
        in this cache). A server keeps one cache for all its request slots and runs each step on
        the rows in use and the slots written so far, instead of on the whole preallocated
        buffer. A ring keeps all its slots."""
        view = object.__new__(KVCache)
        view.windows, view.rings = self.windows, self.rings
        view.k = [k[rows] if w else k[rows, :, :length] for k, w in zip(self.k, self.rings)]
        view.v = [v[rows] if w else v[rows, :, :length] for v, w in zip(self.v, self.rings)]
        view.valid = self.valid[rows, :length]
        view.ring_slots = {w: t[rows] for w, t in self.ring_slots.items()}
        view.ring_real = {w: t[rows] for w, t in self.ring_real.items()}
        return view

    def layer(self, i: int, position: torch.Tensor) -> LayerCache:
        return LayerCache(self.k[i], self.v[i], position, self.rings[i])

    def mask_of(self, i: int) -> int | None:
        """The key of layer i's mask in attention_masks."""
        return self.rings[i] or self.windows[i]

    def reset(self) -> None:
        """Forget every cached token (the buffers are reused; stale keys are masked, never read)."""
        self.valid.zero_()
        for slots, real in zip(self.ring_slots.values(), self.ring_real.values(), strict=True):
            slots.fill_(-1)
            real.zero_()


def _visible(
    key_slots: torch.Tensor,
    key_real: torch.Tensor,
    position: torch.Tensor,
    window: int | None = None,
    itself: bool = True,
) -> torch.Tensor:
    """(batch, 1, seq, keys): which keys at cache slots `key_slots` ((keys,) or (batch, keys);
    `key_real` (batch, keys) marks the real ones) the queries at slots `position` ((seq,) or
    (batch, seq)) see: real ones at their own slot or before it, within `window` slots if given,
    and (itself) the key at its own slot, real or not."""
    keys = key_slots[..., None, :]
    query = position[..., None]
    seen = key_real[:, None, :] & (keys <= query)
    if window is not None:
        seen &= keys > query - window
    return (seen | (keys == query) if itself else seen)[:, None]
