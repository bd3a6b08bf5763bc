"""One entry point: apply pipeline, tensor/sequence and data parallelism to a built model, any
layout.

Order, as in torchtitan: split into pipeline stages first (each rank keeps its stages' modules),
then tensor-parallel plans on each stage, then data parallelism: FSDP2 over the data-shard dim (the
context dim folded in under context parallelism; HSDP when data_replicate > 1), whose all-gathers
then carry tensor-parallel DTensors (2-D sharding); a layout that only replicates whole models (no
tensor, pipeline, shard or context dim) is DDP. One process (no
mesh) gets the model as it is. Expert parallelism lays a MoE model's experts out before all of it,
on the whole model (beside tensor parallelism by expert and on their intermediate rows at once: the
tensor plans then leave them as they are); under FSDP2 they become units of their own, nested in
their blocks' (lmforge.parallel.expert).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.errors import UserError
from lmforge.models.moe import moe_layers
from lmforge.parallel.expert import (
    apply_expert_parallel,
    expert_parameters,
    expert_shard_placement,
    shard_experts,
)
from lmforge.parallel.mesh import (
    REDUCE_DTYPES,
    ParallelConfig,
    check_model,
    expert_mesh,
    fsdp_mesh,
    torch_release,
    torch_version,
)
from lmforge.parallel.pipeline import StageShapes, build_schedule, split_model, stage_ids
from lmforge.parallel.tensor_parallel import apply_tensor_parallel, blocks

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ParallelModel:
    """This rank's share of the model: `parts` is [model] without pipeline parallelism, else this
    rank's stage modules (one per virtual stage), whose parameter names are the model's."""

    parts: list[nn.Module]
    config: ParallelConfig
    mesh: Any = None
    schedule: Any = None
    stage_indices: list[int] = field(default_factory=list)
    num_stages: int = 1
    tied_group: Any = None
    loss_fn: Callable | None = None  # set per step by pipeline_step; the schedule calls it
    eval_schedule: Any = None  # forward-only, built by pipeline_eval on first use
    stage_shapes: StageShapes | None = None  # static stages (lmforge plan): the eval schedule's too
    router: Any = None  # a pipelined MoE model's PipelineRouterLosses (pipeline_step runs it)
    # ("ep_replicate", "ep", "ep_shard") under expert parallelism (lmforge.parallel.expert)
    expert_mesh: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def size(self, dim: str) -> int:
        return self.mesh[dim].size() if self.mesh is not None else 1

    @property
    def pipelined(self) -> bool:
        return self.schedule is not None

    @property
    def has_first_stage(self) -> bool:
        return not self.pipelined or 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        return not self.pipelined or self.num_stages - 1 in self.stage_indices

    @property
    def data_parallel_size(self) -> int:
        return self.size("dp_replicate") * self.size("dp_shard")

    @property
    def context_size(self) -> int:
        """The ranks each sequence is split over (parallel.context)."""
        return self.size("cp")

    def parameters(self) -> Iterator[nn.Parameter]:
        seen: set[int] = set()
        for part in self.parts:
            for p in part.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def train(self, mode: bool = True) -> ParallelModel:
        for part in self.parts:
            part.train(mode)
        return self

    def eval(self) -> ParallelModel:
        return self.train(False)

    def __call__(self, *args, **kwargs):
        """Forward of the whole model (no pipeline parallelism): logits, a vocabulary-sharded
        DTensor under tensor + loss parallelism (compute the loss and backward inside
        loss_context())."""
        if self.pipelined:
            raise RuntimeError(
                "a pipelined model runs through pipeline_step(), not a plain forward"
            )
        return self.parts[0](*args, **kwargs)

    def reshard(self) -> None:
        """Free FSDP's gathered parameters after a forward without backward: the root unit keeps
        its parameters gathered after a forward, and until resharded its named parameters are the
        gathered tensors, not the sharded ones the optimizer and checkpoints hold."""
        from torch.distributed.fsdp import FSDPModule

        for part in self.parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def loss_context(self) -> contextlib.AbstractContextManager:
        """loss_parallel() when the logits are vocabulary-sharded: wrap the loss *and* its
        backward."""
        if self.size("tp") > 1 and self.config.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()


def apply_fsdp(
    part: nn.Module, dp_mesh, reshard_after_forward: bool = True, mp_policy=None
) -> None:
    """FSDP2 per block, then the rest (embeddings, final norm, head) as the root unit; a tied
    embedding stays in the root unit with the head that reuses it. Experts laid out by expert
    parallelism are units of their own on the expert mesh, nested in their blocks'
    (shard_experts), or left to it where it reduces them itself; other stacked experts are split
    evenly over the shards (expert_shard_placement)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    shard_experts(part, reshard_after_forward, mp_policy)
    kwargs = {"mesh": dp_mesh}
    ignored = expert_parameters(part)
    if ignored:
        kwargs["ignored_params"] = ignored
    stacked = {
        id(p)
        for layer in moe_layers(part)
        for p in layer.experts.parameters()
        if not isinstance(p, DTensor)
    }
    # (tensor parallelism's expert slices are DTensors split on their rows: FSDP2's Shard(0)
    # as ever)
    if stacked:
        shards = dp_mesh.size(dp_mesh.ndim - 1)  # HSDP's second dim
        kwargs["shard_placement_fn"] = lambda p: (
            expert_shard_placement(p, shards) if id(p) in stacked else None
        )
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in blocks(part):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root keeps torch's default (its parameters stay gathered from the forward to the backward
    # that needs them at once) unless told not to reshard: an explicit True would gather them again.
    fully_shard(
        part, **kwargs, **({} if reshard_after_forward else {"reshard_after_forward": False})
    )


