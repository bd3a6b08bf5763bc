"""Values a run config's types allow but a run cannot use, refused when the config is read (one
line each, before torch.optim says it in a traceback), and the settings that run but cannot do
what they say (a warning)."""

from __future__ import annotations

import math
from typing import Any

from lmforge.errors import UserError

# lmforge.train.config.RunConfig, which calls check_run (an import back would be a cycle)
RunConfig = Any


def _at_least(key: str, value, low: float, meaning: str = "") -> None:
    if value is not None and not value >= low:  # (NaN is no number at least anything)
        raise UserError(f"{key} must be >= {low:g}{meaning}, got {value}")


def _positive(key: str, value) -> None:
    if not value > 0:
        raise UserError(f"{key} must be > 0, got {value}")


def check_run(cfg: RunConfig) -> None:
    """UserError for the first value of trainer, checkpoint or optim that no run can use."""
    t, c, o = cfg.trainer, cfg.checkpoint, cfg.optim
    for name in ("max_steps", "global_batch_size", "micro_batch_size", "log_every_n_steps"):
        _at_least(f"trainer.{name}", getattr(t, name), 1)
    _at_least("trainer.val_check_interval", t.val_check_interval, 0, " (0: no validation)")
    if t.max_minutes is not None:
        _positive("trainer.max_minutes", t.max_minutes)
    _at_least("trainer.val_batches", t.val_batches, 0)
    _at_least("checkpoint.every_n_steps", c.every_n_steps, 0, " (0: a checkpoint at the end only)")
    _at_least("checkpoint.save_top_k", c.save_top_k, -1, " (-1 keeps every checkpoint)")
    _positive("optim.lr", o.lr)
    _positive("optim.eps", o.eps)
    _at_least("optim.weight_decay", o.weight_decay, 0)
    _at_least("optim.warmup_steps", o.warmup_steps, 0)
    _at_least("optim.decay_steps", o.decay_steps, 0, " (unset or 0: trainer.max_steps)")
    _at_least("optim.min_lr", o.min_lr, 0)
    if o.min_lr > o.lr and o.schedule != "constant":
        raise UserError(
            f"optim.min_lr={o.min_lr:g} is above optim.lr={o.lr:g}, the peak: the {o.schedule} decay "
            "would raise the learning rate; set optim.min_lr to at most optim.lr"
        )
    if len(o.betas) != 2 or not all(math.isfinite(b) and 0 <= b < 1 for b in o.betas):
        raise UserError(
            f"optim.betas must be two numbers in [0, 1) (Adam's beta1 and beta2), as [0.9, 0.95]; "
            f"got {list(o.betas)}"
        )


def check_torch_for_layout(cfg: RunConfig, tensor: int) -> None:
    """UserError for a run this torch lays out but computes wrongly: LoRA under tensor
    parallelism gives other gradients than one process on torch 2.6 and 2.8 (LoRA on q,k,v
    together, LoRA on experts; their tests fail there and pass on 2.9, 2.11 and 2.13), with no
    error."""
    from lmforge.parallel.mesh import torch_release, torch_version

    if cfg.lora is not None and tensor > 1 and torch_version() < (2, 9):
        raise UserError(
            f"LoRA under tensor parallelism needs torch 2.9 or later (on 2.6 and 2.8 its gradients differ "
            f"from one process's, silently); this is torch {torch_release()}: upgrade torch, or set "
            "parallel.tensor=1"
        )


def schedule_warning(cfg: RunConfig) -> str | None:
    """What a warmup longer than the run does to the learning rate, or None where the run reaches
    its peak."""
    o, steps = cfg.optim, cfg.trainer.max_steps
    if not o.warmup_steps or o.warmup_steps < steps:
        return None
    reached = (
        "reaches optim.lr only at its last step"
        if o.warmup_steps == steps
        else f"ends at {steps / o.warmup_steps:.0%} of optim.lr={o.lr:g}"
    )
    return (
        f"optim.warmup_steps={o.warmup_steps} >= trainer.max_steps={steps}: the learning rate {reached} and never "
        "decays; shorten the warmup or train longer"
    )
