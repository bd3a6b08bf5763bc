"""Attention kept inside documents: packed sequences without a dense (batch, 1, seq, seq) mask.

A packed row holds several documents one after another (lmforge.data.sft packing): `segment_ids`
(batch, seq) numbers them 1, 2, ... and marks padding 0. A token attends causally to the tokens of
its own document only (to those within its layer's sliding window, if it has one); a padding token
attends to itself alone, so its row is never empty (its output is never scored). `document_mask`
writes that rule out densely: the reference the faster paths are tested against, and what every
layer received before them.

Two ways to compute it without the dense mask (`document_backend` picks one by device):

* "split", the default everywhere: the row is cut at document boundaries into chunks of at least
  `min_chunk` tokens (MIN_CHUNK; on the CPU each document alone), one scaled_dot_product_attention
  call each: is_causal for a chunk holding one document (the fused kernel skips the blocks above the
  diagonal), the chunk's own small block-diagonal mask for a chunk of several short documents (which
  bounds the number of calls). Attention is computed over sum(chunk^2) scores instead of seq^2. The
  boundaries are read on the host once per forward (one device sync; on the CPU none). Under
  torch.compile the call runs between a block's graphs (its shapes change with every batch).
* "flex": FlexAttention (torch.nn.attention.flex_attention) with one BlockMask per window per
  forward, whose fully masked 128 x 128 blocks are never computed; the call is compiled once per
  process (eager FlexAttention materialises every score), traced by Dynamo inside a compiled block.
  Torch 2.6-2.13 has FlexAttention's backward on CUDA and XPU only, never the CPU. Not a default
  yet: on torch 2.13's CPU, FlexAttention compiled *inside* a larger graph gave wrong outputs
  (forward, no grad; the same call compiled alone was right), and no GPU has run it here.
  FLEX_DEVICES names the devices that get it once scripts/gpu_check.py's `documents` check passes
  there.

On FLEX_DEVICES the unpacked causal batch goes through it too where a layer has a sliding window or
soft-capped scores (Documents.causal: one document per row): the window as a block mask beside the
causal one, the cap as a score_mod, where the dense path builds a (seq, seq) band mask or
materialises the capped scores.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from lmforge.models.attention import attention

# Devices that get the flex backend (see the module docstring): FlexAttention trains on "cuda" and
# "xpu" only.
FLEX_DEVICES: tuple[str, ...] = ()
# Inductor's FlexAttention kernels refuse heads narrower than this ("NYI: embedding dimension of the
# query, key, and value must be at least 16", torch 2.11 on an H200): such layers (tiny test models
# only) take the split way.
FLEX_MIN_HEAD_DIM = 16
# The split backend's smallest chunk: shorter documents are grouped up to it (see the module
# docstring), which bounds the calls (on an accelerator each is a kernel launch or a few).
# MIN_CHUNK_BY_DEVICE overrides it by device type: on the CPU a call costs little and a lone
# document's causal kernel skips the masked half, so each document goes alone (fwd+bwd of a
# pythia-70m layer over 2 x 2048 packed Alpaca tokens: 52 ms, against 65 ms grouped up to 128 tokens
# and 372 ms under the dense mask).
MIN_CHUNK = 128
MIN_CHUNK_BY_DEVICE: dict[str, int] = {"cpu": 1}


def document_mask(segment_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The dense boolean mask (batch, 1, seq, seq) of the rule in the module docstring: True =
    may attend."""
    s = segment_ids.shape[1]
    slots = torch.arange(s, device=segment_ids.device)
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] != 0)
    allowed &= slots[None, :, None] >= slots[None, None, :]
    if window is not None:
        allowed &= slots[None, None, :] > slots[None, :, None] - window
    return (allowed | torch.eye(s, dtype=torch.bool, device=segment_ids.device))[:, None]