def fsdp_mixed_precision(
    cfg: ParallelConfig, param_dtype: torch.dtype, autocast_dtype: torch.dtype | None
):
    """FSDP2's MixedPrecisionPolicy for a run's precision, or None (FSDP2 then gathers and
    reduces in the parameters' dtype). Mixed precision (fp32 weights under bf16 autocast): each
    unit all-gathers its parameters as bf16 (half the bytes; autocast would cast them to bf16 for
    the matmuls anyway) and reduce-scatters gradients in parallel.fsdp_reduce_dtype; the sharded
    weights, gradients and optimizer stay fp32. Weights that are bf16 already (bf16, bf16-sr)
    have nothing to cast."""
    if autocast_dtype is None or param_dtype == autocast_dtype:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=autocast_dtype, reduce_dtype=REDUCE_DTYPES[cfg.fsdp_reduce_dtype]
    )


def apply_ddp(model: nn.Module, dp_mesh, device: torch.device) -> nn.Module:
    """DDP over the replicate dim: one whole model per rank, gradients all-reduced in buckets
    during the backward."""
    from torch.nn.parallel import DistributedDataParallel

    from lmforge.models.nf4 import is_nf4

    experts = expert_parameters(model)
    # Experts under expert parallelism reduce their own gradients; QLoRA's NF4 weights are frozen
    # and alike on every rank (DDP's first broadcast of them would meet torchao's tensor class).
    ignored = [n for n, p in model.named_parameters() if p in experts or is_nf4(p)]
    if not any(p.requires_grad for p in model.parameters() if p not in experts):
        # Nothing left for DDP to reduce (LoRA on the experts alone, under expert parallelism):
        # torch refuses to wrap it, and the ranks hold the same frozen weights (built alike).
        return model
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return DistributedDataParallel(
        model,
        process_group=dp_mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
    )


