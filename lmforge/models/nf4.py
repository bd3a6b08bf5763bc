"""QLoRA's frozen base (Dettmers et al. 2023): the blocks' linear weights, and a mixture of experts'
stacked expert weights, in 4-bit NormalFloat through torchao, one absmax scale per 64 weights, the
scales quantized again in blocks of 256 (lora.base_dtype=nf4, lmforge.models.lora).

torchao's NF4 tensor is 2-D, so a stacked expert weight is held as one: gate_up (experts, 2,
moe_intermediate, hidden) as (experts * 2 * moe_intermediate, hidden), down (experts, hidden,
moe_intermediate) as (experts * hidden, moe_intermediate). NF4's blocks run over the flattened
weight either way; lmforge.models.moe.stacked gives the stacked view back, dequantized, where the
experts compute.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from lmforge.errors import UserError

log = logging.getLogger(__name__)

# QLoRA's NF4 (Dettmers et al. 2023): one absmax scale per 64 weights, the scales quantized again in
# blocks of 256.
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
# The scale groups of every NF4 weight come in multiples of this where its size allows
# (scaler_block): FSDP2 over up to this many ranks shards them.
NF4_SHARDS = 64


def nf4_api():
    """torchao's NF4 functions (to_nf4, NF4Tensor): their module moved in torchao 0.15."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor as nf4
    except ImportError:
        try:
            from torchao.dtypes import nf4tensor as nf4
        except ImportError as e:  # installed, but built for another torch or damaged
            raise UserError(
                f"torchao does not import ({e}): pip install a torchao release built for torch "
                f"{torch.__version__.split('+')[0]} (pip install -U torchao)"
            ) from None
    return nf4.to_nf4, nf4.NF4Tensor


def nf4_weights(model: nn.Module) -> tuple[dict[str, tuple[nn.Module, str]], list[str]]:
    """The frozen weights NF4 quantizes, parameter name -> (module, attribute): the blocks'
    linear weights and their stacked experts' gate_up and down (lmforge.models.moe.Experts, a
    LoRA-wrapped one too: its STACKED_WEIGHTS); and the modules whose weights it keeps in bf16 (a
    size with no whole 64-weight blocks)."""
    quantized, kept = {}, []
    for name, module in model.named_modules():
        if ".layers." not in f".{name}":
            continue
        attrs = (
            ("weight",) if isinstance(module, nn.Linear) else getattr(module, "STACKED_WEIGHTS", ())
        )
        if any(getattr(module, a).numel() % NF4_BLOCK for a in attrs):
            kept.append(name)
        else:
            quantized.update({f"{name}.{a}": (module, a) for a in attrs})
    return quantized, kept


def scaler_block(blocks: int) -> int:
    """The second-level block of a weight of `blocks` 64-weight blocks: QLoRA's 256 where the
    weight then has a multiple of NF4_SHARDS scale groups, else the largest block under 256 that
    gives it one (the fewest groups a multiple of 32, 16, ... where it has none). torchao's NF4
    tensor splits along whole groups, so FSDP2 over any power of two up to NF4_SHARDS ranks can
    shard every weight (its rows dividing too), and the quantized values do not depend on the
    layout: one process and FSDP2 train the same numbers. Real models' large weights keep 256
    (4096 x 4096: 1,024 groups); a smaller block only quantizes the scales more finely."""
    shards = NF4_SHARDS
    while blocks % shards:
        shards //= 2
    groups_of = blocks // shards  # the block divides this: the largest divisor up to 256
    return next(d for d in range(min(NF4_SCALER_BLOCK, groups_of), 0, -1) if groups_of % d == 0)


