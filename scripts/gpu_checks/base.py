"""What the checks of scripts/gpu_check.py share: the run's context, the registry, skipping."""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the checkout


class Skip(Exception):
    """A check that cannot run here; the message says why."""


@dataclass
class Result:
    name: str
    status: str  # pass | fail | skip
    summary: str
    seconds: float
    figures: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class Context:
    device: torch.device
    quick: bool
    tmp: Path
    shared_data: Path  # ../shared/data: the tokenizers
    compile_backend: str = "inductor"  # the Trainer's (generate(compile=True) always uses inductor)
    _made: dict = field(default_factory=dict)

    def once(self, key: str, make: Callable[[], object]):
        """What `make` returns, made on first use and shared by the checks that need it."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]

    @property
    def fp32_tol(self) -> float:
        """Max abs logit difference allowed in fp32: CPU kernels agree to ~1e-5; CUDA's (TF32
        off) reorder sums."""
        return 1e-4 if self.device.type == "cpu" else 5e-4


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


CHECKS: dict[str, Callable[[Context], tuple[str, dict]]] = {}


def check(fn: Callable[[Context], tuple[str, dict]]):
    """Register a check: it returns (one-line figures, figures for the JSON), raises Skip or
    fails."""
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def free(ctx: Context) -> None:
    """Give back what a finished run or model held (the next one starts from an empty device)."""
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
