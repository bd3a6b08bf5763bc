"""The model laid out for training, and one step on it: the trainer's side of lmforge.parallel.

Every run goes through here, one process included: the Trainer hands its built model to
ParallelTraining, which applies the layout (build_mesh + parallelize: DDP, FSDP2/HSDP, tensor,
sequence and pipeline parallelism, or nothing for one process) and then gives the trainer:

- a step: this data-parallel rank's micro-batches, each forward through the task's loss (with a
  pipeline, all of them in one pipeline_step call, one pipeline microbatch each), the loss
  normalised by the step's global label count, the gradients clipped by their global norm;
- validation (forward only, pipeline_eval under a pipeline);
- checkpoint state: the model under its own parameter names (model_state_dict) and one optimizer per
  pipeline part, flattened per parameter name, so that DCP reshards both between any two layouts;
- the whole model gathered on rank 0 for the Hugging Face export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.nf4 import gathered
from lmforge.models.router_losses import router_losses
from lmforge.parallel import (
    ParallelConfig,
    ParallelModel,
    all_reduce_data_parallel,
    clip_grad_norm_,
    data_parallel_rank,
    load_model_state_dict,
    model_state_dict,
    parallelize,
    pipeline_eval,
    pipeline_step,
    with_router_loss,
)
from lmforge.parallel.compose import fsdp_mixed_precision
from lmforge.parallel.data_parallel import gradient_sync, unwrap
from lmforge.parallel.pipeline import StageShapes
from lmforge.parallel.state import redistributing_quietly
from lmforge.train.config import OptimConfig, Precision
from lmforge.train.loss import IGNORE_INDEX, SCORED_PER_ROW, SCORED_ROWS
from lmforge.train.optim import build_optimizer
from lmforge.train.tasks import Task, count_tokens

log = logging.getLogger(__name__)

# Optimizer state keyed by parameter name ("state.layers.0.mlp.up.weight.exp_avg",
# "param_groups.<name>.lr"): the nested form lists each group's parameters once per rank, which
# cannot be merged across pipeline stages.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def check_pipeline_batch(
    layout: ParallelConfig,
    grad_accum: int,
    micro_batch_size: int,
    global_batch_size: int,
    data_parallel: int,
) -> ParallelConfig:
    """The layout with parallel.microbatches = the step's micro-batches per data-parallel rank.

    A pipeline step runs the whole local batch, one pipeline microbatch per micro-batch, so the
    gradient accumulation *is* the microbatch count: global = micro x microbatches x data-parallel.
    """
    if layout.pipeline == 1:
        return layout
    if layout.microbatches and layout.microbatches != grad_accum:
        product = micro_batch_size * layout.microbatches * data_parallel
        raise UserError(
            f"trainer.global_batch_size {global_batch_size} must equal micro_batch_size "
            f"{micro_batch_size} x parallel.microbatches {layout.microbatches} x {data_parallel} "
            f"data-parallel = {product}: set trainer.global_batch_size={product}, or "
            f"parallel.microbatches={grad_accum} (0 derives it)"
        )
    pp, n = layout.pipeline, grad_accum
    if layout.pipeline_schedule != "gpipe" and n < pp:
        raise UserError(
            f"parallel.pipeline_schedule={layout.pipeline_schedule} needs at least parallel.pipeline={pp} "
            f"microbatches per step, the batch gives {n} (global {global_batch_size} / (micro "
            f"{micro_batch_size} x {data_parallel} data-parallel)): raise trainer.global_batch_size or "
            "lower trainer.micro_batch_size"
        )
    if layout.pipeline_schedule == "interleaved_1f1b" and n % pp:
        raise UserError(
            f"parallel.pipeline_schedule=interleaved_1f1b needs the microbatches per step ({n}) to be a "
            f"multiple of parallel.pipeline={pp}: change trainer.global_batch_size or micro_batch_size"
        )
    return dataclasses.replace(layout, microbatches=n)


def as_stats(value) -> tuple:
    """A task's statistics as a tuple (one statistic comes as a plain number)."""
    return value if isinstance(value, tuple) else (value,)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss that loss_parallel returned as a replicated DTensor, as a plain tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def _device_scalar(value, device: torch.device) -> torch.Tensor:
    """A number or a one-element tensor as a float64 scalar on `device` (a device tensor is not
    read)."""
    if isinstance(value, torch.Tensor):
        return _local(value).detach().to(torch.float64).reshape(())
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def scored_positions(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """A host batch's (rows, positions) labels -> SCORED_ROWS (flat indices of the scored labels,
    sent to the device with the batch) and SCORED_PER_ROW (each row's count, kept on the host)."""
    scored = labels != IGNORE_INDEX
    return {SCORED_ROWS: scored.reshape(-1).nonzero().squeeze(1), SCORED_PER_ROW: scored.sum(1)}


def pad_batch(batch: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """Right-pad every (rows, positions) tensor of a collated batch to `length` positions: labels
    with -100 (not scored), everything else with 0 (masked out, or a padding segment)."""
    out = {}
    for key, t in batch.items():
        extra = length - t.shape[1] if t.dim() == 2 else 0
        if extra > 0:
            fill = IGNORE_INDEX if key == "labels" else 0
            t = torch.cat([t, t.new_full((t.shape[0], extra), fill)], 1)
        out[key] = t
    return out


class PartOptimizers:
    """One optimizer per pipeline part, driven as one: torch's state-dict helpers name an
    optimizer's parameters through one module, and a rank with virtual stages holds several."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


class ParallelTraining:
    """A model laid out over the run's DeviceMesh (none for one process) and how the trainer
    drives it."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: ParallelConfig,
        mesh,
        task: Task,
        optim: OptimConfig,
        precision: Precision,
        seed: int,
        seq_length: int,
        device: torch.device,
        fill: Callable[[ParallelModel], object] | None = None,
        pipeline_rows: int | None = None,
        compile_block: Callable[[torch.nn.Module], object] | None = None,
        context=None,
    ):
        """`mesh`: build_mesh's for `layout` (None for one process). `fill`: what gives a
        meta-device `model` its tensors once it is laid out, each rank only its own shards:
        lmforge.parallel.load.load_sharded (weights from a folder or checkpoint) or init_sharded
        (a fresh model). `pipeline_rows`: a pipeline microbatch's rows, if the stages are to be
        built with static shapes (lmforge plan; by default they exchange them at the first step).
        `compile_block`: applied to each block once laid out (torch.compile). `context`: the
        model's lmforge.train.context.ContextSplit under parallel.context > 1 (its attention laid
        out over the context group), which cuts each micro-batch into this rank's chunks."""
        mcfg: ModelConfig = model.config
        self.mesh = mesh
        self.context = context
        sp_shards = layout.tensor if layout.tensor > 1 and layout.sequence_parallel else 1
        if context is not None and task.pretraining and seq_length % context.multiple(sp_shards):
            raise UserError(
                f"data.seq_length {seq_length} is not a multiple of {context.multiple(sp_shards)}: "
                f"parallel.context={layout.context} cuts each sequence into 2 x {layout.context} "
                f"chunks{' split again over the tensor ranks' if sp_shards > 1 else ''}; change "
                "data.seq_length or parallel.context"
            )
        if (
            layout.tensor > 1
            and layout.sequence_parallel
            and task.pretraining
            and seq_length % layout.tensor
        ):
            raise UserError(
                f"data.seq_length {seq_length} is not divisible by parallel.tensor={layout.tensor}: "
                "sequence parallelism splits each sequence evenly; change one, or set "
                "parallel.sequence_parallel=false"
            )
        if layout.tensor > 1 and (mcfg.dropout or mcfg.attention_dropout):
            log.warning(
                "dropout under tensor parallelism draws the same mask on every tensor-parallel rank "
                "(the presets train without dropout)"
            )
        shapes = None
        mp_policy = fsdp_mixed_precision(layout, precision.param_dtype, precision.autocast_dtype)
        if pipeline_rows is not None:
            shards = layout.tensor if layout.tensor > 1 and layout.sequence_parallel else 1
            # Stages exchange bf16 hidden states under FSDP2's mixed precision (bf16 weights, inputs
            # cast), fp32 under autocast alone (its residual stream stays fp32).
            hidden = (
                mp_policy.param_dtype
                if mp_policy is not None and layout.data_parallel > 1
                else (precision.param_dtype)
            )
            shapes = StageShapes(
                pipeline_rows,
                seq_length,
                hidden,
                shards,
                layout.tensor > 1 and layout.loss_parallel,
            )
        self.pm = parallelize(
            model,
            layout,
            self.mesh,
            mp_policy=mp_policy,
            device=device,
            stage_shapes=shapes,
            compile_block=compile_block,
        )
        if fill is not None:
            fill(self.pm)

        def lay_out_frozen(
            other: torch.nn.Module, fill_other: Callable | None = None
        ) -> ParallelModel:
            # FSDP2 then gathers it and never reduces; DDP has nothing to do
            other.requires_grad_(False)
            laid = parallelize(
                other, layout, self.mesh, mp_policy=mp_policy, device=device, stage_shapes=shapes
            )
            if fill_other is not None:
                fill_other(laid)
            return laid.eval()

        task.lay_out(lay_out_frozen)
        self.layout, self.task, self.seq_length = layout, task, seq_length
        self.model_config = mcfg
        self.router_metrics: dict[str, float] = {}  # a MoE model's router losses of the last step
        self.autocast_dtype = precision.autocast_dtype
        # the LM loss of lmforge.train.loss; benchmarks/train.py profiles both ways
        self.fused_loss = True
        self.dp_rank, self.dp_size = data_parallel_rank(self.mesh)
        # FSDP2 averages gradients over data x context ranks: the loss is scaled by both (step)
        self.reduced_size = self.dp_size * self.pm.context_size
        # AdamWSR draws its rounding noise from (seed, step): a stage offset keeps two stages' noise
        # apart.
        stages = self.pm.stage_indices or [0]
        self.optimizer = PartOptimizers(
            [
                build_optimizer(part, optim, precision, seed + 7919 * stage)
                for part, stage in zip(self.pm.parts, stages, strict=True)
            ]
        )

    @property
    def model(self) -> torch.nn.Module:
        """The model itself without a pipeline (DDP's wrapped module), else the ParallelModel of
        the stages."""
        return self.pm if self.pm.pipelined else unwrap(self.pm.parts[0])

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.pm.device.type, self.autocast_dtype)

    def _inputs(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Micro-batches as one batch on the device. A pipeline's stages keep the shapes of their
        first step, so its batches are padded to data.seq_length; sequence parallelism needs a
        multiple of TP. The positions a token loss scores are found here, on the host
        (SCORED_ROWS, and SCORED_PER_ROW: each row's count, left on the host), so the loss need
        not ask the device; on CUDA the batch goes through pinned memory and the copies do not
        wait."""
        if self.pm.pipelined:
            length = self.seq_length
        else:
            longest = max(
                (t.shape[1] for b in batches for t in b.values() if t.dim() == 2), default=0
            )
            multiple = (
                self.layout.tensor
                if self.layout.tensor > 1 and self.layout.sequence_parallel
                else 1
            )
            if self.context is not None:
                multiple = self.context.multiple(multiple)
            length = -(-longest // multiple) * multiple
        batches = [pad_batch(b, length) for b in batches]
        batch = (
            {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
            if len(batches) > 1
            else batches[0]
        )
        if self.context is not None:  # this rank's chunks of the task's inputs
            batch = self.context.split(self.task, batch)
            labels = batch["labels"]
        else:
            labels = self.task.inputs(batch)[1]
        host = scored_positions(labels) if labels.dim() == 2 and labels.device.type == "cpu" else {}
        if SCORED_ROWS in host:
            batch = {**batch, SCORED_ROWS: host.pop(SCORED_ROWS)}
        # host tensors only: a batch may be on the device already
        pin = self.pm.device.type == "cuda"

        def moved(v: torch.Tensor) -> torch.Tensor:
            return (
                v.pin_memory() if pin and v.device.type == "cpu" and not v.is_pinned() else v
            ).to(self.pm.device, non_blocking=True)

        return {**{k: moved(v) for k, v in batch.items()}, **host}

    def global_counts(self, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """[labelled items, tokens] of the step's micro-batches summed over the data-parallel
        ranks, on the device (float64): what the loss is normalised by, known before any backward
        (accumulation and data parallelism then give one big batch's gradient). Counted on the
        host batches: no host sync."""
        counts = torch.tensor(
            [sum(self.task.count(b) for b in micro), sum(count_tokens(b) for b in micro)],
            dtype=torch.float64,
        )
        return all_reduce_data_parallel(counts.to(self.pm.device), self.mesh)

    def micro_loss(self, batch: dict[str, torch.Tensor]) -> tuple:
        """(summed loss, items, correct) of one micro-batch on the device, through the whole
        model (no pipeline)."""
        with self._autocast():
            if self.context is not None:
                return self.context.loss(self.pm.parts[0], batch, self.fused_loss)
            return self.task.loss(self.pm.parts[0], batch, self.fused_loss)

    def step(
        self, micro: list[dict[str, torch.Tensor]], counts, max_norm: float
    ) -> tuple[float, float]:
        """Forward and backward of this rank's micro-batches; (global mean loss, gradient norm
        before clipping).

        `counts`: global_counts(micro). Each micro-batch's summed loss is divided by the step's
        global label count, and multiplied by the data-parallel size (x the context size) because
        DDP and FSDP2 average gradients over the data (and context) ranks, not over tensor or
        pipeline ranks: the gradient is then the global batch's mean-loss gradient. Under context
        parallelism each rank's loss and statistics cover its chunks: they are summed over data x
        context. The host reads the device once, at the end: loss,
        statistics, norm and tokens together (step_stats, step_tokens).
        """
        dp, pm = self.reduced_size, self.pm
        if not isinstance(counts, torch.Tensor):  # numbers, as an older caller gave them
            counts = torch.tensor(counts, dtype=torch.float64, device=pm.device)
        total = torch.zeros((), dtype=torch.float64, device=pm.device)
        # count, task stats
        stats = torch.zeros(1 + self.task.num_stats, dtype=torch.float64, device=pm.device)
        if pm.pipelined:
            pieces: list[torch.Tensor] = []

            def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
                loss, items, task_stats = self.task.pipeline_loss(logits, target)
                pieces.append(self._stats(items, task_stats))
                return loss / counts[0].to(loss.dtype) * dp

            batch = self._inputs(micro)
            ids, _, kwargs = self.task.inputs(batch)
            with self._autocast():
                target = self.task.pipeline_target(pm, batch)
                total += pipeline_step(pm, ids, target, loss_fn, **kwargs)
            # torch >= 2.13 infers the backward's shapes at the first step by calling loss_fn once
            # more, first, on stand-in outputs: only the microbatches' own calls count.
            stats += self._pipeline_stats(pieces[-self.layout.num_microbatches :])
            # the step's router losses, means over the pipeline's microbatches
            if pm.router is not None:
                router = all_reduce_data_parallel(pm.router.losses.clone(), self.mesh) / dp
        else:
            # aux and z-loss summed over micro-batches
            router = torch.zeros(2, dtype=torch.float64, device=pm.device)
            for i, batch in enumerate(micro):
                with gradient_sync(pm.parts[0], i == len(micro) - 1), pm.loss_context():
                    batch = self._inputs([batch])
                    loss, items, task_stats = self.micro_loss(batch)
                    # The count in the loss's dtype: the division a Python number would give.
                    loss = loss / counts[0].to(loss.dtype) * dp
                    extra = self._router_loss(batch, router, len(micro))
                    with_router_loss(loss, extra).backward()
                total += _local(loss).detach().double()
                stats += self._stats(items, task_stats)
            if self.model_config.num_experts:
                # Each rank's mean over its micro-batches, averaged over the data-parallel ranks.
                router = all_reduce_data_parallel(router / len(micro), self.mesh) / dp
        reduced = all_reduce_data_parallel(
            torch.cat([total.reshape(1), stats]), self.mesh, context=True
        )
        norm = clip_grad_norm_(pm, max_norm)
        tokens = counts.reshape(-1)[1:2]  # none where a caller gave the count alone
        moe = router if self.model_config.num_experts else total.new_zeros(0)
        # the step's one host sync
        values = torch.cat([reduced, norm.reshape(1), tokens, moe]).tolist()
        n = len(reduced)
        self.step_stats = values[1:n]  # the step's global count and task statistics
        self.step_tokens = values[n + 1] if len(tokens) else 0.0
        if len(moe):
            aux, z = values[-2:]
            self.router_metrics = {
                "aux_loss": aux,
                **({"z_loss": z} if self.model_config.router_z_loss_coef else {}),
            }
        return values[0] / dp, values[n]

    def _stats(self, items, task_stats) -> torch.Tensor:
        """A micro-batch's (items, task statistics), numbers or device scalars, as one float64
        vector on the device, without reading the device."""
        return torch.stack(
            [_device_scalar(v, self.pm.device) for v in (items, *as_stats(task_stats))]
        )

    def _pipeline_stats(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The (items, task statistics) the last pipeline stage's loss_fn calls gathered, summed,
        on every pipeline rank (the other stages computed none)."""
        stats = (
            torch.stack(pieces).sum(0)
            if pieces
            else torch.zeros(1 + self.task.num_stats, dtype=torch.float64, device=self.pm.device)
        )
        dist.all_reduce(stats, group=self.pm.mesh["pp"].get_group())
        return stats

    def _router_loss(
        self, batch: dict[str, torch.Tensor], sums: torch.Tensor, micro: int
    ) -> torch.Tensor | None:
        """A MoE model's router losses of the micro-batch just run (added into `sums`), scaled
        for backward: the step trains on the mean over micro-batches and data-parallel ranks of
        coef x loss, as transformers adds router_aux_loss_coef x aux_loss to each forward's loss
        (DDP/FSDP average the gradient over the ranks, which is the mean over ranks here: unlike
        the token loss, no multiplying by their number)."""
        if not self.model_config.num_experts:
            return None
        mask = self.task.inputs(batch)[2].get("attention_mask")
        losses = router_losses(
            self.pm.parts[0],
            self.model_config,
            mask if mask is not None and mask.dim() == 2 else None,
        )
        if losses is None:
            return None
        sums += torch.stack([losses.aux_loss.detach(), losses.z_loss.detach()]).double()
        return losses.loss / micro

    @torch.no_grad()
    def evaluate(self, batches: Iterator[dict[str, torch.Tensor]]) -> torch.Tensor:
        """[summed loss, items scored, correct predictions] over the data-parallel ranks'
        batches."""
        per_call = self.layout.num_microbatches if self.pm.pipelined else 1
        sums = torch.zeros(2 + self.task.num_stats, dtype=torch.float64, device=self.pm.device)
        pending: list[dict[str, torch.Tensor]] = []
        self.pm.eval()
        for batch in batches:
            pending.append(batch)
            if len(pending) < per_call:
                continue
            batch, pending = self._inputs(pending), []
            if self.pm.pipelined:
                loss, stats = self._pipeline_eval(batch)
            else:
                with self.pm.loss_context():
                    loss, count, correct = self.micro_loss(batch)
                stats = self._stats(count, correct)
            sums += torch.cat([_local(loss).detach().double().reshape(1), stats])
        self.pm.reshard()
        self.pm.train()
        return all_reduce_data_parallel(sums, self.mesh, context=True)

    def _pipeline_eval(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, [items, task statistics]) of a validation batch through the pipeline, on
        every rank."""
        ids, _, kwargs = self.task.inputs(batch)
        pieces: list[torch.Tensor] = []

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss, items, task_stats = self.task.pipeline_loss(logits, target)
            pieces.append(self._stats(items, task_stats))
            return loss

        with self._autocast():
            target = self.task.pipeline_target(self.pm, batch)
            loss = pipeline_eval(self.pm, ids, target, loss_fn, **kwargs)
        return loss, self._pipeline_stats(pieces)

    # -- checkpoints and export -------------------------------------------------------------

    def state_dicts(self) -> tuple[dict, dict]:
        """This rank's model and optimizer state under the model's parameter names (DTensors
        where sharded)."""
        optim: dict = {}
        for part, opt in zip(self.pm.parts, self.optimizer.optimizers, strict=True):
            optim.update(get_optimizer_state_dict(part, opt, options=FLAT))
        return model_state_dict(self.pm), optim

    def load_state_dicts(self, model_sd: dict, optim_sd: dict | None) -> None:
        load_model_state_dict(self.pm, model_sd)
        if optim_sd is not None:
            for part, opt in zip(self.pm.parts, self.optimizer.optimizers, strict=True):
                set_optimizer_state_dict(part, opt, optim_sd, options=FLAT)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's tensors on global rank 0, None elsewhere (every rank must call this).

        Each pipeline stage gathers its sharded tensors (full_tensor, within the stage's ranks);
        then the first rank of every later stage sends rank 0 the tensors no earlier stage holds.
        """
        with redistributing_quietly():
            local = {
                name: (gathered(t) if isinstance(t, DTensor) else t).detach().cpu()
                for name, t in model_state_dict(self.pm).items()
            }
        pp = self.pm.size("pp")
        if pp == 1:
            return local if not dist.is_initialized() or dist.get_rank() == 0 else None
        grid = self.mesh.mesh.reshape(pp, -1)
        leaders = [int(grid[k, 0]) for k in range(pp)]
        listing = [
            (n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for n, t in sorted(local.items())
        ]
        listings: list = [None] * dist.get_world_size()
        dist.all_gather_object(listings, listing)
        rank, seen = dist.get_rank(), {n for n, _, _ in listings[leaders[0]]}
        full = dict(local) if rank == 0 else None
        for leader in leaders[1:]:
            for name, shape, dtype in listings[leader]:
                if name in seen:  # a tied embedding's last-stage copy
                    continue
                seen.add(name)
                if rank == leader:  # through the model's device: NCCL sends device tensors only
                    dist.send(local[name].to(self.pm.device).contiguous(), dst=0)
                elif rank == 0:
                    buffer = torch.empty(shape, dtype=getattr(torch, dtype), device=self.pm.device)
                    dist.recv(buffer, src=leader)
                    full[name] = buffer.cpu()
        return full
