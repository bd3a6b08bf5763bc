"""Which device the test suite computes on (loaded by pytest before any test imports torch's device
code).

The suite's references (transformers on the CPU, one process vs many, a killed run vs a whole one)
are exact, and the multi-process tests start gloo ranks: on a GPU machine it still runs on the CPU,
with the accelerators hidden (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES empty), so
`trainer.device=auto` and `--device auto` pick the CPU as they do in CI and no test assumes more
GPUs than exist. The GPU is checked by `scripts/gpu_check.py` (every family's parity, generation,
training, serving on the device, with device tolerances). LMFORGE_TEST_DEVICE=cuda leaves the
accelerators visible; tests that take the `test_device` fixture then run there, with
`tolerance(dtype)` fit for the device.
"""

from __future__ import annotations

import os

import pytest

TEST_DEVICE = os.environ.get("LMFORGE_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        os.environ[name] = ""


@pytest.fixture(scope="session")
def test_device():
    """The device of the device-aware tests: the CPU unless LMFORGE_TEST_DEVICE names another."""
    import torch

    from lmforge.devices import resolve_device

    return (
        resolve_device(TEST_DEVICE, key="LMFORGE_TEST_DEVICE")
        if TEST_DEVICE != "cpu"
        else torch.device("cpu")
    )


def tolerance(device, dtype) -> dict[str, float]:
    """assert_close tolerances for results computed on `device` in `dtype` against an fp32 CPU
    reference: CPU fp32 kernels agree to ~1e-5; CUDA's (TF32 off) reorder sums; bf16 keeps 8 bits
    of mantissa."""
    import torch

    if dtype == torch.bfloat16:
        return {"atol": 5e-2, "rtol": 5e-2}
    if device.type == "cpu":
        return {"atol": 1e-5, "rtol": 1e-5}
    return {"atol": 1e-4, "rtol": 1e-4}