def to_nf4_parameter(w: torch.Tensor) -> nn.Parameter:
    """A frozen weight in NF4 (QLoRA's 64-weight blocks, the scales quantized again in blocks:
    scaler_block); a stacked one (experts, ..., columns) as the 2-D (rows, columns) torchao holds
    (module docstring)."""
    to_nf4, _ = nf4_api()
    w = w.detach().to(torch.bfloat16).reshape(-1, w.shape[-1])
    return nn.Parameter(
        to_nf4(w, NF4_BLOCK, scaler_block(w.numel() // NF4_BLOCK)), requires_grad=False
    )


def check_shardable(quantized: dict[str, tuple[nn.Module, str]], ranks: int) -> None:
    """A UserError unless FSDP2 over `ranks` can split every NF4 weight (nf4_weights'
    `quantized`): its rows as NF4 holds it and its scale groups (torchao splits an NF4 tensor
    along whole groups) divisible by the ranks."""
    from lmforge.errors import UserError

    for name, site in quantized.items():
        w = getattr(*site)
        columns = w.shape[-1]
        rows, blocks = w.numel() // columns, w.numel() // NF4_BLOCK
        groups = blocks // scaler_block(blocks)
        if rows % ranks or groups % ranks:
            raise UserError(
                f"lora.base_dtype=nf4 (QLoRA) under FSDP2 over {ranks} ranks: '{name}' ({rows} x "
                f"{columns}, {groups} NF4 scale groups) cannot be split {ranks} ways: use fewer ranks "
                "(parallel.data_shard), or lora.base_dtype=bf16"
            )


def quantize_nf4(
    model: nn.Module,
    weights: dict[str, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
) -> int:
    """Swap the blocks' frozen bf16 weights (nf4_weights) for torchao NF4 tensors, in place, or
    quantize them from `weights` (name -> tensor, a model on the meta device) onto `device`.
    Returns how many weights were quantized."""
    quantized, kept = nf4_weights(model)
    for name, (module, attr) in quantized.items():
        w = getattr(module, attr) if weights is None else weights[name].to(device)
        setattr(module, attr, to_nf4_parameter(w))
    log_quantized(quantized, kept)
    return len(quantized)


def log_quantized(quantized: dict[str, tuple[nn.Module, str]], kept: list[str]) -> None:
    stacked = sum(attr != "weight" for _, attr in quantized.values())
    log.info(
        "lora.base_dtype=nf4: %d linear weights in NF4 (a fused q/k/v or gate/up one counted once)%s%s",
        len(quantized) - stacked,
        f" and {stacked} stacked expert weights" if stacked else "",
        f"; {len(kept)} kept in bf16 (size not a multiple of {NF4_BLOCK}): {', '.join(kept)}"
        if kept
        else "",
    )


def is_nf4(t: torch.Tensor) -> bool:
    """Whether `t` (or a DTensor's local piece) is a torchao NF4 weight."""
    local = getattr(t, "_local_tensor", t)
    return hasattr(local, "get_original_weight")


# dequantize's chunk, in bytes of NF4 data (two weights each): a multiple of every block's 32 bytes.
DEQUANTIZE_CHUNK = 1 << 23


def dequantize(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A torchao NF4 weight dequantized into one new tensor of `dtype` (its own, bf16, by
    default), the values of its get_original_weight bit for bit, a chunk of DEQUANTIZE_CHUNK
    bytes at a time. get_original_weight's intermediates hold ~14 bytes a weight (int64 indices
    among them): for one layer's stacked experts (Mixtral 8x7B's gate_up: 0.94 billion weights)
    that is 13 GB beside the 1.9 GB result; here they are a chunk's."""
    out = torch.empty(w.shape, dtype=dtype or w.dtype, device=w.device)
    # each byte of NF4 data holds two consecutive weights: its high then its low 4 bits
    pairs = out.view(-1, 2)
    scalers = w.dequantize_scalers(w.quantized_scalers, w.quantization_factor, w.scaler_block_size)
    half = w.block_size // 2  # a block's bytes
    data = w.quantized_data
    for start in range(0, data.numel(), DEQUANTIZE_CHUNK):
        q = data[start : start + DEQUANTIZE_CHUNK]
        scale = scalers[start // half : (start + q.numel()) // half].repeat_interleave(half)
        pairs[start : start + q.numel(), 0] = w.nf4[(q >> 4).long()] * scale
        pairs[start : start + q.numel(), 1] = w.nf4[(q & 0b1111).long()] * scale
    return out


class _LinearNF4(torch.autograd.Function):
    """torchao's LinearNF4 (x W^T forward, g W backward, W dequantized in the input's dtype each
    time; W keeps no gradient), its products bit for bit, with dequantize's chunked
    dequantization: torchao's holds ~14 bytes a weight of intermediates, 3.3 GB for one of
    Llama-3.1-70B's 8192 x 28672 MLP weights."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w)
        return torch.nn.functional.linear(x, dequantize(w, x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (w,) = ctx.saved_tensors
        return grad @ dequantize(w, grad.dtype), None


def nf4_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over an NF4 weight (and a frozen bias) as torchao computes it, dequantized a
    chunk at a time (_LinearNF4). Inside torch.compile, torchao's own: Inductor fuses its
    dequantization into few kernels."""
    if torch.compiler.is_compiling():
        return torch.nn.functional.linear(x, w, bias)
    out = _LinearNF4.apply(x, w)
    return out if bias is None else out + bias


def dense(w: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor: an NF4 weight dequantized (bf16, a chunk at a time), any other
    as it is."""
    return dequantize(w) if hasattr(w, "get_original_weight") else w  # a DTensor (sharded) as it is


def gathered(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole tensor (full_tensor); QLoRA's NF4 pieces dequantized first, each rank
    its own blocks, and gathered in bf16: torchao's NF4 tensor passes DTensor's gather on to its
    inner tensors without waiting for them (an export read them unfinished, or hung). The same
    values as the whole NF4 weight dequantized."""
    from torch.distributed.tensor import DTensor

    local = t.to_local()
    if is_nf4(local):
        t = DTensor.from_local(
            dequantize(local), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
        )
    return t.full_tensor()
