"""GRPO under tensor and pipeline parallelism: the rollout on a whole copy of the live weights, and
the pipeline's scoring of rollout batches.

Rollout. The decode loop runs the model one token at a time: through the stages that is a
send/recv per stage and token, under tensor parallelism a collective per block and token, and the
KV cache split as the heads are. Instead each rank materialises the whole model once per step
(tensor-parallel shards gathered with full_tensor, the stages' tensors broadcast in the pipeline
group) into a plain copy of the model built on the meta device at prepare, rolls out exactly what
one process would (the same weights, prompts and seed on every rank of a data-parallel group: the
same tokens, without a broadcast) and drops the copy before the step's forward. The cost is one
whole model's weights per rank for the rollout's duration (a pipeline rank's own stage is not
copied), what one process holds; generating on one rank and broadcasting the tokens costs that
rank the same and leaves the others idle.

Scoring through a pipeline. A step's micro-batches go through the schedule as one batch padded to
data.seq_length, and the last stage gets one target tensor split by rows: each rollout batch is
laid out in sequence positions (the completion mask over prompt + completion, the positions each
row counts from its first token, its rollout statistics on its first row) so that micro-batches of
other prompt widths stack, and the target holds, per position, the token, the loss mask, the
sampling and the reference log-probabilities (float64 holds the ids and fp32 values exactly).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge.parallel.data_parallel import unwrap
from lmforge.rl.loss import policy_loss
from lmforge.rl.rollout import full_logits
from lmforge.train.tasks.base import Batch, pipeline_reference

# the columns of a pipeline target per position, in this order, then advantage and statistics
TARGET = ("input_ids", "loss_mask", "sampling_logps", "completion_mask", "ref_logps")


def meta_copy(model: nn.Module) -> nn.Module:
    """`model` (its adapters too) with every parameter and buffer on the meta device: the shape a
    rollout copy is filled into, costing no memory."""
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def whole_weights(pm) -> dict[str, torch.Tensor]:
    """The whole model's parameters and persistent buffers under their names, on every rank, on
    the model's device: shards gathered (full_tensor), and under a pipeline each stage's tensors
    broadcast by its rank to the other ranks of the pipeline group. A rank's own stage is its own
    tensors, not a copy (detached)."""
    from lmforge.models.nf4 import gathered
    from lmforge.parallel.state import model_state_dict, redistributing_quietly

    with redistributing_quietly():
        local = {
            name: (gathered(t) if isinstance(t, DTensor) else t).detach()
            for name, t in model_state_dict(pm).items()
        }
    if pm.size("pp") == 1:
        return local
    group = pm.mesh["pp"].get_group()
    listing = [(n, tuple(t.shape), t.dtype) for n, t in sorted(local.items())]
    listings: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(listings, listing, group=group)
    me, full = dist.get_rank(), {}
    for src, held in zip(dist.get_process_group_ranks(group), listings, strict=True):
        for name, shape, dtype in held:
            if name in full:  # a tied embedding's last-stage copy
                continue
            # every rank takes the sender's tensor, a tied copy's holder too (one broadcast each)
            t = (
                local[name].contiguous()
                if me == src
                else torch.empty(shape, dtype=dtype, device=pm.device)
            )
            dist.broadcast(t, src=src, group=group)
            full[name] = t
    return full


def filled(skeleton: nn.Module, weights: dict[str, torch.Tensor], pm) -> nn.Module:
    """A copy of the meta `skeleton` holding `weights` (tied parameters share one tensor) and the
    laid-out model's non-persistent buffers (rotary frequencies, which every stage holds), in
    eval mode, without gradients."""
    model = copy.deepcopy(skeleton)
    tied: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    for names in tied.values():
        held = [n for n in names if n in weights]
        if not held:
            raise RuntimeError(f"the rollout copy has no weights for {names[0]}")
        param = nn.Parameter(weights[held[0]], requires_grad=False)
        for name in names:
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner)._parameters[leaf] = param
    laid = {n: b for part in pm.parts for n, b in unwrap(part).named_buffers()}
    for name, _ in model.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        source = weights if leaf not in module._non_persistent_buffers_set else laid
        if name not in source:
            raise RuntimeError(f"the rollout copy has no buffer {name}")
        module._buffers[leaf] = source[name]
    return model.eval()


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """FSDP2: every unit's whole parameters gathered for the rollout and kept through its decode
    steps (a block would otherwise gather again at each token), sharded again after it, before
    the step's forward and backward. Anything else: as it is."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    inner = [m for m in units if m is not model]
    if isinstance(model, FSDPModule):
        # The root's set-up, which its first forward would run: a block's forward before it would
        # take the block for a root (the rollout calls the blocks, not the root's forward).
        model._get_fsdp_state()._lazy_init()
        model.unshard()
    for m in inner:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
        # lmforge.parallel.compose shards each block with reshard_after_forward=True
        for m in inner:
            m.set_reshard_after_forward(True, recurse=False)


