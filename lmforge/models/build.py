"""Build a model from a ModelConfig (or a preset name), initialise it, count its parameters."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lmforge.config import from_dict
from lmforge.models.config import ModelConfig
from lmforge.models.decoder import Decoder
from lmforge.models.encoder import Bert
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
        if seed is not None:
            torch.manual_seed(seed)
        init_weights(model, cfg)
    return model.to(dtype) if dtype is not None else model


def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """Megatron/GPT-2 init: N(0, init_std), residual output projections scaled by 1/sqrt(2L),
    zero biases, unit norms, zero vocabulary padding rows."""
    out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = out_std if name.endswith(("attn.proj", "mlp.down")) else cfg.init_std
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, cfg.init_std)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()  # norms, rotary frequencies, MLM bias
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in model.vocab_parameters:
            if name in params:
                params[name][cfg.vocab_size :].zero_()


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
