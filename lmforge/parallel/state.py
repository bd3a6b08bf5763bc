"""What the trainer needs around a ParallelModel: the global gradient norm (clipping) and model
state dicts under the model's own parameter names, for DCP checkpoints that reshard."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


def _grads(pm) -> list[torch.Tensor]:
    """Each parameter's gradient once: a tied embedding's last-stage copy is left out (its gradient
    equals the first stage's after sync_tied_gradients)."""
    out, seen = [], set()
    for part in pm.parts:
        skip = set(getattr(part, "tied_parameters", ()))
        for name, p in part.named_parameters():
            if name in skip or id(p) in seen or p.grad is None:
                continue
            seen.add(id(p))
            out.append(p.grad)
    return out


# CPU's fp32 norm kernel sums each SIMD lane sequentially: over an embedding-sized gradient
# (millions of elements) it is ~1e-3 relative off, and off differently for each way the tensor is
# sharded, so clipping (and every later step) would depend on the layout. Chunks of this many
# elements keep each sequential run short (~1e-7), at ~1.3x the time.
_CHUNK = 1 << 16


def _sum_of_squares(t: torch.Tensor) -> torch.Tensor:
    """Σ t² as a float64 scalar, accumulated in fp32 in chunks of _CHUNK elements on CPU
    (accelerators reduce in trees already)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu" or flat.numel() <= _CHUNK:
        return torch.linalg.vector_norm(flat, dtype=torch.float32).double() ** 2
    # one call, as clip_grad_norm_
    chunks = torch.stack(torch._foreach_norm(list(flat.float().split(_CHUNK))))
    return (chunks.double() ** 2).sum()


def _placements_of_squares(placements) -> list:
    """How a sum of squares over each rank's local shard combines over the mesh: summed where the
    tensor is sharded, the same everywhere it is replicated. (FSDP over TP shards with torch's
    _StridedShard, which is_shard() does not count as a Shard in every release.)"""
    return [Replicate() if p.is_replicate() else Partial("sum") for p in placements]


class _NoSequenceWarnings(logging.Filter):
    """torch 2.12+ warns, on every rank, when DTensor reduces or gathers over two mesh dims with
    two collectives in a row ("may give inconsistent results between ranks due to different
    reduction orders ... flatten mesh dimensions"). A gather reduces nothing (the export's:
    FSDP2's _StridedShard over tensor parallelism). The gradient norm's two all-reduces give
    every rank the same sums: the first leaves one value per group, the second adds those same
    values on every rank (tested: every layout's norm equals one process's). Flattening the mesh
    instead (DeviceMesh._flatten, private) gave expert-parallel layouts, whose ranks are
    permuted, other values."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("sequential all_gather" in message or "sequential all_reduce" in message)


@contextlib.contextmanager
def redistributing_quietly():
    """full_tensor() of the model's DTensors without torch's collectives-in-a-row warning
    (_NoSequenceWarnings)."""
    logger, quiet = (
        logging.getLogger("torch.distributed.tensor._redistribute"),
        _NoSequenceWarnings(),
    )
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def grad_norm(pm) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (float64 scalar, equal on every rank, equal for
    every layout).

    DTensor gradients (FSDP, TP) are grouped by mesh and placements; each group's local sum of
    squares is reduced over its mesh once (a partial gradient is reduced first). Plain gradients are
    replicated wherever they exist. Pipeline stages hold disjoint parameters: squares are summed
    over the pipeline group.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    # The sum lives on the model's device: a pipeline group on NCCL has no backend for CPU tensors.
    total = torch.zeros((), dtype=torch.float64, device=pm.device)
    for g in _grads(pm):
        if isinstance(g, DTensor):
            if any(p.is_partial() for p in g.placements):
                g = g.redistribute(
                    g.device_mesh, [Replicate() if p.is_partial() else p for p in g.placements]
                )
            groups.setdefault((g.device_mesh, g.placements), []).append(g)
        else:
            total += _sum_of_squares(g)
    for (mesh, placements), group in groups.items():
        local = torch.stack([_sum_of_squares(g.to_local()) for g in group]).sum()
        squares = DTensor.from_local(
            local, mesh, _placements_of_squares(placements), run_check=False
        )
        with redistributing_quietly():
            total += squares.full_tensor().to(total.device)
    if pm.mesh is not None and pm.size("pp") > 1:
        dist.all_reduce(total, group=pm.mesh["pp"].get_group())
    return total.sqrt()


def align_gradients(pm) -> None:
    """Lay each DTensor gradient out as its parameter is: a sequence-parallel norm's gradient
    comes out of the backward as a partial sum over the tensor ranks (reduced here, once), a
    vocabulary-parallel embedding's replicated (sliced here, no communication). The optimizer
    then updates like with like: left to it, torch 2.13's DTensor reduces a partial gradient
    inside the optimizer's ops, and 2.6's not at all (each tensor rank stepped its norms with its
    own partial gradient, 7e-4 off one process's weights after two steps at lr 3e-3)."""
    for part in pm.parts:
        for p in part.parameters():
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(p.device_mesh, p.placements)


def clip_grad_norm_(pm, max_norm: float) -> torch.Tensor:
    """Lay the gradients out as their parameters (align_gradients), then scale them so that their
    global norm is at most max_norm; returns the norm before (a float64 scalar on the model's
    device: reading it is the caller's host sync). A non-finite norm leaves the gradients alone
    (the trainer then skips the step)."""
    align_gradients(pm)
    norm = grad_norm(pm)
    if max_norm > 0:
        # Decided on the device, as clip_grad_norm_ does: a factor of exactly 1 leaves a gradient
        # bit for bit as it is, so choosing whether to scale needs no host sync.
        scale = torch.where(norm.isfinite() & (norm > max_norm), max_norm / (norm + 1e-6), 1.0)
        for part in pm.parts:
            for p in part.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
    return norm


def model_state_dict(pm) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers under the model's names (DTensors where sharded), for
    dcp.save / dcp.load: any pipeline/tensor/data layout reads a checkpoint written by any other."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    out: dict[str, torch.Tensor] = {}
    for part in pm.parts:
        out.update(get_model_state_dict(part))
    return out


def load_model_state_dict(pm, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy `state_dict` (e.g. filled in place by dcp.load) into this rank's parts."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from lmforge.models.nf4 import is_nf4

    for part in pm.parts:
        held = get_model_state_dict(part)  # the model's names, also through a DDP wrapper
        # QLoRA's frozen NF4 base stays as read
        names = {k for k, t in held.items() if not is_nf4(t)}
        missing = names - state_dict.keys()
        if missing:
            raise KeyError(f"state dict lacks {sorted(missing)[:5]}")
        set_model_state_dict(
            part,
            {k: state_dict[k] for k in names},
            options=StateDictOptions(strict=len(names) == len(held)),
        )
