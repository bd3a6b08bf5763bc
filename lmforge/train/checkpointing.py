"""The trainer's checkpoints: lmforge.checkpoint's atomic DCP folders, with state dicts any layout
can read.

Model tensors are saved under the model's own parameter names and optimizer state flattened per
parameter name ("optim.state.<name>.exp_avg", "optim.param_groups.<name>.lr"), whichever layout
wrote them: one process, DDP, FSDP2, or tensor x pipeline x data parallel (lmforge.train.step). DCP
then reshards both on load, so a run saved at (tp=2, pp=2) resumes at (dp=2) or on one process.
Checkpoints written before the flat form (one "optim.param_groups" list) still load, in their
layout.

QLoRA's NF4 weights are frozen, read from model.init_from and quantized the same way by every
layout, so a checkpoint leaves them out (`TrainCheckpoints.state_dicts`): DCP would pickle torchao's
tensor class, which a safe load refuses, and a resume under another layout could not fill them piece
by piece. A resume keeps those it read, and export-hf / serve of the checkpoint read them from
model.init_from again (load_checkpoint_whole).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from lmforge.checkpoint import CheckpointManager
from lmforge.dcp_read import read_metadata
from lmforge.models.nf4 import is_nf4
from lmforge.train.step import ParallelTraining


def _nested_optimizer_state(path: Path | None) -> bool:
    """Whether the checkpoint at `path` holds optimizer state in torch's nested form (older
    lmforge)."""
    if path is None:
        return False
    return "optim.param_groups" in read_metadata(path).state_dict_metadata


class TrainCheckpoints(CheckpointManager):
    """Checkpoints of a ParallelTraining: `model` is the ParallelTraining, `optimizer` its
    optimizer (or None: the model alone)."""

    def state_dicts(
        self, model: ParallelTraining, optimizer, path: Path | None = None
    ) -> tuple[dict, dict | None]:
        # one part: the layouts of that time
        if optimizer is not None and _nested_optimizer_state(path):
            return super().state_dicts(model.pm.parts[0], model.optimizer.optimizers[0], path)
        model_sd, optim_sd = model.state_dicts()
        # QLoRA's frozen NF4 weights stay out (DCP would pickle torchao's class): a resume keeps
        # them, export-hf and serve read model.init_from again (see the module docstring).
        model_sd = {k: t for k, t in model_sd.items() if not is_nf4(t)}
        return model_sd, optim_sd if optimizer is not None else None

    def load_state_dicts(
        self,
        model: ParallelTraining,
        optimizer,
        model_sd: dict,
        optim_sd: dict | None,
        path: Path | None = None,
    ) -> None:
        if optim_sd is not None and _nested_optimizer_state(path):
            super().load_state_dicts(
                model.pm.parts[0], model.optimizer.optimizers[0], model_sd, optim_sd, path
            )
        else:
            model.load_state_dicts(model_sd, optim_sd)


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files of a run's tokenizer (name -> bytes: its tokenizer file(s), the HF config files
    and chat template beside them), which each checkpoint holds a copy of: a checkpoint is
    resumed, exported and served with the tokenizer its run read, wherever that came from and
    whether or not it is still there. {} for no tokenizer."""
    if tokenizer is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(Path(tmp))
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
