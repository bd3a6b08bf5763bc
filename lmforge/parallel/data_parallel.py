"""The process group a run joins, and what the trainer needs of a DDP- or FSDP2-wrapped model:
its inner module, and gradient sync skipped on accumulation micro-batches (the plans are in
lmforge.parallel.compose)."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_world(
    device: str = "auto", backend: str | None = None, timeout_minutes: float = 10.0
) -> World:
    """Join the torchrun/Slurm process group when launched that way; one process otherwise.
    `device`: "auto" (the accelerator torch.accelerator reports, else the CPU), "cpu", "cuda",
    ... (lmforge.devices); `backend`: the process-group backend, default gloo for CPU tensors
    plus the device's own library."""
    from lmforge.devices import dist_backend, resolve_device, set_device
    from lmforge.launcher import end_with_launcher

    # a torchrun worker dies with its launcher (library use; the CLI did it already)
    end_with_launcher()
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    resolved = resolve_device(device, local_rank, key="trainer.device")
    set_device(resolved)
    if size > 1 and not dist.is_initialized():
        # A rank that dies or hangs must not stall the others forever: collectives time out.
        dist.init_process_group(
            dist_backend(resolved, backend), timeout=datetime.timedelta(minutes=timeout_minutes)
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    return World(rank=rank, size=size, local_rank=local_rank, device=resolved)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "no_sync") and hasattr(model, "module") else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """DDP: skip the gradient all-reduce on accumulation micro-batches but the last. FSDP2
    reduce-scatters every micro-batch's gradients: skipping it would keep the whole model's
    unsharded gradients on every rank between micro-batches (44 GiB for pythia-12b, lmforge plan
    shows), which is what FSDP exists to avoid. Expert parallelism's experts reduce their
    gradients on the last one only, as DDP does, whether they reduce them themselves or are FSDP2
    units of their own (lmforge.parallel.expert): a rank keeps the unsharded gradient of its own
    experts (1 / parallel.expert of them) between micro-batches and they are reduced once per
    step."""
    from lmforge.models.moe import moe_layers

    layers = moe_layers(model)
    dispatchers = [m.dispatch for m in layers if hasattr(m.dispatch, "sync")]
    # FSDP2 units
    sharded = [m.experts for m in layers if hasattr(m.experts, "set_requires_gradient_sync")]
    for d in dispatchers:
        d.sync = enabled
    for experts in sharded:
        experts.set_requires_gradient_sync(enabled, recurse=False)
    try:
        if not enabled and hasattr(model, "no_sync"):  # DDP
            with model.no_sync():
                yield
        else:
            yield
    finally:
        for d in dispatchers:
            d.sync = True
        for experts in sharded:
            experts.set_requires_gradient_sync(True, recurse=False)