@contextlib.contextmanager
def rollout_copy(skeleton: nn.Module, pm) -> Iterator[nn.Module]:
    """The whole model on this rank for the rollout, freed when the block ends."""
    model = filled(skeleton, whole_weights(pm), pm)
    try:
        yield model
    finally:
        del model


# -- scoring through the pipeline ------------------------------------------------------------


def pipeline_batch(batch: Batch, rollout_stats: int) -> Batch:
    """A rollout batch in sequence positions (see the module docstring)."""
    batch = dict(batch)
    p = int(batch.pop("prompt_length"))
    mask = batch["attention_mask"]
    completion = mask.clone()
    completion[:, :p] = 0
    stats = torch.zeros(mask.shape[0], rollout_stats, dtype=torch.float64, device=mask.device)
    stats[0] = batch.pop("rollout_stats")
    return batch | {
        "completion_mask": completion,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "row_stats": stats,
    }


def token_logps(
    logits: torch.Tensor,
    ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """completion_logps over whole sequences: (rows, length - 1) log-probabilities (and
    entropies) of tokens 1.. from the logits at positions ..length - 2, 0 off the completions."""
    logp_all = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    mask = completion_mask[:, 1:]
    logps = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logps, entropy


def pipeline_target(batch: Batch, ref_logps: torch.Tensor | None, rollout_stats: int):
    """The last stage's target: per position the TARGET columns, then the advantage and the row's
    share of the rollout statistics."""
    ids = batch["input_ids"]
    ref = torch.zeros_like(ids, dtype=torch.float64) if ref_logps is None else ref_logps
    columns = [batch[k] if k != "ref_logps" else ref for k in TARGET]
    extra = [batch["advantages"][:, None], batch["row_stats"][:, :rollout_stats]]
    return torch.cat([c.double() for c in columns + extra], 1)


def split_target(target: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
    out = {k: target[:, i * length : (i + 1) * length] for i, k in enumerate(TARGET)}
    rest = target[:, len(TARGET) * length :]
    out["input_ids"] = out["input_ids"].long()
    return out | {"advantages": rest[:, 0], "row_stats": rest[:, 1:]}


def pipelined_reference_logps(reference, pm, batch: Batch, temperature: float) -> torch.Tensor:
    """The reference's log-probabilities per position (0 at the first) on the pipeline's last
    stage, zeros on the others: a forward-only pass of the reference's stages (or the policy's
    with its adapters off: `reference` None) over the local batch."""
    ids, completion = batch["input_ids"], batch["completion_mask"]
    rows: list[torch.Tensor] = []

    def collect(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        lp, _ = token_logps(logits, labels, completion, temperature)
        rows.append(torch.cat([lp.new_zeros(len(lp), 1), lp], 1))
        return torch.zeros((), device=labels.device)

    inputs = {"attention_mask": batch["attention_mask"], "position_ids": batch["position_ids"]}
    pipeline_reference(reference, pm, ids, ids, collect, **inputs)
    return rows[-1] if rows else torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)


def pipeline_loss(g, vocab_size: int, logits: torch.Tensor, target: torch.Tensor):
    """GRPO.loss from the last stage's logits of one microbatch and its rows of pipeline_target
    (`g`: the run's GRPOConfig), with the same statistics in the same order."""
    t = split_target(target, logits.shape[1])
    completion = t["completion_mask"][:, 1:]
    logps, entropy = token_logps(
        full_logits(logits, vocab_size),
        t["input_ids"],
        t["completion_mask"],
        g.temperature,
        with_entropy=True,
    )
    mask = t["loss_mask"][:, 1:]
    loss, count, stats = policy_loss(
        logps,
        t["advantages"],
        mask,
        loss_type=g.loss_type,
        epsilon=g.epsilon,
        epsilon_high=g.epsilon_high,
        beta=g.beta,
        ref_logps=t["ref_logps"][:, 1:].float() if g.beta else None,
        max_completion_length=g.max_completion_length,
    )
    with torch.no_grad():
        spent = (entropy * mask).sum()
        diff = ((t["sampling_logps"][:, 1:].float() - logps) * completion).abs().sum()
    return loss, count, (*stats.as_tuple(), spent, diff, *t["row_stats"].sum(0).unbind())
