"""Pipeline parallelism: a Decoder or Bert split by layer into stages for torch.distributed.pipelining.

The split is manual, not traced: a stage is a small module that *references* the model's own
submodules (the embedding on the first stage, a run of blocks, the final norm and head on the
last), so every parameter keeps its model name ("layers.7.attn.qkv.weight") and a DCP checkpoint
written under any pipeline layout loads under any other. With virtual stages (interleaved 1F1B)
pipeline rank r holds stages r, r + P, r + 2P, ... (Megatron's interleaved assignment).

Tied embeddings (GPT-2, BERT): the last stage keeps its own copy of the word embedding for the
output projection, and after each backward the copies' gradients are summed between the first and
the last stage (Megatron's embedding group), so both stay equal to the single-model weight.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from lmforge.models.layers import padding_mask


class DecoderStage(nn.Module):
    def __init__(self, model: nn.Module, layer_ids: list[int], is_first: bool, is_last: bool):
        super().__init__()
        self.config = model.config
        self.is_first, self.is_last = is_first, is_last
        tied = model.lm_head is None
        self.embed = model.embed if is_first or (is_last and tied) else None
        self.pos_embed = model.pos_embed if is_first else None
        self.drop = model.drop
        self.rope = model.rope
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None
        self.vocab_projection = model.vocab_projection if is_last else None
        self.tied_parameters = ("embed.weight",) if tied and is_last and not is_first else ()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            if position_ids is None:
                b, s = x.shape
                position_ids = torch.arange(s, device=x.device).expand(b, s)
            h = self.embed(x)
            if self.pos_embed is not None:
                h = h + self.pos_embed(position_ids)
            x = self.drop(h)
        rope = None
        if self.rope is not None:
            if position_ids is None:  # a later stage cannot know the sequence length under SP
                raise ValueError("pipeline stages after the first need position_ids (pipeline_step passes them)")
            rope = self.rope(position_ids, x.dtype)
        mask = None
        if attention_mask is not None:
            mask = attention_mask if attention_mask.dim() == 4 else padding_mask(attention_mask, True)
        for layer in self.layers.values():
            x = layer(x, rope, mask)
        if not self.is_last:
            return x
        h = self.norm(x)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        bias = self.lm_head.bias if self.lm_head is not None else None
        return self.vocab_projection(h, weight, bias)


class BertStage(nn.Module):
    def __init__(self, model: nn.Module, layer_ids: list[int], is_first: bool, is_last: bool):
        super().__init__()
        self.config = model.config
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.embeddings = model.embeddings
        elif is_last:  # only the tied word embedding, under its model name
            self.embeddings = nn.Module()
            self.embeddings.word = model.embeddings.word
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.mlm_head = model.mlm_head if is_last else None
        self.tied_parameters = ("embeddings.word.weight",) if is_last and not is_first else ()

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first:
            x = self.embeddings(x, token_type_ids, position_ids)
        mask = padding_mask(attention_mask, False) if attention_mask is not None else None
        for layer in self.layers.values():
            x = layer(x, None, mask)
        if not self.is_last:
            return x
        return self.mlm_head(x, self.embeddings.word.weight)


def stage_ids(pp_rank: int, pp_size: int, virtual_stages: int) -> list[int]:
    """The stages pipeline rank `pp_rank` runs: looped, as the interleaved schedules expect."""
    return [pp_rank + k * pp_size for k in range(virtual_stages)]


def split_model(model: nn.Module, pp_rank: int, pp_size: int, virtual_stages: int = 1) -> list[nn.Module]:
    """This rank's stage modules, each with num_layers / (pp_size * virtual_stages) consecutive blocks."""
    num_stages = pp_size * virtual_stages
    per_stage = len(model.layers) // num_stages
    cls = BertStage if model.config.family == "bert" else DecoderStage
    parts = []
    for stage in stage_ids(pp_rank, pp_size, virtual_stages):
        layers = list(range(stage * per_stage, (stage + 1) * per_stage))
        parts.append(cls(model, layers, stage == 0, stage == num_stages - 1))
    return parts


