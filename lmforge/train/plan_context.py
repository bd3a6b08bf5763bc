"""`lmforge plan` for context parallelism (parallel.context=C > 1): every sequence split over C
ranks (lmforge.parallel.context), sized by a trace of what one context rank holds.

A context rank computes everything but attention on S/C tokens of each sequence, and FSDP2 shards
the model over the data ranks and the context ranks together (torchtitan's dp_shard x cp): the
step of a run at S/C tokens whose data ranks are data_replicate x (data_shard x C), with the global
batch C times larger so that each rank sees the same micro-batches, holds the same parameters,
gradients, optimizer state and activations. That run is traced (lmforge.train.plan), with one
change: each attention layer runs lmforge's context-parallel attention itself
(lmforge.parallel.context_attention, `traced_attention`), its exchanges replaced by the buffers
they fill, so the trace holds what the ring holds (two K/V blocks in flight, its fp32 output and
log-sum-exp for the backward, the fp32 blocks of QUERY_TILE queries) or what the all-gather holds
(every rank's K/V of each layer, kept for the backward). Attention is load-balanced (chunks i and
2C-1-i), so the rank traced stands for every context rank. The bytes the context ranks exchange
per step are comm_volume.context_bytes' (checked against the collectives in
tests/parallel/test_context.py).

`fit_context` answers "which C fits this device": the smallest C whose peak fits, and the largest
micro-batch each C fits, one plan each.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lmforge.errors import UserError
from lmforge.train.config import RunConfig


@dataclass(frozen=True)
class ContextSpec:
    """A context-parallel run as planned: its degree and method, the whole sequence, and the data
    ranks beside the context ranks."""

    context: int
    method: str
    seq_length: int  # tokens of a whole sequence (each rank holds seq_length / context)
    data_replicate: int
    data_shard: int  # without the context ranks (FSDP2 shards over data_shard x context)

    @property
    def data_parallel(self) -> int:
        """Ranks that take different sequences: what divides the global batch."""
        return self.data_replicate * self.data_shard


def data_dims(cfg: RunConfig, world_size: int) -> tuple[int, int]:
    """(data_replicate, data_shard) of `cfg` over `world_size` ranks, parallel.context ranks
    apart: parallel_layout's rule (trainer.data_parallel fills open data dimensions) on what
    tensor x pipeline x context leave."""
    p = cfg.parallel
    fixed = p.tensor * p.pipeline * p.context
    if world_size % fixed:
        raise UserError(
            f"parallel.tensor={p.tensor} x pipeline={p.pipeline} x context={p.context} = {fixed} "
            f"does not divide the world size {world_size}: change the layout or the number of "
            "processes"
        )
    rest = world_size // fixed
    if p.data_shard == -1 and p.data_replicate == 1:
        return (rest, 1) if cfg.trainer.data_parallel == "ddp" else (1, rest)
    shard = rest // p.data_replicate if p.data_shard == -1 else p.data_shard
    if p.data_replicate * shard != rest:
        raise UserError(
            f"parallel layout pipeline={p.pipeline} x data_replicate={p.data_replicate} x "
            f"data_shard={shard} x context={p.context} x tensor={p.tensor} = "
            f"{fixed * p.data_replicate * shard} processes, but the world has {world_size}: make "
            "the product equal the number of processes (data_shard=-1 fills in the rest)"
        )
    return p.data_replicate, shard


def context_standin(cfg: RunConfig, mcfg, world_size: int) -> tuple[RunConfig, ContextSpec | None]:
    """The run the plan traces for `cfg` (see the module docstring) and its ContextSpec; `cfg`
    itself and None without context parallelism. The run's refusals first: a model context
    parallelism cannot split exactly, a sequence that does not cut into 2C chunks, a batch the
    data ranks do not divide."""
    from lmforge.parallel.context import ContextShard, refuse_unsupported
    from lmforge.train.setup import check_fit

    p = cfg.parallel
    if p.context == 1:
        return cfg, None
    refuse_unsupported(mcfg)
    seq = cfg.data.seq_length
    ContextShard(p.context, 0).chunk(seq)
    replicate, shard = data_dims(cfg, world_size)
    check_fit(cfg, mcfg, replicate * shard)
    spec = ContextSpec(p.context, p.context_method, seq, replicate, shard)
    t = cfg.trainer
    traced = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(
            p, context=1, data_replicate=replicate, data_shard=shard * p.context
        ),
        data=dataclasses.replace(cfg.data, seq_length=seq // p.context),
        trainer=dataclasses.replace(t, global_batch_size=t.global_batch_size * p.context),
    )
    return traced, spec


@contextlib.contextmanager
def traced_attention(spec: ContextSpec | None) -> Iterator[None]:
    """Inside: every attention layer runs lmforge's context-parallel attention over this rank's
    S/C tokens as context rank 0 of spec.context, its exchanges (K/V blocks sent on, the
    all-gather, the gradients' reduce-scatter) replaced by the empty buffers they would fill:
    a trace holds what the exchange allocates, and sends nothing. Nothing changes for None."""
    if spec is None:
        yield
        return
    from lmforge.models import layers
    from lmforge.parallel import context_attention as ca

    def attend(q, k, v, mask, causal, scale, softcap, dropout):
        # segment ids of ones (one document a row): the blocks' masks then live on q's device
        segments = torch.ones(
            spec.context, q.shape[0], q.shape[2], dtype=torch.long, device=q.device
        )
        plan = ca.ContextPlan(
            None, spec.context, 0, q.shape[2] // 2, segments, None, scale, softcap
        )
        return ca.context_attention(q, k, v, plan, spec.method, dropout)

    tiles = ca._tiles

    def first_tile(plan, k_rank):
        # Every block of a call allocates the same temporaries (QUERY_TILE queries against a chunk)
        # and frees them before the next; the merge is in place: one block per key rank holds the
        # peak of them all, and a trace of 128k tokens runs in seconds, not minutes.
        return itertools.islice(tiles(plan, k_rank), 1)

    saved = layers.attention, ca._exchange, ca._all_gather, ca._reduce_scatter, ca._tiles
    layers.attention, ca._tiles = attend, first_tile
    ca._exchange = lambda send, recv, plan, tag: []
    ca._all_gather = lambda t, plan: [torch.empty_like(t) for _ in range(plan.context)]
    ca._reduce_scatter = lambda parts, plan: torch.empty_like(parts[plan.rank])
    try:
        yield
    finally:
        layers.attention, ca._exchange, ca._all_gather, ca._reduce_scatter, ca._tiles = saved


def context_step_bytes(cfg: RunConfig, mcfg, spec: ContextSpec, layout, grad_accum: int) -> int:
    """Bytes a context rank sends per step (comm_volume.context_bytes per micro-batch, times the
    step's micro-batches): its stage's layers, its tensor rank's key/value heads, K/V in the
    dtype the layers compute in."""
    from lmforge.parallel.comm_volume import context_bytes

    precision = cfg.precision
    dtype = precision.autocast_dtype or precision.param_dtype
    per_rank = dataclasses.replace(mcfg, num_kv_heads=mcfg.num_kv_heads // layout.tensor)
    sent = context_bytes(
        per_rank,
        spec.context,
        spec.seq_length,
        cfg.trainer.micro_batch_size,
        spec.method,
        kv_bytes=torch.empty(0, dtype=dtype).element_size(),
        recompute=cfg.trainer.activation_checkpointing == "full",
        layers=mcfg.num_layers // layout.pipeline,
    )
    return int(sent["total"]) * grad_accum


def context_note(spec: ContextSpec, sent: int) -> str:
    """The plan's line on how a context-parallel run was sized."""
    from lmforge.train.plan_sizing import size_text as _size

    c, local = spec.context, spec.seq_length // spec.context
    held = (
        "two K/V blocks in flight, its fp32 output and log-sum-exp kept for the backward"
        if spec.method == "ring"
        else "every rank's K/V of a layer, kept for the backward"
    )
    return (
        f"context parallelism: each {spec.seq_length}-token sequence split over {c} ranks "
        f"({local} tokens each, chunks i and {2 * c - 1}-i), attention by {spec.method} ({held}); "
        f"parameters, gradients and optimizer state sharded over data_shard {spec.data_shard} x "
        f"context {c} as FSDP2 folds the context ranks; {_size(sent)} of keys/values and their "
        "gradients sent per step and rank"
    )


def fit_context(cfg: RunConfig, world_size: int, device: str, device_memory: int, plan_run) -> dict:
    """Which parallel.context fits `device_memory`: for C = 1, 2, 4 ... (what the world, the
    sequence and the global batch allow), the largest micro-batch up to the recipe's
    trainer.micro_batch_size whose plan's peak fits (0: none), and the smallest C that fits one.
    A larger C or a smaller micro-batch never holds more, so each C starts from the last C's
    micro-batch. `plan_run`: lmforge.train.plan.plan_run (passed in: plan imports this module)."""

    p, t, seq = cfg.parallel, cfg.trainer, cfg.data.seq_length
    contexts = []
    c = 1
    while world_size % (p.tensor * p.pipeline * c) == 0 and (c == 1 or seq % (2 * c) == 0):
        contexts.append(c)
        c *= 2
    doubling = (1 << i for i in range(t.micro_batch_size.bit_length()))
    micro = sorted({*doubling, t.micro_batch_size})

    def fits(c: int, m: int) -> bool | None:
        run = dataclasses.replace(
            cfg,
            parallel=dataclasses.replace(p, context=c),
            trainer=dataclasses.replace(t, micro_batch_size=m),
        )
        try:
            peak = max(r.peak for r in plan_run(run, world_size, device).ranks)
        except UserError:  # a layout this C or micro-batch cannot take: not a candidate
            return None
        return peak <= device_memory

    best: dict[int, int] = {}
    start = 0
    for c in contexts:
        got = 0
        for i in range(start, len(micro)):
            ok = fits(c, micro[i])
            if not ok:
                break
            got, start = micro[i], i
        best[c] = got
    smallest = next((c for c in contexts if best[c]), None)
    return {
        "device_memory": device_memory,
        "micro_batch_by_context": best,
        "smallest_context": smallest,
    }


def fit_line(fit: dict) -> str:
    """fit_context's answer in one line."""
    memory = fit["device_memory"] / (1 << 30)
    each = ", ".join(
        f"C={c} {m if m else 'none'}" for c, m in fit["micro_batch_by_context"].items()
    )
    c = fit["smallest_context"]
    head = (
        f"parallel.context={c} is the smallest that fits --device-memory {memory:.1f} GiB "
        f"(micro-batch {fit['micro_batch_by_context'][c]})"
        if c
        else f"no parallel.context fits --device-memory {memory:.1f} GiB"
    )
    return f"{head}; the largest micro-batch that fits: {each}"
