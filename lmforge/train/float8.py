"""trainer.float8=true: the blocks' linear layers compute in FP8 through torchao's Float8Linear.

Each matmul of a converted linear (forward, and both of its backward products) casts its operands to
float8_e4m3 with dynamic scales, one per tensor ("tensorwise", the faster) or one per row
("rowwise", more accurate for outliers), and multiplies on FP8 tensor cores (compute capability 8.9
and up: H100, L4, RTX 4090); weights, gradients and optimizer state keep the run's precision. The LM
head and embeddings stay as they are (lmforge's loss reads the head's weight itself), and so does
any linear whose dimensions are not multiples of 16, which FP8 matmuls need.

torchao is an optional extra (`pip install 'lmforge[fp8]'`); every check is made before the run
writes anything, and a run that cannot use FP8 stops with one line saying why.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from lmforge.errors import UserError

log = logging.getLogger(__name__)

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)
PIP = "pip install 'lmforge[fp8]' (or pip install torchao)"


def check_float8(device: torch.device, tensor_parallel: int, lora: bool) -> None:
    """UserError unless FP8 training can run here: a CUDA device with FP8 tensor cores, torchao
    importable, a layout it is wired for."""
    if device.type != "cuda":
        raise UserError(
            f"trainer.float8=true needs a CUDA GPU with FP8 tensor cores (H100, L4, RTX 4090 or newer); "
            f"this run is on {device.type}: set trainer.float8=false"
        )
    if importlib.util.find_spec("torchao") is None:
        raise UserError(f"trainer.float8=true needs torchao, which is not installed: {PIP}")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        raise UserError(
            f"trainer.float8=true needs FP8 tensor cores (compute capability 8.9 or higher); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: "
            "set trainer.float8=false"
        )
    if tensor_parallel > 1:
        raise UserError(
            "trainer.float8=true with parallel.tensor > 1 is not supported yet: "
            "set parallel.tensor=1 (FSDP and pipeline parallelism work) or trainer.float8=false"
        )
    if lora:
        raise UserError(
            "trainer.float8=true with LoRA is not supported yet: set trainer.float8=false"
        )


def _convertible(module: nn.Module, name: str) -> bool:
    return (
        isinstance(module, nn.Linear)
        and name.startswith("layers.")
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def convert_to_float8(model: nn.Module, recipe: str) -> int:
    """Swap the blocks' linear layers for torchao's Float8Linear (recipe: tensorwise or rowwise),
    in place, before tensor/data parallelism and compile are applied; returns how many were
    converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convertible = [n for n, m in model.named_modules() if _convertible(m, n)]
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=_convertible)
    log.info(
        "trainer.float8: %d linear layers compute in FP8 (%s scales)", len(convertible), recipe
    )
    return len(convertible)
