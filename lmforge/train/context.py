"""Context parallelism on the trainer's side (parallel.context=C): which runs it serves, and each
micro-batch cut into this rank's chunks after the task has built its inputs.

The ranks of a context group read the same samples (lmforge.parallel.mesh.data_parallel_rank leaves
the context dim out). The task turns a micro-batch into (input_ids, labels, keyword inputs) first,
so labels are shifted on the whole sequence (the target of a chunk's last token lives in the next
chunk, on another rank); then every one of those (rows, positions) tensors is split alike
(lmforge.parallel.context.split_batch): position_ids stay the global ones, so rotary rotates each
chunk by its place in the sequence (or in its packed document), and segment_ids carry a packed
batch's documents across the chunks (ones: one document per row). The loss is the task's LM loss on
the chunks; the step normalises it by the global batch's label count and reduces it, its
statistics and the gradients over data x context, so C ranks give one process's loss and gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.errors import UserError
from lmforge.parallel.context import ContextShard, apply_context_parallel, split_batch
from lmforge.parallel.mesh import ParallelConfig
from lmforge.train.loss import IGNORE_INDEX, SCORED_ROWS
from lmforge.train.tasks import Task
from lmforge.train.tasks.base import lm_loss

# What a task's inputs may hand the model for the split: the rest would need a rule of its own.
SPLIT_INPUTS = ("segment_ids", "position_ids", "attention_mask")


def check_context_run(cfg, layout: ParallelConfig, task: Task) -> None:
    """UserError, before anything is built, for a run that context parallelism does not serve:
    a task whose loss is not the LM loss over its labels, torch.compile, QLoRA's NF4 base."""
    c = layout.context
    if c == 1:
        return
    if type(task).loss is not Task.loss:
        raise UserError(
            f"parallel.context={c} with data.task={task.name} is not supported (each rank scores "
            "its chunks of a language-model loss): use data.task=pretrain or sft, or "
            "parallel.context=1"
        )
    if cfg.trainer.compile:
        raise UserError(
            f"parallel.context={c} with trainer.compile=true is not supported (the attention "
            "exchanges keys/values inside the blocks): set trainer.compile=false"
        )
    if cfg.lora is not None and cfg.lora.base_dtype == "nf4":
        raise UserError(
            f"parallel.context={c} with lora.base_dtype=nf4 (QLoRA) is not supported: set "
            "lora.base_dtype=bf16, or parallel.context=1"
        )


def context_shard(mesh) -> ContextShard:
    """This rank's place in its context group (the mesh's "cp" dim)."""
    cp = mesh["cp"]
    return ContextShard(cp.size(), cp.get_local_rank(), cp.get_group())


def apply_context(model: torch.nn.Module, layout: ParallelConfig, mesh) -> ContextSplit | None:
    """The decoder's attention laid out over the mesh's context group, and how its micro-batches
    are split; None for parallel.context=1."""
    if layout.context == 1 or mesh is None:
        return None
    shard = context_shard(mesh)
    apply_context_parallel(model, shard, layout.context_method)
    return ContextSplit(shard)


@dataclass
class ContextSplit:
    """A laid-out model's micro-batches cut into this rank's chunks, and their loss."""

    shard: ContextShard

    def multiple(self, tensor_shards: int = 1) -> int:
        """What a micro-batch's length must be a multiple of: 2C chunks, each rank's two chunks
        splitting again over the sequence-parallel ranks."""
        return 2 * self.shard.context * tensor_shards

    def split(self, task: Task, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The task's inputs for a padded micro-batch (input_ids, labels, position_ids,
        segment_ids), each this rank's chunks."""
        ids, labels, inputs = task.inputs(batch)
        extra = set(inputs) - set(SPLIT_INPUTS)
        if extra:
            raise UserError(
                f"parallel.context cannot split the task's inputs {sorted(extra)}: set "
                "parallel.context=1"
            )
        rows, seq = ids.shape
        segments = inputs.get("segment_ids")
        if segments is None:
            mask = inputs.get("attention_mask")
            # right padding as its own segment 0 (it sees itself only); its outputs are never scored
            segments = mask.long() if mask is not None else torch.ones_like(ids, dtype=torch.long)
        positions = inputs.get("position_ids")
        if positions is None:
            positions = torch.arange(seq, device=ids.device).expand(rows, seq)
        whole = {
            "input_ids": ids,
            "labels": labels,
            "position_ids": positions,
            "segment_ids": segments,
        }
        return split_batch(whole, self.shard)

    @staticmethod
    def labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["labels"]

    @staticmethod
    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], fused: bool = True):
        """(summed loss, labels scored, 0) of this rank's chunks: Task.loss on split inputs."""
        labels = batch["labels"]
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "segment_ids")}
        loss = lm_loss(model, inputs, labels, fused, batch.get(SCORED_ROWS))
        return loss, (labels != IGNORE_INDEX).sum(), 0