def work_around_inductor(model: nn.Module, device: torch.device, mp_policy=None) -> bool:
    """Before compiling the blocks of `model` on `device`: switch Inductor's C++ horizontal
    fusion off where it breaks the build. Whether it did.

    torch 2.13's C++ code generator declares a variable twice (g++: "conflicting declaration
    'auto at_BFloat16_tmp_acc0_vec'") when one kernel stores the same bf16 reduction to two
    outputs: the gradients of GPT-NeoX's attention and MLP output biases, both the column sums of
    the one gradient of its parallel residual. With one node per horizontal fusion the two sums
    go to kernels of their own. Only where the compiled blocks compute in bf16 on the CPU: bf16
    weights (bf16, bf16-sr) or FSDP2 gathering them as bf16 (bf16-mixed); fp32 reductions store
    no converted copy, and a GPU compiles through Triton. Set in Inductor's config for the
    process, because its backward graphs compile lazily at the first backward: a patch around the
    forward would miss them (torch.compile's `options` would scope it to the blocks, but the
    trainer makes that call). Measured side by side on a 2-layer NeoX (d=256, 8 x 128 tokens, one
    CPU thread), a step's median: fp32 114 ms without, 112 ms with it; bf16-mixed 82 / 83 ms;
    bf16 compiled with it 83 ms, eager 77 ms."""
    bf16 = any(p.dtype == torch.bfloat16 for p in model.parameters()) or (
        mp_policy is not None and mp_policy.param_dtype == torch.bfloat16
    )
    if device.type != "cpu" or not bf16:
        return False
    from torch._inductor import config

    # every torch the project supports has it
    if not hasattr(config.cpp, "max_horizontal_fusion_size"):
        return False
    if config.cpp.max_horizontal_fusion_size != 1:
        config.cpp.max_horizontal_fusion_size = 1
        log.info(
            "trainer.compile in bf16 on the CPU: Inductor's horizontal fusion is off "
            "(torch._inductor.config.cpp.max_horizontal_fusion_size=1), which works around a torch C++ "
            "code generation bug with bf16 bias gradients"
        )
    return True


def _tied_group(mesh):
    """The process group of the first and last pipeline rank that share this rank's (dp, tp)
    coordinate."""
    if mesh["pp"].size() == 2:
        return mesh["pp"].get_group()
    found = _pipeline_column_group(mesh, ends_only=True)
    return found[0] if found is not None else None  # a middle stage holds no tied weight


def _pipeline_column_group(mesh, ends_only: bool = False) -> tuple[Any, list[int]] | None:
    """A new process group of the pipeline ranks that share this rank's (dp, tp) coordinate (only
    the first and the last with ends_only), and its ranks; None for a rank outside it (a middle
    stage with ends_only)."""
    grid = mesh.mesh.reshape(mesh["pp"].size(), -1)
    mine = None
    for column in range(grid.shape[1]):  # every rank creates every group, in the same order
        ranks = [int(r) for r in (grid[[0, -1], column] if ends_only else grid[:, column])]
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group, ranks
    return mine


