"""A run's own export at its end (checkpoint.convert_to_hf): RUN_DIR/model, an lmforge model
folder with the run's tokenizer and chat template, and RUN_DIR/hf, the Hugging Face folder made
from it (a LoRA run's merged weights, and its adapter in PEFT's format beside it,
RUN_DIR/hf-adapter). `lmforge export-hf` of the run's checkpoint at the same step writes the same
files (lmforge.models.export)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from lmforge.chat_template import CHAT_TEMPLATE_FILE
from lmforge.fsutil import atomic_write
from lmforge.models.config import ModelConfig
from lmforge.models.source import model_origin
from lmforge.train.config import RunConfig
from lmforge.train.lora import merged, write_adapter

log = logging.getLogger("lmforge.train.trainer")  # the run's lines, under the trainer's name


def export_run(
    training,
    cfg: RunConfig,
    mcfg: ModelConfig,
    tokenizer,
    chat_template: str | None,
    model_dir: Path,
    out: Path,
    step: int,
    is_main: bool,
) -> None:
    """Trainer.export_hf: every rank takes part (`training`'s sharded tensors are gathered); rank
    0 writes."""
    import torch.distributed as dist

    full = training.full_state_dict()
    if is_main:
        write_run_export(full, cfg, mcfg, tokenizer, chat_template, model_dir, out, step)
    if dist.is_initialized():
        dist.barrier()


def write_run_export(
    full: dict[str, torch.Tensor],
    cfg: RunConfig,
    mcfg: ModelConfig,
    tokenizer,
    chat_template: str | None,
    model_dir: Path,
    out: Path,
    step: int,
) -> None:
    """Rank 0's part of Trainer.export_hf: `full`, the run's whole state dict at `step`."""
    from lmforge.models.hf import export_hf
    from lmforge.models.io import copy_origin_files, materialize, save_model

    adapters, full = (full, merged(full, cfg, mcfg)) if cfg.lora is not None else (None, full)
    model = materialize(mcfg, full.items(), dtype=next(iter(full.values())).dtype)
    source = tokenizer.files[0] if tokenizer is not None else None
    save_model(model, model_dir, tokenizer_from=source, overwrite=True)
    # its license, generation settings
    copy_origin_files(model_origin(cfg.model.init_from), model_dir)
    if chat_template is not None:  # served as trained (chat_template.jinja wins over the config's)
        atomic_write(model_dir / CHAT_TEMPLATE_FILE, chat_template)
    export_hf(model_dir, out, overwrite=True)
    log.info("wrote Hugging Face folder %s (the weights of step %d)", out, step)
    if source is None:  # transformers' AutoTokenizer then loads an empty tokenizer without a word
        log.warning(
            "the run names no tokenizer (data.tokenizer, or one beside model.init_from): %s has none; "
            "copy the tokenizer the data was made with into it",
            out,
        )
    if adapters is not None:
        write_adapter(adapters, cfg, mcfg, out.with_name(out.name + "-adapter"), model_dir)