def document_backend(device: torch.device) -> str:
    """ "flex" on FLEX_DEVICES where FlexAttention can be compiled, "split" elsewhere (see the
    module docstring)."""
    if device.type in FLEX_DEVICES and flex_available():
        return "flex"
    return "split"


@functools.cache
def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return torch._dynamo.is_dynamo_supported() and importlib.util.find_spec("triton") is not None


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once per process (static shapes: a packed batch is always
    seq_length long)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@dataclass
class Chunk:
    """Slots [start, end) of one row, attended as one piece: `kind` "causal" (one document),
    "masked" (several documents, or one longer than a window: with the chunk's own `mask`) or
    "padding" (each slot attends to itself alone)."""

    start: int
    end: int
    kind: str
    mask: torch.Tensor | None = None  # (end - start, end - start), for "masked"


@dataclass
class Documents:
    """The documents of a packed batch, handed to every attention layer in place of a mask. Built
    once per forward outside the layers (Documents.of): the block masks or chunk lists of every
    window the layers use, so that a compiled block neither syncs with the host nor builds them."""

    # (batch, seq): 1, 2, ... per document, 0 on padding; each document contiguous
    segment_ids: torch.Tensor
    backend: str = "split"
    min_chunk: int = MIN_CHUNK
    # Documents.causal: every row one document, no padding (block masks shared by rows)
    one_per_row: bool = False
    # Per window (None: none): its BlockMask ("flex") or per row its chunks ("split"); "runs": each
    # row's runs of ids.
    plans: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        segment_ids: torch.Tensor,
        windows: Iterable[int | None] = (None,),
        backend: str | None = None,
        min_chunk: int | None = None,
        one_per_row: bool = False,
    ) -> Documents:
        docs = cls(
            segment_ids,
            backend or document_backend(segment_ids.device),
            min_chunk or MIN_CHUNK_BY_DEVICE.get(segment_ids.device.type, MIN_CHUNK),
            one_per_row,
        )
        seq = segment_ids.shape[1]
        for window in {w if w is not None and w < seq else None for w in windows}:
            docs.plans[window] = (
                docs._block_mask(window) if docs.backend == "flex" else docs._chunks(window)
            )
        return docs

    @classmethod
    def causal(
        cls,
        batch: int,
        seq: int,
        windows: Iterable[int | None],
        device: torch.device,
        backend: str | None = None,
    ) -> Documents:
        """An unpacked causal batch as one document per row, so that FlexAttention's block masks
        (the causal one, narrowed to each window) and its soft-capping score_mod serve it without
        a dense mask."""
        return cls.of(
            torch.ones(batch, seq, dtype=torch.long, device=device),
            windows,
            backend,
            one_per_row=True,
        )

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
        scale: float | None,
        softcap: float | None,
        dropout: float,
    ) -> torch.Tensor:
        """Attention output (batch, heads, seq, head_dim) for q (batch, heads, seq, head_dim) and
        k, v with heads a divisor of q's (grouped-query attention, never repeated here)."""
        if window is not None and window >= q.shape[2]:
            window = None
        if window not in self.plans:
            raise ValueError(
                f"Documents.of was not given window {window}: pass every layer's window"
            )
        if (
            self.backend == "flex"
            and not dropout
            and min(q.shape[-1], v.shape[-1]) >= FLEX_MIN_HEAD_DIM
        ):
            return self._flex(q, k, v, window, scale, softcap)
        # with dropout (FlexAttention has none) or narrow heads: split, planned on first
        # use
        if self.backend == "flex":
            self.plans.setdefault(("split", window), self._chunks(window))
            return _split_attention(self.plans[("split", window)], q, k, v, scale, softcap, dropout)
        return _split_attention(self.plans[window], q, k, v, scale, softcap, dropout)

    # -- split backend

    def _chunks(self, window: int | None) -> list[list[Chunk]]:
        if "runs" not in self.plans:
            self.plans["runs"] = _runs(self.segment_ids)
        return [
            self._plan(runs, ids, window) for runs, ids in zip(self.plans["runs"], self.segment_ids)
        ]

    def _plan(
        self, runs: list[tuple[int, int, int]], ids: torch.Tensor, window: int | None
    ) -> list[Chunk]:
        chunks: list[Chunk] = []
        group: list[tuple[int, int, int]] = []

        def close():
            if not group:
                return
            start, end = group[0][0], group[-1][1]
            single = len(group) == 1 and (window is None or end - start <= window)
            chunks.append(
                Chunk(start, end, "causal")
                if single
                else Chunk(start, end, "masked", document_mask(ids[None, start:end], window)[0, 0])
            )
            group.clear()

        for start, end, segment in runs:
            if segment == 0:
                close()
                chunks.append(Chunk(start, end, "padding"))
                continue
            group.append((start, end, segment))
            if group[-1][1] - group[0][0] >= self.min_chunk:
                close()
        close()
        return chunks

    # -- flex backend

    def _flex(self, q, k, v, window, scale, softcap) -> torch.Tensor:
        score_mod = None
        if softcap is not None:

            def score_mod(score, b, h, q_idx, kv_idx):
                return torch.tanh(score / softcap) * softcap

        from torch.nn.attention.flex_attention import flex_attention

        # Inside a compiled block Dynamo traces the call itself; eager, the call compiled once per
        # process.
        attend = flex_attention if torch.compiler.is_compiling() else compiled_flex_attention()
        return attend(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=self.plans[window],
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    def _block_mask(self, window: int | None):
        from torch.nn.attention.flex_attention import create_block_mask

        ids = self.segment_ids

        def mask_mod(b, h, q_idx, kv_idx):
            same = q_idx >= kv_idx
            if not self.one_per_row:
                same = same & (ids[b, q_idx] == ids[b, kv_idx]) & (ids[b, kv_idx] != 0)
            if window is not None:
                same = same & (kv_idx > q_idx - window)
            return same | (q_idx == kv_idx)

        b, s = ids.shape
        # One document per row: the same mask for every row, built once (batch None).
        return create_block_mask(
            mask_mod, None if self.one_per_row else b, None, s, s, device=ids.device
        )


def _runs(segment_ids: torch.Tensor) -> list[list[tuple[int, int, int]]]:
    """Per row, its runs of equal segment ids: (start, end, id), read from the device once."""
    rows = []
    for r, ids in enumerate(segment_ids.tolist()):
        runs, seen, start = [], set(), 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[start]:
                if ids[start] and ids[start] in seen:
                    raise ValueError(
                        f"segment_ids: document {ids[start]} of row {r} is not contiguous: "
                        "each document's tokens must follow one another"
                    )
                seen.add(ids[start])
                runs.append((start, i, ids[start]))
                start = i
        rows.append(runs)
    return rows


# shapes that change with every batch: a compiled block calls it between its graphs
@torch.compiler.disable
def _split_attention(
    rows: list[list[Chunk]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    softcap: float | None,
    dropout: float,
) -> torch.Tensor:
    out = []
    for chunks, qr, kr, vr in zip(rows, q.unbind(0), k.unbind(0), v.unbind(0)):
        sizes = [c.end - c.start for c in chunks]
        pieces = []
        for c, qc, kc, vc in zip(
            chunks, qr.split(sizes, 1), kr.split(sizes, 1), vr.split(sizes, 1)
        ):
            if c.kind == "padding":  # softmax over one key: the value itself, for each query head
                pieces.append(vc.repeat_interleave(qc.shape[0] // vc.shape[0], dim=0))
                continue
            pieces.append(
                attention(
                    qc[None],
                    kc[None],
                    vc[None],
                    c.mask,
                    c.kind == "causal",
                    scale,
                    softcap,
                    dropout,
                )[0]
            )
        out.append(torch.cat(pieces, 1))
    return torch.stack(out)