def build_schedule(parts: list[nn.Module], stages: list[int], num_stages: int, schedule: str, microbatches: int,
                   loss_fn, pp_group, device: torch.device):
    """The torch.distributed.pipelining schedule running `parts` (this rank's stages)."""
    from torch.distributed import pipelining as pl

    pipeline_stages = [pl.PipelineStage(part, index, num_stages, device, group=pp_group)
                       for part, index in zip(parts, stages)]
    cls = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B, "interleaved_1f1b": pl.ScheduleInterleaved1F1B}[schedule]
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
        raise ValueError(f"the local batch of {input_ids.shape[0]} rows does not split into {micro} microbatches")
    config = pm.parts[0].config
    if config.family != "bert" and config.position_embedding == "rotary" and "position_ids" not in kwargs:
        b, s = input_ids.shape  # later stages need them for rotary (and cannot count tokens under SP)
        kwargs["position_ids"] = torch.arange(s, device=input_ids.device).expand(b, s)
    return kwargs


def _sum_over_pipeline(pm, losses, device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=device)
    for loss in losses:
        total += _local(loss).detach().double()
    torch.distributed.all_reduce(total, group=pm.mesh["pp"].get_group())  # only the last stage's is non-zero
    return total


def pipeline_step(pm, input_ids: torch.Tensor, labels: torch.Tensor, loss_fn, **kwargs) -> torch.Tensor:
    """Forward and backward of one local batch; returns the summed loss (float64, on every rank).

    `pm` is a ParallelModel. `loss_fn(logits, labels)` is called once per microbatch on the last
    stage and its value is what gets differentiated: gradients are summed over microbatches, never
    scaled, so normalise inside loss_fn (e.g. summed cross-entropy / the step's global token count).
    kwargs (attention_mask, position_ids, token_type_ids) are split into microbatches with the batch
    and reach every stage. Without pipeline parallelism this is one forward and backward of the model.
    Gradients of tied embeddings are summed between the first and the last stage before returning.
    """
    if not pm.pipelined:
        with pm.loss_context():
            loss = loss_fn(pm(input_ids, **{k: v for k, v in kwargs.items() if v is not None}), labels)
            loss.backward()
        return _local(loss).detach().double()
    kwargs = _stage_inputs(pm, input_ids, kwargs)
    losses: list[torch.Tensor] = []
    pm.loss_fn = loss_fn
    args = (input_ids,) if pm.has_first_stage else ()
    target = labels if pm.has_last_stage else None
    with pm.loss_context():
        pm.schedule.step(*args, target=target, losses=losses, **kwargs)
    sync_tied_gradients(pm)
    return _sum_over_pipeline(pm, losses, input_ids.device)


@torch.no_grad()
def pipeline_eval(pm, input_ids: torch.Tensor, labels: torch.Tensor, loss_fn, **kwargs) -> torch.Tensor:
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
        _reshard(pm)
        for p, g in grads:
            p.grad = g


def _eval(pm, input_ids, labels, loss_fn, kwargs) -> torch.Tensor:
    if not pm.pipelined:
        with pm.loss_context():
            return _local(loss_fn(pm(input_ids, **{k: v for k, v in kwargs.items() if v is not None}),
                                  labels)).double()
    kwargs = _stage_inputs(pm, input_ids, kwargs)
    if pm.eval_schedule is None:
        _, pm.eval_schedule = build_schedule(pm.parts, pm.stage_indices, pm.num_stages, pm.config.pipeline_schedule,
                                             pm.config.num_microbatches, None, pm.mesh["pp"].get_group(), pm.device)
    args = (input_ids,) if pm.has_first_stage else ()
    with pm.loss_context():
        logits = pm.eval_schedule.step(*args, **kwargs)
        losses = [loss_fn(logits, labels)] if pm.has_last_stage else []
    return _sum_over_pipeline(pm, losses, input_ids.device)


def _reshard(pm) -> None:
    """Free FSDP's gathered parameters after a forward without backward (nothing else reshards them
    under a pipeline), which also puts the sharded parameters, holding the gradients, back in place."""
    from torch.distributed.fsdp import FSDPModule

    for part in pm.parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def sync_tied_gradients(pm) -> None:
    """Sum the gradients of a tied embedding's two copies (first stage, last stage)."""
    if pm.tied_group is None:
        return
    from torch.distributed import all_reduce

    for part in pm.parts:
        names = part.tied_parameters or (("embed.weight", "embeddings.word.weight") if part.is_first else ())
        params = dict(part.named_parameters())
        for name in names:
            p = params.get(name)
            if p is None:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if hasattr(p.grad, "placements") and p.grad.placements != p.placements:
                # The embedding's backward may leave a partial or replicated gradient: shard it like
                # the parameter, so both copies' local pieces line up.
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            all_reduce(grad, group=pm.tied_group)
