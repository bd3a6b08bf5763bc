"""`lmforge export-hf`'s reader: an lmforge model folder or a training checkpoint -> a Hugging Face
folder.

A checkpoint (RUN_DIR/checkpoints/step-N) is read directly, its files checked against their
checksums as every reader of a checkpoint does (lmforge.models.source). Its export equals the one
its run writes at the end from the same weights (checkpoint.convert_to_hf): the same tensors, bit
for bit, in the dtype the run kept them in (bf16 under bf16-sr), the tokenizer the run's config.yaml
names and the chat template the checkpoint keeps. A LoRA run's checkpoint (adapters beside the
frozen base) exports as the run does: OUT_DIR holds the merged model and OUT_DIR-adapter (the name
with "-adapter" added, as RUN_DIR/hf and RUN_DIR/hf-adapter) the adapter in PEFT's format.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import torch

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.hf import export_hf, is_hf_dir, write_hf
from lmforge.models.io import missing_model_folder
from lmforge.models.lora_state import merged_state
from lmforge.models.peft import peft_base, write_adapter_folder
from lmforge.models.source import (
    checkpoint_dtype,
    checkpoint_lora,
    checkpoint_run,
    is_checkpoint,
    load_checkpoint_whole,
    load_pretrained,
    model_origin,
    run_path,
    run_tokenizer_source,
)

log = logging.getLogger(__name__)


def export_folder(
    source: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    tokenizer: str | Path | None = None,
) -> dict:
    """Write `source`, an lmforge model folder or a training checkpoint, as a Hugging Face
    folder; its config.json. `tokenizer`: for a checkpoint, the tokenizer to export with it
    instead of its run's."""
    from lmforge.models.io import is_model_dir

    source, out = Path(source), Path(out_dir)
    # before reading any weights
    if out.exists() and not overwrite and (out.is_file() or any(out.iterdir())):
        raise UserError(
            f"output '{out}' already exists and is not empty: choose another path or pass --overwrite"
        )
    if tokenizer is not None and not Path(tokenizer).exists():
        raise UserError(
            f"--tokenizer {tokenizer} does not exist: give a tokenizer file or a folder holding one"
        )
    if is_checkpoint(source):
        return _export_checkpoint(source, out, dtype, overwrite, tokenizer)
    if tokenizer is not None and is_model_dir(source):
        raise UserError(
            f"--tokenizer is for a training checkpoint: the lmforge model folder '{source}' exports the "
            "tokenizer files it holds (copy others into it to export those)"
        )
    if is_model_dir(source):
        return export_hf(source, out_dir, dtype, overwrite)
    if not source.is_dir():
        raise missing_model_folder(source)
    from lmforge.models.source import model_inside

    what = "a Hugging Face folder already" if is_hf_dir(source) else "not a model folder"
    inside = None if is_hf_dir(source) else model_inside(source, hf=False)
    raise UserError(
        f"'{source}' is {what}: export-hf reads an lmforge model folder (lmforge.json) or a training "
        "checkpoint (RUN_DIR/checkpoints/step-N)" + (f": give '{inside}'" if inside else "")
    )


def _export_checkpoint(
    folder: Path,
    out_dir: Path,
    dtype: torch.dtype | None,
    overwrite: bool,
    tokenizer: str | Path | None = None,
) -> dict:
    from lmforge.chat_template import CHAT_TEMPLATE_FILE
    from lmforge.models.io import copy_origin_files, copy_side_files
    from lmforge.tokenizers import load_tokenizer

    lora = checkpoint_lora(folder)
    if lora is None:
        model = load_pretrained(folder, dtype=checkpoint_dtype(folder))
        state, cfg = model.state_dict(), model.config
    else:
        adapter_dir = out_dir.with_name(out_dir.name + "-adapter")
        for out in (out_dir, adapter_dir):  # both or neither: say so before writing either
            if out.exists() and not overwrite and (out.is_file() or any(out.iterdir())):
                raise UserError(
                    f"output '{out}' already exists and is not empty: choose another path or pass "
                    "--overwrite"
                )
        whole, cfg = lora_state(folder)
        state = merged_state(whole, cfg, lora.scaling)
        # the merged model in its embedding's dtype, as the run exports it
        held = next(iter(state.values())).dtype
        state = {name: t.to(held) for name, t in state.items()}
    needed = sum(t.numel() * t.element_size() for t in state.values()) if dtype is None else None
    tokenizer = tokenizer or run_tokenizer_source(folder)
    # an older checkpoint (no copy), its source gone
    if tokenizer is not None and not Path(tokenizer).exists():
        raise UserError(
            f"the tokenizer the run of '{folder}' read, {tokenizer}, no longer exists and the checkpoint "
            "holds no copy of it (written by an older lmforge): pass --tokenizer PATH"
        )
    with tempfile.TemporaryDirectory(prefix="lmforge-export-") as side:
        # the files the run's lmforge model folder holds beside its weights
        if tokenizer is not None:
            load_tokenizer(tokenizer).save(Path(side))
        else:
            log.warning(
                "the run of '%s' names no tokenizer (no data.tokenizer or model.init_from in its config.yaml): "
                "the export has none",
                folder,
            )
        # a fine-tuning run's, as its own export has it
        copy_side_files(folder, Path(side), [CHAT_TEMPLATE_FILE])
        base = (checkpoint_run(folder) or {}).get("model", {}).get("init_from")
        base = run_path(folder, base) if base else None
        # the source model's license, generation settings
        copy_origin_files(model_origin(base), Path(side))
        if lora is None:
            return write_hf(cfg, state.__getitem__, Path(side), out_dir, dtype, overwrite, needed)
        existed = adapter_dir.exists()
        write_adapter_folder(whole, cfg, lora, adapter_dir, peft_base(base), Path(side))
        try:
            return write_hf(cfg, state.__getitem__, Path(side), out_dir, dtype, overwrite, needed)
        except BaseException:
            # nothing half-written: the adapter goes with the merged folder that
            # failed
            if not existed:
                shutil.rmtree(adapter_dir, ignore_errors=True)
            raise


def lora_state(folder: Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """A LoRA run's checkpoint as the run held it (what its export gathers): the base and the
    adapters, each tensor in the dtype the checkpoint keeps it in."""
    from lmforge.dcp_read import read_metadata

    model = load_checkpoint_whole(folder)
    meta = read_metadata(folder).state_dict_metadata
    kept = {
        k.removeprefix("model."): m.properties.dtype
        for k, m in meta.items()
        if k.startswith("model.") and hasattr(m, "properties")
    }
    state = {
        name: t.to(kept[name]) if type(t) is torch.Tensor and name in kept else t
        for name, t in model.state_dict().items()
    }
    return state, model.config
