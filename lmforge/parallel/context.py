"""Context parallelism: one sequence split over the C ranks of a context group, attention across
them.

The sequence (length S, a multiple of 2C) is cut into 2C chunks; rank i holds chunk i and chunk
2C-1-i (`ContextShard`), so under causal attention every rank has the same number of (query chunk,
key chunk) pairs to compute: the early chunk sees few keys, the late one many. A batch is split by
`split_batch` (input_ids, labels, position_ids, segment_ids: every tensor along its sequence
dimension) and put back by `gather_sequence`. Rotary positions come from position_ids, which the
split carries with the tokens, so each chunk rotates by its global positions (packed documents: the
positions restart with each document, as in one process). Attention across the ranks is
lmforge.parallel.context_attention (all-gather of K/V, or a ring); a decoder runs it through
`ContextDocuments`, which its layers receive where they would receive a packed batch's Documents
(`apply_context_parallel` sets the decoder's documents_fn hook to make them).

Why lmforge's own, not torch.distributed.tensor.experimental.context_parallel (an experimental API;
read and run here in torch 2.13, the source under its _context_parallel/ package; 2.6-2.11 not run
here):
* It runs only on SDPA's flash, memory-efficient and cuDNN kernels (its dispatcher handles those
  aten ops and raises "CP only supports flash attention and memory efficient attention" for the
  others). On the CPU, SDPA calls _scaled_dot_product_flash_attention_for_cpu, which has no sharding
  rule: a causal call under context_parallel on gloo raises "does not have a sharding strategy
  registered" (checked with torch 2.13), and pytorch/pytorch#147793 reports the math kernel failing
  the same way. So no CPU tests, and none on a backend without those kernels (lmforge is
  device-neutral).
* Its SDPA path takes no mask (attn_bias "is not supported yet"): no packed documents, no sliding
  window, no soft cap. Document masks exist only on its FlexAttention path (a CP block mask), whose
  backward torch has on CUDA and XPU only.
* It shards buffers in place by resizing them (a leaf that requires grad is refused) and patches
  F.scaled_dot_product_attention globally for the duration of a context manager.
On CUDA, for plain causal attention without a mask, torch's ring (its SDPA kernels, all-gather or
all-to-all rotation) is a candidate for speed; lmforge's blocks are the reference it would be
measured and tested against. Per block lmforge calls SDPA's CPU flash kernel
(lmforge.parallel.context_attention), and the CUDA flash kernel (which returns the log-sum-exp too)
is the piece to add there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.documents import Documents
from lmforge.parallel.context_attention import METHODS, ContextPlan, context_attention


@dataclass(frozen=True)
class ContextShard:
    """Which part of the sequence this rank holds: chunks `rank` and `2 * context - 1 - rank` of
    2 * context."""

    context: int
    rank: int
    group: dist.ProcessGroup | None = None  # None: the default group

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> ContextShard:
        return cls(dist.get_world_size(group), dist.get_rank(group), group)

    def chunk(self, seq: int) -> int:
        if seq % (2 * self.context):
            raise UserError(
                f"sequence length {seq} does not split into 2 x {self.context} equal chunks for "
                f"context parallelism: make seq_length a multiple of {2 * self.context}"
            )
        return seq // (2 * self.context)

    def slots(self, seq: int, device: torch.device | None = None) -> torch.Tensor:
        """The global slots this rank holds, in its local order."""
        c = self.chunk(seq)
        a, b = self.rank, 2 * self.context - 1 - self.rank
        return torch.cat(
            [
                torch.arange(a * c, (a + 1) * c, device=device),
                torch.arange(b * c, (b + 1) * c, device=device),
            ]
        )


def split_sequence(t: torch.Tensor, shard: ContextShard, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `t` along `dim` (the sequence), concatenated."""
    c = shard.chunk(t.shape[dim])
    a, b = shard.rank, 2 * shard.context - 1 - shard.rank
    return torch.cat([t.narrow(dim, a * c, c), t.narrow(dim, b * c, c)], dim)


def split_batch(
    batch: Mapping[str, torch.Tensor], shard: ContextShard, dim: int = 1, keep: Iterable[str] = ()
) -> dict[str, torch.Tensor]:
    """Every tensor of the batch split along its sequence dimension `dim`, except those named in
    `keep`; position_ids added (0 .. seq-1 on every row) where the batch has none, so that rotary
    positions stay global. Labels must already be aligned with their inputs (a task's `inputs`
    shifts them): the target of a chunk's last token lives in the next chunk, on another rank."""
    keep = set(keep)
    out = dict(batch)
    if "position_ids" not in out:
        ids = out.get("input_ids")
        if ids is None:
            raise ValueError(
                "split_batch needs input_ids or position_ids to know the sequence length"
            )
        out["position_ids"] = torch.arange(ids.shape[dim], device=ids.device).expand(
            ids.shape[0], -1
        )
    return {k: v if k in keep else split_sequence(v, shard, dim) for k, v in out.items()}