def parallelize(
    model: nn.Module,
    cfg: ParallelConfig,
    mesh,
    mp_policy=None,
    device: torch.device | None = None,
    stage_shapes: StageShapes | None = None,
    compile_block: Callable[[nn.Module], object] | None = None,
) -> ParallelModel:
    """Apply `cfg` over `mesh` (lmforge.parallel.build_mesh; None for one process) to `model`, a
    Decoder or Bert built identically on every rank. Afterwards use only the returned
    ParallelModel's parts: without pipeline parallelism parts == [model] (DDP-wrapped under
    replication alone); with it, drop `model` so unused layers can be freed. `device`: where the
    model computes (default: the mesh's). `stage_shapes`: what pipeline stages exchange, if known
    (static stages, see build_schedule). `compile_block`: applied to every block this rank holds
    (e.g. torch.compile), as torchtitan orders it: after the pipeline split and the tensor plans,
    whose DTensors the graphs are traced with, before data parallelism, whose hooks stay outside
    them.
    """
    if device is None:
        device = (
            torch.device(mesh.device_type, torch.accelerator.current_device_index())
            if (mesh is not None and mesh.device_type != "cpu")
            else torch.device("cpu")
        )

    def compile_blocks(part: nn.Module, fsdp: bool = False) -> None:
        if compile_block is None:
            return
        work_around_inductor(part, device, mp_policy if fsdp else None)
        for block in part.layers:
            compile_block(block)

    if mesh is None:
        compile_blocks(model)
        return ParallelModel([model], cfg, device=device)
    pp, tp = mesh["pp"].size(), mesh["tp"].size()
    cfg = cfg.resolved(mesh.size())
    check_model(cfg, model.config)
    pm = ParallelModel([model], cfg, mesh, device=device)
    cp = mesh["cp"].size()
    ddp = pp == 1 and tp == 1 and cfg.data_shard == 1 and cp == 1 and cfg.data_replicate > 1
    if cfg.expert > 1:
        pm.expert_mesh = expert_mesh(mesh, cfg)
        apply_expert_parallel(model, pm.expert_mesh, pm.data_parallel_size, fsdp=not ddp)
    if ddp:
        compile_blocks(model)
        # a frozen model (DPO's reference): a replica as is
        if any(p.requires_grad for p in model.parameters()):
            pm.parts = [apply_ddp(model, mesh["dp_replicate"], device)]
        log.info("parallelized: DDP over %d replicas", cfg.data_replicate)
        return pm
    if pp > 1:
        if mesh.device_type == "cpu" and torch_version() < (2, 8) and dist.get_backend() != "fake":
            raise UserError(
                f"pipeline parallelism on the CPU needs torch 2.8 or later (over gloo the 1F1B schedule's "
                f"first step never ends on 2.6 and 2.7; 2.8, 2.11 and 2.13 run it); this is torch "
                f"{torch_release()}: upgrade torch, or set parallel.pipeline=1"
            )
        pm.stage_indices = stage_ids(mesh["pp"].get_local_rank(), pp, cfg.virtual_stages)
        pm.num_stages = pp * cfg.virtual_stages
        pm.parts = split_model(model, mesh["pp"].get_local_rank(), pp, cfg.virtual_stages)
    # The context ranks hold the same parameters and compute gradients from their own chunks: FSDP2
    # shards over them too, and reduces over data x context.
    sharded = pm.data_parallel_size * cp > 1
    for part in pm.parts:
        if tp > 1:
            apply_tensor_parallel(part, mesh["tp"], cfg.sequence_parallel, cfg.loss_parallel)
        compile_blocks(part, fsdp=sharded)
        if sharded:
            if mesh.device_type == "cpu" and torch_version() < (2, 7):
                raise UserError(
                    f"FSDP2 on the CPU needs a newer torch than {torch_release()} (its "
                    "FSDP2 records events on CPU streams, which have none; 2.11 and 2.13 run it): "
                    "upgrade torch, or set trainer.data_parallel=ddp"
                )
            dp_mesh = fsdp_mesh(mesh, cfg.data_replicate > 1)
            # Under a pipeline each microbatch would all-gather again: keep parameters gathered
            # through the step instead (the pipeline schedule reshards after the last backward).
            apply_fsdp(part, dp_mesh, reshard_after_forward=pp == 1, mp_policy=mp_policy)
    if pp > 1:
        # a classifier's head is its own
        if model.config.tie_embeddings and not model.config.num_labels:
            pm.tied_group = _tied_group(mesh)

        def loss_fn(output, target):
            return pm.loss_fn(output, target)

        if model.config.num_experts:
            from lmforge.parallel.router import PipelineRouterLosses

            group, ranks = _pipeline_column_group(mesh)
            peers = [r for r in ranks if r != dist.get_rank()]
            pm.router = PipelineRouterLosses(pm.parts, model.config, group, peers, device)
        pm.stage_shapes = stage_shapes
        _, pm.schedule = build_schedule(
            pm.parts,
            pm.stage_indices,
            pm.num_stages,
            cfg.pipeline_schedule,
            cfg.num_microbatches,
            loss_fn,
            mesh["pp"].get_group(),
            device,
            stage_shapes,
        )
    log.info(
        "parallelized: pp=%d (stages %s of %d) dp=%dx%d cp=%d tp=%d sp=%s",
        pp,
        pm.stage_indices or [0],
        pm.num_stages,
        pm.size("dp_replicate"),
        pm.size("dp_shard"),
        cp,
        tp,
        cfg.sequence_parallel and tp > 1,
    )
    return pm
