"""QLoRA's frozen base (Dettmers et al. 2023): the blocks' linear weights in 4-bit NormalFloat through torchao, one
absmax scale per 64 weights, the scales quantized again in blocks of 256 (lora.base_dtype=nf4, lmforge.models.lora).
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

log = logging.getLogger(__name__)

# QLoRA's NF4 (Dettmers et al. 2023): one absmax scale per 64 weights, the scales quantized again in blocks of 256.
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256


def nf4_api():
    """torchao's NF4 functions (to_nf4, NF4Tensor): their module moved in torchao 0.15."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor as nf4
    except ImportError:
        from torchao.dtypes import nf4tensor as nf4
    return nf4.to_nf4, nf4.NF4Tensor


def quantize_nf4(model: nn.Module) -> int:
    """Swap the blocks' (frozen, bf16) linear weights for torchao NF4 tensors, in place; a weight whose size has no
    whole 64-weight blocks stays bf16. The scales' second-level block is 256 (QLoRA's), or the largest power of two
    dividing the number of blocks in a weight too small for it. Returns how many weights were quantized."""
    to_nf4, _ = nf4_api()
    done, kept = 0, []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or ".layers." not in f".{name}":
            continue
        w = module.weight
        blocks = w.numel() // NF4_BLOCK
        if w.numel() % NF4_BLOCK:
            kept.append(name)
            continue
        scaler_block = math.gcd(blocks, NF4_SCALER_BLOCK)
        module.weight = nn.Parameter(to_nf4(w.detach().to(torch.bfloat16), NF4_BLOCK, scaler_block),
                                     requires_grad=False)
        done += 1
    log.info("lora.base_dtype=nf4: %d linear weights in NF4%s", done,
             f"; {len(kept)} kept in bf16 (size not a multiple of {NF4_BLOCK}): {', '.join(kept)}" if kept else "")
    return done


def dense(w: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor: an NF4 weight dequantized (bf16), any other as it is."""
    return w.get_original_weight() if hasattr(w, "get_original_weight") else w