def gather_sequence(t: torch.Tensor, shard: ContextShard, dim: int = 1) -> torch.Tensor:
    """The whole sequence back from every rank's `split_sequence` (outside autograd: for outputs
    and checks)."""
    parts = [torch.empty_like(t) for _ in range(shard.context)]
    dist.all_gather(parts, t.detach().contiguous(), group=shard.group)
    halves = [p.chunk(2, dim) for p in parts]
    order = [halves[r][0] for r in range(shard.context)] + [
        halves[r][1] for r in reversed(range(shard.context))
    ]
    return torch.cat(order, dim)


@dataclass
class ContextDocuments(Documents):
    """Documents whose attention spans every rank of a context group: the decoder's layers call
    `attend` with their local q, k, v (this rank's two chunks) as they would for a packed batch.
    `segment_ids` are the local ones; `all_segments` (context, batch, local) every rank's,
    gathered once per forward."""

    shard: ContextShard | None = None
    method: str = "ring"
    all_segments: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def of_shard(
        cls, segment_ids: torch.Tensor, shard: ContextShard, method: str = "ring"
    ) -> ContextDocuments:
        if method not in METHODS:
            raise UserError(
                f"parallel.context_method={method!r} is not one of {', '.join(METHODS)}"
            )
        parts = [torch.empty_like(segment_ids) for _ in range(shard.context)]
        dist.all_gather(parts, segment_ids.contiguous(), group=shard.group)
        return cls(segment_ids, shard=shard, method=method, all_segments=torch.stack(parts))

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
        s = self.shard
        plan = ContextPlan(
            s.group, s.context, s.rank, q.shape[2] // 2, self.all_segments, window, scale, softcap
        )
        return context_attention(q, k, v, plan, self.method, dropout)


def check_context(cfg, model: ModelConfig) -> None:  # cfg: lmforge.parallel.mesh.ParallelConfig
    """UserError when context parallelism cannot run this layout or model exactly: a layout it
    does not compose with, or a model setting (lmforge.parallel.context.refuse_unsupported)."""
    c = cfg.context
    if cfg.pipeline > 1:
        raise UserError(
            f"parallel.context={c} with parallel.pipeline={cfg.pipeline} is not supported (pipeline "
            "stages would pass the split sequence and its documents between them): set "
            "parallel.pipeline=1 and shard the model with parallel.data_shard or parallel.tensor"
        )
    if cfg.expert > 1 or model.num_experts:
        raise UserError(
            f"parallel.context={c} with a mixture-of-experts model is not supported (the router's "
            "load-balancing loss counts each rank's chunks, not the whole sequence): set "
            "parallel.context=1, or train a dense model"
        )
    refuse_unsupported(model)


def refuse_unsupported(cfg: ModelConfig) -> None:
    """A UserError naming the first of the model's settings that context parallelism cannot run
    exactly."""
    if not cfg.causal:
        raise UserError(
            "context parallelism needs causal attention: an encoder (causal=false) is not supported"
        )
    if cfg.attention_dropout:
        raise UserError(
            "attention_dropout under context parallelism is not supported: set attention_dropout=0"
        )
    scaling = cfg.rope_scaling.type if cfg.rope_scaling is not None else None
    if scaling in ("dynamic", "longrope"):
        # Their frequencies follow the forward's longest position, which differs between the ranks'
        # chunks.
        raise UserError(
            f"rope_scaling {scaling} under context parallelism is not supported: its frequencies "
            "depend on each forward's longest position; use linear, yarn or llama3"
        )


def apply_context_parallel(model: nn.Module, shard: ContextShard, method: str = "ring") -> None:
    """Lay `model` (a Decoder) out over the context group of `shard`: its layers attend across the
    group (ContextDocuments, through the decoder's documents_fn hook). Then call it with this
    rank's split segment_ids (ones for a batch without packed documents) and position_ids
    (split_batch)."""
    refuse_unsupported(model.config)
    if method not in METHODS:
        raise UserError(f"parallel.context_method={method!r} is not one of {', '.join(METHODS)}")

    def documents(segment_ids: torch.Tensor, windows=(None,)) -> ContextDocuments:
        return ContextDocuments.of_shard(segment_ids, shard, method)

    model.documents_fn = documents


@contextlib.contextmanager
def context_parallel_decoder(
    model: nn.Module, shard: ContextShard, method: str = "ring"
) -> Iterator[None]:
    """apply_context_parallel for the duration of the block: inside, `model` attends across the
    context group; after, over its own tokens again."""
    before = model.__dict__.get("documents_fn")
    apply_context_parallel(model, shard, method)
    try:
        yield
    finally:
        if before is None:
            del model.documents_fn
        else:
            model.documents_fn = before
