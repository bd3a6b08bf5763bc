"""Versions, the device, and which SDPA kernels run on it."""

from __future__ import annotations

import subprocess
import sys

import torch

from gpu_checks.base import ROOT, Context, check
from lmforge.devices import synchronize


@check
def check_environment(ctx: Context) -> tuple[str, dict]:
    import transformers
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = ctx.device
    fig = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "device": str(dev),
        "python": sys.version.split()[0],
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        fig.update(
            name=torch.cuda.get_device_name(dev),
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version(),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
    else:
        fig["name"] = dev.type
    q = torch.randn(1, 4, 256, 64, device=dev, dtype=torch.bfloat16)
    fig["sdpa"] = {}
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ):
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            synchronize(dev)
            fig["sdpa"][backend.name.lower()] = "yes"
        except Exception as e:  # no kernel for this device, dtype or shape
            fig["sdpa"][backend.name.lower()] = (
                f"no ({(str(e).splitlines() or [type(e).__name__])[0][:80]})"
            )
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    fig["lmforge_commit"] = commit.stdout.strip() or "unknown"
    kernels = ", ".join(k for k, v in fig["sdpa"].items() if v == "yes")
    cuda = f", CUDA {fig['cuda']}, capability {fig['capability']}" if dev.type == "cuda" else ""
    return (
        f"{fig['name']}{cuda}; torch {fig['torch']}, transformers {fig['transformers']}; SDPA: {kernels}",
        fig,
    )
