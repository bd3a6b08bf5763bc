"""LoRA in a training run: the `lora:` section applied to the run's model, and its export.

The adapters are wrapped around the built model before it is laid out (lmforge.models.lora), so DDP
and FSDP2 see frozen base weights and trainable adapters, the optimizer holds only the adapters, and
checkpoints (DCP) save and resume both as any run does. Under a layout that shards the model (FSDP2,
tensor or pipeline parallelism) the model is wrapped on the meta device: each rank then reads only
its shards of the base and draws its pieces of the adapters, never holding the whole base (a LoRA
checkpoint as model.init_from is built whole). QLoRA's NF4 weights are read and quantized whole, a
block at a time, before the layout (lmforge.parallel.load.read_nf4_base), and FSDP2 shards them.
With `checkpoint.convert_to_hf=true` the run writes

    RUN_DIR/model/        the merged model, an lmforge folder (with the tokenizer and the chat template)
    RUN_DIR/hf/           the merged model as a Hugging Face folder
    RUN_DIR/hf-adapter/   the adapter alone in PEFT's format (adapter_config.json + adapter_model.safetensors),
                          for PeftModel.from_pretrained(base, folder), vLLM, or `lmforge serve BASE --lora DIR`
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.lora import apply_lora, init_adapters
from lmforge.models.lora_state import merged_state
from lmforge.models.source import is_checkpoint
from lmforge.parallel.mesh import ParallelConfig
from lmforge.train.config import RunConfig

log = logging.getLogger(__name__)

# A frozen weight's backward computes the input's gradient but not its own: 4 of the 6 FLOPs per
# parameter and token.
LORA_FLOPS_FRACTION = 4 / 6


QLORA_PIP = "pip install torchao"


def check_qlora(
    lora,
    device: torch.device,
    layout: ParallelConfig,
    init_from: str | Path | None = None,
    need_torchao: bool = True,
    need_source: bool = True,
) -> None:
    """lora.base_dtype=nf4 (QLoRA) before the run builds anything: a UserError unless torchao is
    importable, the device is a CUDA GPU or the CPU (torchao's NF4 is plain tensor code there:
    slow, but the same numbers), and the layout is one process, DDP replicas (each holding the
    whole NF4 base), or FSDP2 (HSDP too), whose base comes from an lmforge or Hugging Face folder
    (read and quantized before it is sharded: lmforge.parallel.load.read_nf4_base).
    need_torchao=False, need_source=False: lmforge plan, which sizes the base in bf16 where
    torchao is missing and sizes a preset without its folder."""
    if lora is None or lora.base_dtype != "nf4":
        return
    if device.type not in ("cuda", "cpu"):
        raise UserError(
            f"lora.base_dtype=nf4 (QLoRA) runs on a CUDA GPU or the CPU, not {device.type}: "
            "set lora.base_dtype=bf16"
        )
    if need_torchao and importlib.util.find_spec("torchao") is None:
        raise UserError(
            f"lora.base_dtype=nf4 (QLoRA) needs torchao, which is not installed: {QLORA_PIP}"
        )
    if layout.tensor > 1 or layout.pipeline > 1 or layout.expert > 1:
        raise UserError(
            "lora.base_dtype=nf4 (QLoRA) runs on one process, DDP replicas, FSDP2 or HSDP "
            "(trainer.data_parallel, parallel.data_replicate/data_shard), not with tensor, pipeline or "
            "expert parallelism: set those to 1, or lora.base_dtype=bf16"
        )
    if layout.data_shard > 1 and (
        init_from is None and need_source or init_from and is_checkpoint(Path(init_from))
    ):
        raise UserError(
            "lora.base_dtype=nf4 (QLoRA) under FSDP2 reads its base from model.init_from, an lmforge or "
            "Hugging Face folder"
            + (
                f", not the training checkpoint '{init_from}': export it first "
                "(lmforge export-hf CHECKPOINT OUT)"
                if init_from
                else ": set model.init_from"
            )
        )


def apply_run_lora(
    model: nn.Module, cfg: RunConfig, fill: Callable | None = None
) -> Callable | None:
    """Wrap the run's model with cfg.lora's adapters, before it is laid out (any layout: under
    tensor parallelism the adapters are split like their layers, lmforge.parallel.lora; under a
    pipeline each stage holds its blocks' adapters). A classification run's head trains whole
    beside them (PEFT's SEQ_CLS task, lmforge.models.lora.HEADS).

    A model on the meta device (a layout that shards it, init_model's `fill`) gets meta adapters;
    the fill returned gives each rank, once laid out, its shards of the base (`fill`) and then
    its pieces of the adapters, the same values as a whole model wrapped here
    (lmforge.models.lora.init_adapters). Returns None for a whole model."""
    lora, seed = cfg.lora, cfg.trainer.seed
    apply_lora(model, lora, seed=seed)
    if fill is None:
        return None

    def fill_with_adapters(pm):
        stats = fill(pm)
        init_adapters(pm.parts, lora, seed)
        return stats

    return fill_with_adapters


def write_adapter(
    full: dict[str, torch.Tensor],
    cfg: RunConfig,
    mcfg: ModelConfig,
    out: Path,
    side_files_from: Path | None = None,
) -> None:
    """Write the PEFT adapter folder `out` from a LoRA run's gathered state dict, with the
    tokenizer and chat template files of `side_files_from` (the run's model folder) beside it."""
    from lmforge.models.peft import peft_base, write_adapter_folder

    base = cfg.model.init_from
    write_adapter_folder(full, mcfg, cfg.lora, out, peft_base(base), side_files_from)


def merged(
    full: dict[str, torch.Tensor], cfg: RunConfig, mcfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """A LoRA run's gathered state dict with the adapters folded in (the model/ and hf/ exports)."""
    return merged_state(full, mcfg, cfg.lora.scaling)
