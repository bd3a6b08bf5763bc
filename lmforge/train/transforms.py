"""A run's built model made into the one it trains, in one order (as torchtitan's `parallelize`
reads):

    1. LoRA adapters around the frozen base      (meta adapters where the layout shards the model)
    2. QLoRA's NF4 base, read and quantized whole (before FSDP2, which shards the NF4 weights)
    3. Float8 linears in the blocks               (before checkpointing, compile and FSDP wrap them)
    4. activation checkpointing of each block
    5. context parallelism: the decoder's attention across the ranks of its context group
       (lmforge.train.context; a hook the decoder calls, not a rewrite of its layers)
    6. compile of each block this rank holds      (inside parallelize: after the pipeline split and
                                                   the tensor plans, before FSDP2, whose hooks stay
                                                   outside)
    7. the parallel plans: pipeline, tensor, expert, FSDP2/HSDP or DDP
       (lmforge.parallel.compose.parallelize)
    8. the fill: each rank's own shards of a meta-device model, read or initialised once laid out

Steps 7 and 8 run in lmforge.train.step.ParallelTraining, which then builds the optimizer;
check_layout refuses what they cannot run before anything is built (the runs context parallelism
does not serve among them). The task sees the adapted model between steps 2 and 3 (Task.prepare:
DPO's frozen reference is built then).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from lmforge.models.source import is_checkpoint
from lmforge.parallel.compose import ParallelModel
from lmforge.parallel.load import read_nf4_base
from lmforge.parallel.mesh import ParallelConfig
from lmforge.train.config import Precision, RunConfig
from lmforge.train.config_checks import check_torch_for_layout
from lmforge.train.context import apply_context, check_context_run
from lmforge.train.float8 import check_float8, convert_to_float8
from lmforge.train.lora import apply_run_lora, check_qlora
from lmforge.train.setup import apply_activation_checkpointing, check_fit, use_compile_cache
from lmforge.train.step import ParallelTraining, check_pipeline_batch
from lmforge.train.tasks import Task, get_task

log = logging.getLogger(__name__)

Fill = Callable[[ParallelModel], object] | None


def check_layout(cfg: RunConfig, layout, device: torch.device) -> None:
    """The refusals before any compute: FP8 or QLoRA where the device or the layout cannot run
    them, a torch too old for the layout, a run context parallelism does not serve, a batch that
    does not divide over its ranks or pipeline microbatches."""
    t = cfg.trainer
    if t.float8:
        check_float8(device, layout.tensor, cfg.lora is not None)
    check_qlora(cfg.lora, device, layout, cfg.model.init_from)
    check_torch_for_layout(cfg, layout.tensor)
    check_context_run(cfg, layout, get_task(cfg.data.task))
    # Batch and sequence length before the data: building it writes sample indices beside the data.
    check_pipeline_batch(
        layout,
        check_fit(cfg, cfg.model.resolve(), layout.data_parallel),
        t.micro_batch_size,
        t.global_batch_size,
        layout.data_parallel,
    )


def nf4_source(cfg: RunConfig) -> str | None:
    """The folder QLoRA's NF4 base is read from before the layout: model.init_from where it is an
    lmforge or Hugging Face folder. None otherwise: without QLoRA, or from a checkpoint or fresh,
    where the base is built whole."""
    if cfg.lora is None or cfg.lora.base_dtype != "nf4" or not cfg.model.init_from:
        return None
    return None if is_checkpoint(Path(cfg.model.init_from)) else cfg.model.init_from


def placement(
    cfg: RunConfig, layout: ParallelConfig, precision: Precision
) -> tuple[bool, torch.dtype]:
    """Where init_model builds the model for these steps: (on the meta device, in which dtype). A
    layout that shards the model gets it on the meta device: each rank fills only its own shards
    (a LoRA run's adapters too). So does QLoRA's from a folder, whose linear weights step 2 reads
    and quantizes whole; from a checkpoint or fresh it is built whole. A LoRA run's frozen base
    in bf16 (lora.base_dtype bf16, nf4) is read in bf16: an fp32 copy first would double what the
    process holds while it starts (a one-process run's peak memory)."""
    nf4 = cfg.lora is not None and cfg.lora.base_dtype == "nf4"
    meta = (layout.shards_model and not nf4) or nf4_source(cfg) is not None
    dtype = torch.bfloat16 if cfg.lora is not None and cfg.lora.bf16_base else precision.param_dtype
    return meta, dtype


def lay_out_model(
    model: torch.nn.Module,
    fill: Fill,
    cfg: RunConfig,
    layout: ParallelConfig,
    mesh,
    task: Task,
    precision: Precision,
    device: torch.device,
    run_dir: Path,
    is_main: bool = True,
) -> ParallelTraining:
    """The run's `model` (as lmforge.train.setup.init_model built it, `fill` its fill or None)
    through the steps of the module docstring, laid out over `mesh` (None for one process)."""
    t = cfg.trainer
    fill = add_lora(model, cfg, fill)
    fill = read_qlora_base(model, cfg, layout, device, fill)
    task.prepare(model, cfg, layout, device)
    if t.float8:
        convert_to_float8(model, t.float8_recipe)
    apply_activation_checkpointing(model, t.activation_checkpointing)
    context = apply_context(model, layout, mesh)
    compile_block = block_compiler(cfg, run_dir, is_main)
    return ParallelTraining(
        model,
        layout,
        mesh,
        task,
        cfg.optim,
        precision,
        t.seed,
        cfg.data.seq_length,
        device,
        fill=fill,
        compile_block=compile_block,
        context=context,
    )


def add_lora(model: torch.nn.Module, cfg: RunConfig, fill: Fill) -> Fill:
    """Step 1: the run's adapters (lmforge.train.lora.apply_run_lora); a meta model's fill then
    draws them too."""
    return apply_run_lora(model, cfg, fill) if cfg.lora is not None else fill


def read_qlora_base(
    model: torch.nn.Module, cfg: RunConfig, layout: ParallelConfig, device: torch.device, fill: Fill
) -> Fill:
    """Step 2: QLoRA's linear weights read from their folder and quantized whole, a block at a
    time, into the meta model (FSDP2 then shards them). One process or DDP replicas get the rest
    filled now too: DDP wraps a whole model. The fill still to run once laid out, or None."""
    source = nf4_source(cfg)
    if source is None or fill is None:
        return fill
    read_nf4_base(model, source, device, shards=max(layout.data_shard, 1))
    if layout.shards_model:
        return fill
    fill(ParallelModel([model], layout, device=device))
    return None


def block_compiler(
    cfg: RunConfig, run_dir: Path, is_main: bool = True
) -> Callable[[torch.nn.Module], None] | None:
    """Step 6 as parallelize applies it to each block (trainer.compile), Inductor's cache pointed
    at the run's compile cache on every rank; None without trainer.compile."""
    t = cfg.trainer
    if not t.compile:
        return None
    cache = Path(t.compile_cache_dir or run_dir / "compile_cache")
    filled = use_compile_cache(cache)
    if filled and is_main:
        log.info(
            "trainer.compile: reusing the compiled code in %s (an earlier run's or lmforge compile's): "
            "the first step loads what it holds and compiles the rest",
            cache,
        )
    elif is_main:  # else the first step's minutes look like a hang
        log.info(
            "trainer.compile: the blocks compile during the first step (again for a new input shape); "
            "compiled code is cached in %s for later runs",
            cache,
        )

    def compile_block(block: torch.nn.Module) -> None:
        block.compile(backend=t.compile_backend)

    return compile_block
