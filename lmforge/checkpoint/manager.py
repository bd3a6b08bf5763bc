"""Save and resume training with torch.distributed.checkpoint (DCP).

    RUN_DIR/checkpoints/step-00000100/   DCP shards of model + optimizer (any data/FSDP layout)
                        .../trainer.json step, consumed samples, monitored metric, skip counters
                        .../rng-rank0.json python/numpy/torch RNG states of each rank
                        .../lmforge.json the model config (so the folder says what it holds)

Each checkpoint is written under `.step-N.tmp` and renamed when complete: a crash at any moment
leaves either the previous set of checkpoints or the new one, never a torn folder. Retention keeps
the `save_top_k` best by the monitored metric plus the newest (`save_last`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.io import write_config
from lmforge.models.source import dcp_error_line, load_checkpoint_model

log = logging.getLogger(__name__)

NAME = re.compile(r"^step-(\d{8})$")
# One process without a process group is a normal way to run: DCP need not warn about it.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():  # dropout on the GPU draws from this rank's device generator
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


class CheckpointManager:
    def __init__(self, root: Path, save_top_k: int = 1, monitor: str = "val_loss", mode: str = "min",
                 save_last: bool = True):
        self.root = Path(root)
        self.save_top_k, self.monitor, self.mode, self.save_last = save_top_k, monitor, mode, save_last

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := NAME.match(p.name))]
        return sorted(found)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1][1] if found else None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict,
             model_config: ModelConfig) -> Path:
        final = self.root / f"step-{step:08d}"
        tmp = self.root / f".step-{step:08d}.tmp"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = self.state_dicts(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        (tmp / f"rng-rank{_rank()}.json").write_text(json.dumps(rng_state()))
        _barrier()
        if _rank() == 0:
            (tmp / "trainer.json").write_text(json.dumps(trainer_state, indent=2) + "\n")
            write_config(tmp, model_config)
            if final.exists():  # a rerun reached the same step again
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._apply_retention()
        _barrier()
        log.info("saved checkpoint %s", final)
        return final

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
        """Restore model (+ optimizer, RNG) in place; return the trainer state."""
        model_sd, optim_sd = self.state_dicts(model, optimizer, path)
        state = {"model": model_sd} if optim_sd is None else {"model": model_sd, "optim": optim_sd}
        try:
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        # Across processes DCP gathers every rank's failure into a CheckpointException, a BaseException
        # (not an Exception); in one process the planner's own ValueError/RuntimeError comes through.
        except (Exception, CheckpointException) as e:
            raise UserError(f"checkpoint '{path}' does not fit this model/optimizer ({dcp_error_line(e)}): resume "
                            "with the config it was written with") from None
        self.load_state_dicts(model, optimizer, state["model"], state.get("optim"), path)
        rng = path / f"rng-rank{_rank()}.json"
        if rng.exists():
            set_rng_state(json.loads(rng.read_text()))
        return json.loads((path / "trainer.json").read_text())

    def state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                    path: Path | None = None) -> tuple[dict, dict | None]:
        """(model, optimizer) state dicts to save, or to load a checkpoint (`path`) into in place. A subclass
        changes how they are laid out (the trainer's, for tensor- and pipeline-parallel models)."""
        if optimizer is None:
            return get_state_dict(model, [])[0], None
        return get_state_dict(model, optimizer)

    def load_state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict,
                         optim_sd: dict | None, path: Path | None = None) -> None:
        """Copy state dicts filled by dcp.load into the model and optimizer."""
        if optim_sd is None:
            set_state_dict(model, [], model_state_dict=model_sd, optim_state_dict={})
        else:
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    def _apply_retention(self) -> None:
        found = self.checkpoints()
        if self.save_top_k < 0 or not found:
            return
        keep = {found[-1][1]} if self.save_last else set()
        scored = []
        for _, path in found:
            value = json.loads((path / "trainer.json").read_text()).get("metrics", {}).get(self.monitor)
            if value is not None:
                scored.append((value, path))
        scored.sort(key=lambda x: x[0], reverse=self.mode == "max")
        keep |= {path for _, path in scored[: self.save_top_k]}
        if not scored and not self.save_last:
            keep.add(found[-1][1])  # never delete everything
        for _, path in found:
            if path not in keep:
                shutil.rmtree(path)
                log.info("removed checkpoint %s (retention)", path.name)


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load only the model part of a training checkpoint (fine-tuning / continued pretraining)."""
    sd = get_state_dict(model, [], options=StateDictOptions())[0]
    load_checkpoint_model(sd, path)
    set_state_dict(model, [], model_state_dict=sd, optim_state_dict={})
