"""Build a model from a ModelConfig (or a preset name), initialise it, count its parameters."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lmforge.config import from_dict
from lmforge.models.config import ModelConfig
from lmforge.models.decoder import Decoder
from lmforge.models.encoder import Bert
from lmforge.models.moe import Experts
from lmforge.models.presets import preset


def as_config(config: ModelConfig | str | dict[str, Any]) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, str):
        return preset(config)
    return from_dict(ModelConfig, config, where="model.")


def build(
    config: ModelConfig | str | dict[str, Any],
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> nn.Module:
    """The model for `config` (a ModelConfig, a preset name or a dict), freshly initialised.

    On device="meta" nothing is allocated or initialised (for counting, or to load into later).
    """
    cfg = as_config(config)
    cls = Bert if cfg.family == "bert" else Decoder
    with torch.device(device or "cpu"):
        model = cls(cfg)
    if str(device) != "meta":
        init_weights(model, cfg, seed)
    return model.to(dtype) if dtype is not None else model


def init_weights(
    model: nn.Module,
    cfg: ModelConfig,
    seed: int | None = None,
    skip: Callable[[str], bool] | None = None,
) -> None:
    """Megatron/GPT-2 init: N(0, init_std), residual output projections scaled by 1/sqrt(2L),
    zero biases, unit norms, zero vocabulary padding rows.

    Each weight draws from a generator of its own, seeded from `seed` and the weight's name, on
    the CPU: a weight has the same values whatever the device, and wherever it lives: whole in
    one process, or as the local pieces of DTensors (tensor-parallel, FSDP) or pipeline stages on
    many ranks, each rank filling only the pieces it holds (one whole weight is drawn at a time).
    Without `seed`, the global CPU generator draws. Every parameter must be covered: a new kind
    of layer says how it starts; `skip` names those that start elsewhere (a LoRA-wrapped model's
    adapters: lmforge.models.lora.init_adapters)."""
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    vocab = set(getattr(model, "vocab_parameters", ()))
    done: set[int] = set()
    for name, module in model.named_modules():
        name = unwrapped_name(name)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            key = f"{name}.weight"
            std = (
                out_std
                if isinstance(module, nn.Linear) and name.endswith(("attn.proj", "mlp.down"))
                else cfg.init_std
            )
            _fill_normal(module.weight, std, seed, key, cfg.vocab_size if key in vocab else None)
            if getattr(module, "bias", None) is not None:
                with torch.no_grad():
                    module.bias.zero_()
        # stacked expert MLPs: as one MLP's gate/up and down, each expert drawn
        elif isinstance(module, Experts):
            _fill_normal(module.gate_up, cfg.init_std, seed, f"{name}.gate_up", None)
            _fill_normal(module.down, out_std, seed, f"{name}.down", None)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()  # norms, rotary frequencies, MLM bias
        else:
            continue
        done.update(id(p) for p in module.parameters(recurse=False))
    left = [
        n
        for n, p in model.named_parameters()
        if id(p) not in done and not (skip and skip(unwrapped_name(n)))
    ]
    if left:
        raise RuntimeError(
            f"init_weights does not know how to initialise {left[0]}: give its module "
            "reset_parameters()"
        )
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in vocab:
            # a vocabulary bias: its padding rows zero too
            if name in params and not name.endswith(".weight"):
                local, box = local_piece(params[name])
                rows = box[0]
                local[max(0, cfg.vocab_size - rows.start) :].zero_()


def unwrapped_name(name: str) -> str:
    """A module's name in the model, without the wrappers' prefixes (torch.compile, activation
    checkpointing)."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def local_piece(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """The tensor this process holds of `t` (a DTensor's local piece, else `t`), and which slices
    of the whole tensor it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _fill_normal(
    weight: torch.Tensor, std: float, seed: int | None, key: str, real_rows: int | None
) -> None:
    """`weight` (or its local piece) <- its rows of one N(0, std) draw of the whole weight; rows
    from `real_rows` on (vocabulary padding) zero."""
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(
            (seed * 1_000_003 + zlib.crc32(key.encode())) % (1 << 63)
        )
    local, box = local_piece(weight)
    if not local.numel():
        return
    whole = torch.empty(weight.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
    if real_rows is not None:
        whole[real_rows:].zero_()
    with torch.no_grad():
        local.copy_(whole[box])


def num_parameters(model: nn.Module, exclude_vocab_padding: bool = True) -> int:
    """Parameter count; without the padding rows it equals the published (transformers) count."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_vocab_padding:
        cfg = model.config
        params = dict(model.named_parameters())
        for name in model.vocab_parameters:
            if name in params:
                p = params[name]
                total -= (cfg.padded_vocab_size - cfg.vocab_size) * (p.numel() // p.shape[0])
    return total


def materialize_meta(module: nn.Module, device: torch.device | str) -> None:
    """to_empty for the tensors still on the meta device: what a model already holds (QLoRA's NF4
    weights, read before the layout: lmforge.parallel.load.read_nf4_base) stays."""
    module._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
