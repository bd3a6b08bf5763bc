"""A LoRA model's state dict: its base tensors and adapters apart (PEFT's export), or the
adapters folded into the base (the merged `hf/` export, a checkpoint read as a plain model)."""

from __future__ import annotations

import torch

from lmforge.models.config import ModelConfig
from lmforge.models.lora import QKV, fuse_parts, is_adapter
from lmforge.models.lora_experts import expert_delta
from lmforge.models.moe import stacked
from lmforge.models.nf4 import dense


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """A LoRA model's state dict -> (the base's tensors, {module: {"A": {part: A}, "B": {part:
    B}}})."""
    base, adapters = {}, {}
    for name, t in state.items():
        if not is_adapter(name):
            base[name] = t
            continue
        module, kind, part = name.rsplit(".", 2)  # layers.0.attn.qkv, lora_A, q
        adapters.setdefault(module, {"A": {}, "B": {}})[kind[-1]][part] = t
    return base, adapters


def merged_state(
    state: dict[str, torch.Tensor], cfg: ModelConfig, scaling: float
) -> dict[str, torch.Tensor]:
    """A LoRA model's state dict (plain tensors, e.g. gathered for export) with the adapters
    folded into the base."""
    base, adapters = split_state(state)
    # NF4 weights, adapted or not, leave as bf16
    base = {name: dense(t) for name, t in base.items()}
    # QLoRA's 2-D experts, stacked again
    for name in [n for n in base if n.endswith(".experts.gate_up")]:
        down = name.removesuffix("gate_up") + "down"
        base[name], base[down] = stacked(base[name], base[down])
    for module, ab in adapters.items():
        if module.endswith(".experts"):  # stacked experts: each weight's per-expert B A
            for weight, a in ab["A"].items():
                w = base[f"{module}.{weight}"]
                base[f"{module}.{weight}"] = (
                    w.float() + expert_delta(a, ab["B"][weight], scaling)
                ).to(w.dtype)
            continue
        parts = {p: ab["B"][p].float() @ ab["A"][p].float() for p in ab["A"]}
        split = set(parts) <= set(QKV)
        delta = (
            fuse_parts({p: t.t() for p, t in parts.items()}, cfg).t()
            if split
            else next(iter(parts.values()))
        )
        w = base[f"{module}.weight"]
        base[f"{module}.weight"] = (w.float() + scaling * delta).to(w.dtype)
    return base
