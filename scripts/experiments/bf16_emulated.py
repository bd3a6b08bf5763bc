"""`lmforge pretrain`, with every bf16 GEMM computed as fp32 GEMM of the same bf16 values.

For CPUs without avx512_bf16 or AMX, where PyTorch's bf16 matrix multiply takes a scalar path about
a hundred times slower than fp32 (measured here: 0.5 GFLOP/s bf16 vs ~30-200 GFLOP/s fp32). A bf16
GEMM on hardware that has it (oneDNN on AVX-512 BF16/AMX, cuBLAS on GPUs) multiplies bf16 inputs,
accumulates in fp32 and rounds the result to bf16; this computes exactly that, up to the order of
the fp32 summation, by upcasting the (exactly representable) bf16 inputs, multiplying in fp32 and
rounding the product to bf16. Everything else -- bf16 weights, bf16 activations, the optimizers with
round-to-nearest or stochastic rounding, autocast -- is lmforge's own code path, unchanged.

    python scripts/experiments/bf16_emulated.py pretrain CONFIG.yaml [key=value ...]

takes the arguments of `lmforge pretrain`. On a machine with bf16 hardware run `lmforge pretrain`
itself: the numbers differ only by summation order.
"""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


class Bf16GemmsInFp32(TorchDispatchMode):
    """Below autograd and autocast: sees the GEMMs of forward and backward with their final
    dtypes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMMS and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args
        ):
            up = [
                a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a
                for a in args
            ]
            return func(*up, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def main(argv: list[str]) -> int:
    from lmforge.cli import main as lmforge

    with Bf16GemmsInFp32():
        return lmforge(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
