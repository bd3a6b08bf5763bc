"""What `lmforge plan` sizes beyond the model's shape: the run's model wrapped as the trainer
wraps it (LoRA's adapters on a frozen base, QLoRA's NF4 base) and what the plan says it sized
(parameters, trainable ones, DPO's reference), in numbers for --json and in words."""

from __future__ import annotations

import dataclasses

import torch

from lmforge.train.config import Precision, RunConfig
from lmforge.train.plan_tasks import task_plan

GiB = 1 << 30


def wrap_as_trained(model: torch.nn.Module, cfg: RunConfig, fill, sharded: bool):
    """The meta `model` wrapped with the run's adapters (lmforge.train.lora.apply_run_lora), and
    what fills it once laid out. A layout that shards the model fills it as the trainer does (its
    shards, then init_adapters); where the trainer wraps a whole model on the device (one
    process, DDP) the same tensors come from filling the meta wrapping (tensors moved onto a fake
    device would be swapped, which fake parameters refuse). QLoRA's NF4 weights are quantized
    before the layout (quantize_as_read) and kept by the fill."""
    from lmforge.train.lora import apply_run_lora

    if cfg.lora.base_dtype == "nf4":
        from lmforge.models.nf4 import nf4_api

        # torchao imported before the trace (the stand-in device's patches would meet its
        # import)
        nf4_api()
    return apply_run_lora(model, cfg, fill if sharded else None) or fill


def quantize_as_read(model: torch.nn.Module, device: torch.device) -> None:
    """QLoRA's base as lmforge.parallel.load.read_nf4_base leaves it, traced: each weight NF4
    quantizes made an NF4 tensor on `device` (fake, inside the trace) before the layout, the rest
    still on the meta device."""
    from lmforge.models.nf4 import nf4_weights, to_nf4_parameter

    for module, attr in nf4_weights(model)[0].values():
        setattr(
            module,
            attr,
            to_nf4_parameter(
                torch.empty(getattr(module, attr).shape, dtype=torch.bfloat16, device=device)
            ),
        )


def nf4_as_traced(cfg: RunConfig, layout) -> tuple[RunConfig, str | None]:
    """The run as traced, and a line where that differs from it: QLoRA's NF4 base needs torchao,
    and without it the base is traced in bf16 (what NF4 leaves in bf16 stays so; the quantized
    weights are overcounted ~3.8x); under FSDP2 the run reads its base from model.init_from,
    which a plan of a preset has not."""
    import importlib.util

    if cfg.lora is None or cfg.lora.base_dtype != "nf4":
        return cfg, None
    if importlib.util.find_spec("torchao") is not None:
        return cfg, None if layout.data_shard <= 1 or cfg.model.init_from else (
            "lora.base_dtype=nf4 under FSDP2: the run reads and quantizes its base from model.init_from (an lmforge or "
            "Hugging Face folder), which this config does not set yet"
        )
    note = (
        "lora.base_dtype=nf4: torchao is not importable here, so the frozen base is sized in bf16, an upper bound "
        "(NF4 holds the blocks' linear and expert weights in ~0.53 bytes each): pip install torchao to size NF4"
    )
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, base_dtype="bf16")), note


def sized(cfg: RunConfig, mcfg, task) -> dict:
    """What the run trains, counted on the whole model on the meta device wrapped as the trainer
    wraps it: parameters, trainable ones, the LoRA adapters and their dtypes, DPO's reference, a
    micro-batch's sequences."""
    from lmforge.models import build
    from lmforge.models.lora import TARGETS, target_modules
    from lmforge.train.lora import apply_run_lora

    model = build(mcfg, device="meta")
    lora = None
    if cfg.lora is not None:
        # Counts only: apply_lora quantizes nothing on the meta device (NF4 keeps each weight's
        # shape).
        counted = (
            cfg
            if cfg.lora.base_dtype != "nf4"
            else dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, base_dtype="bf16"))
        )
        order = ["qkv", *TARGETS]  # a fused qkv's one adapter is "qkv"
        linears, experts = target_modules(model, counted.lora)
        adapted = sorted({part for parts in linears.values() for part in parts}, key=order.index)
        # a MoE's stacked experts
        adapted += [f"experts.{w}" for w in next(iter(experts.values()), {})]
        apply_run_lora(model, counted)
        base = (
            cfg.lora.base_dtype
            if cfg.lora.base_dtype != "fp32"
            else _dtype_name(cfg.precision.param_dtype)
        )
        lora = {
            "rank": cfg.lora.rank,
            "alpha": cfg.lora.alpha,
            "targets": ",".join(cfg.lora.targets),
            "adapted": adapted,
            "base_dtype": base,
            "adapter_dtype": "fp32",
        }
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "lora": lora,
        "reference": task_plan(task).reference(cfg),
        "sequences_per_micro_batch": cfg.trainer.micro_batch_size
        * task_plan(task).rows_per_example,
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype)
    )


def _count(n: int) -> str:
    """42.0M, 70.6B: a parameter count as people say it."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def notes(
    s: dict,
    task,
    reference_bytes: int,
    nf4_note: str | None,
    precision: Precision,
    precision_name: str | None = None,
) -> list[str]:
    """What a plan sized (`s`: sized's; `reference_bytes`: the most a rank holds of the task's
    reference model; `precision`: the run's, `precision_name` what to call it where the recipe
    said auto), a line each (the CLI prints them; --json carries them)."""
    total, trainable = s["parameters"], s["trainable_parameters"]
    if s["lora"] is None:
        lines = [f"full training: {_count(total)} parameters, each with a gradient and AdamW state"]
    else:
        lora = s["lora"]
        lines = [
            f"LoRA rank {lora['rank']} on {lora['targets']} ({','.join(lora['adapted'])}): {_count(trainable)} "
            f"trainable of {_count(total)} parameters; the frozen base in {lora['base_dtype']} has no gradients "
            "or optimizer state, the adapters train in fp32"
        ]
    lines.append(precision_line(precision, s["lora"] is not None, precision_name))
    if nf4_note:
        lines.append(nf4_note)
    task_line = task_plan(task).line(
        s["reference"], size_text(reference_bytes), s["sequences_per_micro_batch"]
    )
    return lines + ([task_line] if task_line else [])


def precision_line(precision: Precision, lora: bool, name: str | None = None) -> str:
    """trainer.precision as the plan sized it: the dtype of what trains (weights, gradients,
    AdamW's two moments) and what that costs a trained parameter. A LoRA run's adapters train in
    fp32 whatever the precision."""
    dtype = torch.float32 if lora else precision.param_dtype
    how = (
        "; matmuls in bf16 (autocast)"
        if precision.autocast_dtype is not None
        else ""
        if lora or dtype == torch.float32
        else "; updates stochastically rounded"
        if precision.stochastic_rounding
        else "; updates rounded to nearest"
    )
    trained = "the adapters' weights" if lora else "weights"
    return (
        f"trainer.precision={name or precision.name}: {trained}, gradients and both AdamW moments in "
        f"{_dtype_name(dtype)}, {4 * dtype.itemsize} bytes a trained parameter{how}"
    )


def size_text(n: int) -> str:
    """Bytes in GiB, or MiB/KiB where a GiB figure would read 0.00."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size / 10:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
