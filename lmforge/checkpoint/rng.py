"""Every random generator a step draws from (Python, NumPy, torch's CPU one and the device's), as
JSON a checkpoint keeps per rank: a resumed run draws the same dropout masks and data order, bit
for bit."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed every generator rng_state keeps from a run's seed: lmforge's own draws use generators
    of their own, but a library or a user's code reached from a step (a dataset, an evaluation
    task) may draw from the global ones."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy's legacy seed takes 32 bits
    torch.manual_seed(seed)  # the device generators too


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
