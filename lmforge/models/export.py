"""`lmforge export-hf`'s reader: an lmforge model folder or a training checkpoint -> a Hugging Face folder.

A checkpoint (RUN_DIR/checkpoints/step-N) is read directly, its files checked against their checksums as every
reader of a checkpoint does (lmforge.models.source). Its export equals the one its run writes at the end from the
same weights (checkpoint.convert_to_hf): the same tensors, bit for bit, in the dtype the run kept them in (bf16
under bf16-sr), and the tokenizer the run's config.yaml names.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch

from lmforge.errors import UserError
from lmforge.models.hf import export_hf, is_hf_dir, write_hf
from lmforge.models.source import checkpoint_dtype, is_checkpoint, load_pretrained, run_tokenizer_source

log = logging.getLogger(__name__)


def export_folder(source: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                  overwrite: bool = False) -> dict:
    """Write `source`, an lmforge model folder or a training checkpoint, as a Hugging Face folder; its config.json."""
    from lmforge.models.io import is_model_dir

    source = Path(source)
    if is_checkpoint(source):
        return _export_checkpoint(source, Path(out_dir), dtype, overwrite)
    if is_model_dir(source):
        return export_hf(source, out_dir, dtype, overwrite)
    if not source.is_dir():
        raise UserError(f"model folder '{source}' does not exist")
    what = "a Hugging Face folder already" if is_hf_dir(source) else "not a model folder"
    raise UserError(f"'{source}' is {what}: export-hf reads an lmforge model folder (lmforge.json) or a training "
                    "checkpoint (RUN_DIR/checkpoints/step-N)")


def _export_checkpoint(folder: Path, out_dir: Path, dtype: torch.dtype | None, overwrite: bool) -> dict:
    from lmforge.chat_template import CHAT_TEMPLATE_FILE
    from lmforge.models.io import copy_side_files
    from lmforge.tokenizers import load_tokenizer

    model = load_pretrained(folder, dtype=checkpoint_dtype(folder))
    state = model.state_dict()
    needed = sum(t.numel() * t.element_size() for t in state.values()) if dtype is None else None
    tokenizer = run_tokenizer_source(folder)
    with tempfile.TemporaryDirectory(prefix="lmforge-export-") as side:
        if tokenizer is not None:  # the files the run's lmforge model folder holds beside its weights
            load_tokenizer(tokenizer).save(Path(side))
        else:
            log.warning("the run of '%s' names no tokenizer (no data.tokenizer or model.init_from in its config.yaml): "
                        "the export has none", folder)
        copy_side_files(folder, Path(side), [CHAT_TEMPLATE_FILE])  # a fine-tuning run's, as its own export has it
        return write_hf(model.config, state.__getitem__, Path(side), out_dir, dtype, overwrite, needed)
