"""Pipeline parallelism: a Decoder or Bert split by layer into stages for
torch.distributed.pipelining.

A stage is the model itself with the modules it does not hold removed (torchtitan's
pipeline_module_split): the same class and the same forward, which skips what is absent and takes
hidden states on a stage after the first / returns them on a stage before the last (the models'
is_first / is_last). Nothing is allocated or copied: a stage is a shallow copy of the model object
with registries of its own, holding the model's own submodules, so every parameter keeps its model
name ("layers.7.attn.qkv.weight") and a DCP checkpoint written under any pipeline layout loads under
any other. With virtual stages (interleaved 1F1B) pipeline rank r holds stages r, r + P, r + 2P, ...
(Megatron's interleaved assignment).

Tied embeddings (GPT-2, BERT): the last stage also holds the word embedding for the output
projection (its own copy once the ranks are separate processes), and after each backward the copies'
gradients are summed between the first and the last stage (Megatron's embedding group), so both stay
equal to the single-model weight.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

# Which stages hold each of a model's submodules besides `layers` (split by index). The last stage
# of a tied model also holds the word embedding, which its head reads. A submodule not named here is
# an error (a stage would silently miss it, or every stage would hold its parameters).
_FIRST = {"decoder": {"embed", "pos_embed", "drop"}, "bert": {"embeddings"}}
_LAST = {
    "decoder": {"norm", "lm_head", "vocab_projection", "score"},
    "bert": {"mlm_head", "pooler", "classifier", "drop"},
}
_EVERY = {"decoder": {"rope", "rope_local"}, "bert": set()}


class StageLayers(nn.Module):
    """A stage's run of blocks under their model indices (so "layers.7.attn.qkv.weight" keeps its
    name), iterated like the model's ModuleList: `for layer in self.layers` in the model's
    forward, FSDP and tensor-parallel plans per block, activation checkpointing."""

    def __init__(self, layers: nn.ModuleList, layer_ids: list[int]):
        super().__init__()
        for i in layer_ids:
            self.add_module(str(i), layers[i])

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


def _pruned(module: nn.Module, keep: set[str]) -> nn.Module:
    """`module` holding only the submodules named in `keep` (the others None, which its forward
    skips).

    A shallow copy: the same class and attributes, the model's own submodule and parameter objects
    (nothing allocated, a meta model stays on meta), but its own registries (_modules, _parameters,
    hooks), so pruning it, wrapping it in FSDP or hooking it leaves the model alone.
    """
    stage = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            vars(stage)[key] = copy.copy(value)
    for name in module._modules:
        if name not in keep:
            stage._modules[name] = None
    return stage


def _stage(model: nn.Module, layer_ids: list[int], is_first: bool, is_last: bool) -> nn.Module:
    family = "bert" if model.config.family == "bert" else "decoder"
    first, last, every = _FIRST[family], _LAST[family], _EVERY[family]
    unknown = set(model._modules) - first - last - every - {"layers"}
    if unknown:
        raise RuntimeError(
            f"split_model does not know which pipeline stage holds {sorted(unknown)}"
        )
    stage = _pruned(model, every | (first if is_first else set()) | (last if is_last else set()))
    stage.layers = StageLayers(model.layers, layer_ids)
    stage.is_first, stage.is_last = is_first, is_last
    stage.tied_parameters = ()
    if is_last and not is_first:
        # only the word embedding, under its model name
        if family == "bert" and model.mlm_head is not None:
            stage.embeddings = _pruned(model.embeddings, {"word"})
            stage.tied_parameters = ("embeddings.word.weight",)
        elif family == "decoder" and model.lm_head is None and model.score is None:
            stage.embed = model.embed
            stage.tied_parameters = ("embed.weight",)
    return stage


def stage_ids(pp_rank: int, pp_size: int, virtual_stages: int) -> list[int]:
    """The stages pipeline rank `pp_rank` runs: looped, as the interleaved schedules expect."""
    return [pp_rank + k * pp_size for k in range(virtual_stages)]


def split_model(
    model: nn.Module, pp_rank: int, pp_size: int, virtual_stages: int = 1
) -> list[nn.Module]:
    """This rank's stages, each the model (same class, same forward) holding num_layers /
    (pp_size * virtual_stages) consecutive blocks and, on the first and last stage, the
    embeddings and the head."""
    num_stages = pp_size * virtual_stages
    per_stage = len(model.layers) // num_stages
    parts = []
    for stage in stage_ids(pp_rank, pp_size, virtual_stages):
        layers = list(range(stage * per_stage, (stage + 1) * per_stage))
        parts.append(_stage(model, layers, stage == 0, stage == num_stages - 1))
    return parts


@dataclass(frozen=True)
class StageShapes:
    """What a pipeline's stages exchange, known in advance: `rows` per microbatch, `seq_length`
    tokens (split over `seq_shards` tensor-parallel ranks under sequence parallelism), hidden
    states in `dtype`; the last stage's logits over the padded vocabulary where loss_parallel
    keeps them vocabulary-parallel (VocabParallelProjection), else over the real one."""

    rows: int
    seq_length: int
    dtype: torch.dtype
    seq_shards: int = 1
    padded_logits: bool = False


def stage_examples(config, stage: int, num_stages: int, shapes: StageShapes, device: torch.device):
    """Example (inputs, outputs) of pipeline stage `stage` for a microbatch of `shapes`: the
    token ids into the first stage, the hidden states (rows, local sequence, hidden) between
    stages, the logits (or class scores) out of the last."""
    rows, seq = shapes.rows, shapes.seq_length
    hidden = torch.empty(
        rows,
        seq // shapes.seq_shards,
        config.hidden_size,
        dtype=shapes.dtype,
        device=device,
        requires_grad=True,
    )  # what has a gradient goes back to the stage before
    inputs = torch.empty(rows, seq, dtype=torch.long, device=device) if stage == 0 else hidden
    if stage < num_stages - 1:
        return inputs, hidden
    vocab = config.padded_vocab_size if shapes.padded_logits else config.vocab_size
    width = [config.num_labels] if config.num_labels else [seq, vocab]
    return inputs, torch.empty(rows, *width, dtype=shapes.dtype, device=device, requires_grad=True)


def build_schedule(
    parts: list[nn.Module],
    stages: list[int],
    num_stages: int,
    schedule: str,
    microbatches: int,
    loss_fn,
    pp_group,
    device: torch.device,
    shapes: StageShapes | None = None,
):
    """The torch.distributed.pipelining schedule running `parts` (this rank's stages).

    Without `shapes` the stages learn what they exchange from messages at the first step; with them
    they are built static (no messages: `lmforge plan`'s fake process group carries none), and where
    this torch can, each microbatch is checked against them.
    """
    from torch.distributed import pipelining as pl

    pipeline_stages = []
    for part, index in zip(parts, stages):
        examples = {}
        if shapes is not None:
            inputs, outputs = stage_examples(part.config, index, num_stages, shapes, device)
            examples = {"input_args": (inputs,), "output_args": (outputs,)}
        pipeline_stages.append(
            pl.PipelineStage(part, index, num_stages, device, group=pp_group, **examples)
        )
        if shapes is not None and hasattr(pipeline_stages[-1], "_runtime_validate"):
            # torch >= 2.13: a wrong shape fails at its stage
            pipeline_stages[-1]._runtime_validate = True
    cls = {
        "gpipe": pl.ScheduleGPipe,
        "1f1b": pl.Schedule1F1B,
        "interleaved_1f1b": pl.ScheduleInterleaved1F1B,
    }[schedule]
    kwargs = {"loss_fn": loss_fn}
    # torch >= 2.7 divides gradients by the microbatch count unless told not to; 2.6 never does.
    # Our loss_fn is normalised already (by the step's global token count), so never scale.
    if "scale_grads" in inspect.signature(cls).parameters:
        kwargs["scale_grads"] = False
    if cls is pl.ScheduleInterleaved1F1B:
        return pipeline_stages, cls(pipeline_stages, microbatches, **kwargs)
    return pipeline_stages, cls(pipeline_stages[0], microbatches, **kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss that loss_parallel returned as a replicated DTensor, as a plain tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _stage_inputs(pm, input_ids: torch.Tensor, kwargs: dict) -> dict:
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    micro = pm.config.num_microbatches
    if input_ids.shape[0] % micro:
        raise ValueError(
            f"the local batch of {input_ids.shape[0]} rows does not split into {micro} microbatches"
        )
    config = pm.parts[0].config
    if (
        config.family != "bert"
        and config.position_embedding == "rotary"
        and "position_ids" not in kwargs
    ):
        # later stages need them for rotary (and cannot count tokens under SP)
        b, s = input_ids.shape
        kwargs["position_ids"] = torch.arange(s, device=input_ids.device).expand(b, s)
    return kwargs


def _sum_over_pipeline(pm, losses, device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=device)
    for loss in losses:
        total += _local(loss).detach().double()
    # only the last stage's is non-zero
    torch.distributed.all_reduce(total, group=pm.mesh["pp"].get_group())
    return total


def pipeline_step(
    pm, input_ids: torch.Tensor, labels: torch.Tensor, loss_fn, **kwargs
) -> torch.Tensor:
    """Forward and backward of one local batch; returns the summed loss (float64, on every rank).

    `pm` is a ParallelModel. `loss_fn(logits, labels)` is called once per microbatch on the last
    stage and its value is what gets differentiated: gradients are summed over microbatches, never
    scaled, so normalise inside loss_fn (e.g. summed cross-entropy / the step's global token count).
    kwargs (attention_mask, position_ids, token_type_ids) are split into microbatches with the batch
    and reach every stage. Without pipeline parallelism this is one forward and backward of the
    model. Gradients of tied embeddings are summed between the first and the last stage before
    returning. A mixture of experts' router losses join the loss per microbatch, coef x loss /
    microbatches (router.PipelineRouterLosses).
    """
    if not pm.pipelined:
        with pm.loss_context():
            loss = loss_fn(
                pm(input_ids, **{k: v for k, v in kwargs.items() if v is not None}), labels
            )
            loss.backward()
        return _local(loss).detach().double()
    kwargs = _stage_inputs(pm, input_ids, kwargs)
    losses: list[torch.Tensor] = []
    pm.loss_fn = loss_fn
    args = (input_ids,) if pm.has_first_stage else ()
    target = labels if pm.has_last_stage else None
    if pm.router is not None:
        pm.router.begin(pm.config.num_microbatches)
    with pm.loss_context():
        pm.schedule.step(*args, target=target, losses=losses, **kwargs)
    if pm.router is not None:
        pm.router.end()  # pm.router.losses: the step's router losses
    sync_tied_gradients(pm)
    return _sum_over_pipeline(pm, losses, input_ids.device)


@torch.no_grad()
def pipeline_eval(
    pm, input_ids: torch.Tensor, labels: torch.Tensor, loss_fn, **kwargs
) -> torch.Tensor:
    """Forward only (validation): loss_fn(logits of the local batch, labels), on every rank.

    Runs a forward-only schedule over the same stage modules (built on first use; torch 2.6 has no
    forward-only mode for a training schedule), whose last stage returns the batch's logits.
    """
    # Newer torch cleans up after the first step's shape inference by dropping FSDP parameters'
    # gradients: keep the training gradients whatever happens here.
    grads = [(p, p.grad) for p in pm.parameters()]
    try:
        return _eval(pm, input_ids, labels, loss_fn, kwargs)
    finally:
        pm.reshard()  # also puts the sharded parameters, holding the gradients, back in place
        for p, g in grads:
            p.grad = g


def _eval(pm, input_ids, labels, loss_fn, kwargs) -> torch.Tensor:
    if not pm.pipelined:
        with pm.loss_context():
            return _local(
                loss_fn(pm(input_ids, **{k: v for k, v in kwargs.items() if v is not None}), labels)
            ).double()
    kwargs = _stage_inputs(pm, input_ids, kwargs)
    if pm.eval_schedule is None:
        _, pm.eval_schedule = build_schedule(
            pm.parts,
            pm.stage_indices,
            pm.num_stages,
            pm.config.pipeline_schedule,
            pm.config.num_microbatches,
            None,
            pm.mesh["pp"].get_group(),
            pm.device,
            pm.stage_shapes,
        )
    args = (input_ids,) if pm.has_first_stage else ()
    with pm.loss_context():
        logits = pm.eval_schedule.step(*args, **kwargs)
        losses = [loss_fn(logits, labels)] if pm.has_last_stage else []
    return _sum_over_pipeline(pm, losses, input_ids.device)


def sync_tied_gradients(pm) -> None:
    """Sum the gradients of a tied embedding's two copies (first stage, last stage)."""
    if pm.tied_group is None:
        return
    from torch.distributed import all_reduce

    for part in pm.parts:
        names = part.tied_parameters or (
            ("embed.weight", "embeddings.word.weight") if part.is_first else ()
        )
        params = dict(part.named_parameters())
        for name in names:
            p = params.get(name)
            # a frozen embedding (a LoRA run's base) has no gradient
            if p is None or not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if hasattr(p.grad, "placements") and p.grad.placements != p.placements:
                # The embedding's backward may leave a partial or replicated gradient: shard it like
                # the parameter, so both copies' local pieces line up.
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            all_reduce(grad, group=pm.tied_group)
