"""The trainer's checkpoints: lmforge.checkpoint's atomic DCP folders, with state dicts any layout can read.

Model tensors are saved under the model's own parameter names and optimizer state flattened per
parameter name ("optim.state.<name>.exp_avg", "optim.param_groups.<name>.lr"), whichever layout
wrote them: one process, DDP, FSDP2, or tensor x pipeline x data parallel (lmforge.train.step). DCP
then reshards both on load, so a run saved at (tp=2, pp=2) resumes at (dp=2) or on one process.
Checkpoints written before the flat form (one "optim.param_groups" list) still load, in their layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lmforge.checkpoint import CheckpointManager
from lmforge.train.step import FLAT, MeshTraining


def _nested_optimizer_state(path: Path | None) -> bool:
    """Whether the checkpoint at `path` holds optimizer state in torch's nested form (older lmforge)."""
    if path is None:
        return False
    from torch.distributed.checkpoint import FileSystemReader

    try:
        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except (OSError, ValueError):
        return False  # dcp.load reports what is wrong with the folder
    return "optim.param_groups" in keys


class TrainCheckpoints(CheckpointManager):
    def __init__(self, *args, mesh: MeshTraining | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.mesh = mesh

    def state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    path: Path | None = None) -> tuple[dict, dict | None]:
        if self.mesh is not None:
            model_sd, optim_sd = self.mesh.state_dicts()
            return model_sd, optim_sd if optimizer is not None else None
        if optimizer is None or _nested_optimizer_state(path):
            return super().state_dicts(model, optimizer, path)
        return get_state_dict(model, optimizer, options=FLAT)

    def load_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict,
                         optim_sd: dict | None, path: Path | None = None) -> None:
        if self.mesh is not None:
            self.mesh.load_state_dicts(model_sd, optim_sd)
        elif optim_sd is None or _nested_optimizer_state(path):
            super().load_state_dicts(model, optimizer, model_sd, optim_sd, path)
        else:
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=FLAT)
