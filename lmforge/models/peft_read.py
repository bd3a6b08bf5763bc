"""PEFT's LoRA adapter folders into lmforge's LoRA: read_peft_config, load_peft_adapter (the folder format, the
Hugging Face names and row layouts: lmforge.models.peft, which writes them)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from lmforge.errors import UserError
from lmforge.fsutil import open_safetensors
from lmforge.models.config import ModelConfig
from lmforge.models.hf import hf_modules
from lmforge.models.hf.base import (
    CONV1D,
    FIRST_HALF,
    PLAIN,
    QKV_GROUPED,
    QKV_ROWS,
    QKV_SEPARATE,
    QKV_STACKED,
    SECOND_HALF,
    permute_rotary,
)
from lmforge.models.lora import HEADS, QKV, LoRALinear, fuse_parts, qkv_rows, split_parts
from lmforge.models.lora_experts import WEIGHTS as EXPERT_WEIGHTS
from lmforge.models.lora_experts import LoRAExperts, from_peft
from lmforge.models.peft import CONFIG, MOE_BLOCK, PART_OF, PEFT_EXPERT, PREFIX, WEIGHTS, hf_head_names

log = logging.getLogger(__name__)


def read_peft_config(folder: Path, classifier: bool = False) -> dict:
    """adapter_config.json of a LoRA adapter lmforge can load; `classifier`: into a classification model, whose
    head the adapter may hold whole (modules_to_save: score or classifier)."""
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise UserError(f"no {CONFIG} in '{folder}': point --lora at a PEFT LoRA adapter folder")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"'{path}' is not valid JSON ({e})") from None
    if config.get("peft_type") != "LORA":
        raise UserError(f"'{path}' is a {config.get('peft_type')} adapter: lmforge loads LoRA adapters")
    for key, fine in (("use_dora", False), ("bias", "none")):
        if config.get(key, fine) != fine:
            raise UserError(f"'{path}' has {key}={config[key]!r}: lmforge's LoRA supports {key}={fine!r} only")
    saved = config.get("modules_to_save") or []
    if saved and set(saved) <= set(HEADS) and not classifier:
        raise UserError(f"'{path}' is a sequence classifier's adapter (it saves its head, {', '.join(saved)}, whole): "
                        "it loads into a classifier of its base, not into a language model to generate or serve")
    for key in ("modules_to_save", "layers_to_transform"):
        if config.get(key) and not (key == "modules_to_save" and set(saved) <= set(HEADS)):  # a classifier's head
            raise UserError(f"'{path}' sets {key}: lmforge's LoRA adapts the same modules in every layer and trains "
                            "no whole module but a classifier's head")
    return config


def _scaling(config: dict, keys: tuple[str, ...], rank: int) -> float:
    """The scaling PEFT gives the module or parameter named by the first of `keys` that a pattern matches (its
    alpha_pattern, as peft.utils.other.get_pattern_key matches them), for its (stored) rank."""
    alpha = config["lora_alpha"]
    for key in keys:
        found = [v for p, v in (config.get("alpha_pattern") or {}).items() if re.match(rf"(.*\.)?({p})$", key)]
        if found:
            alpha = found[0]
            break
    return alpha / (rank ** 0.5 if config.get("use_rslora") else rank)


def _targeted_parameter(config: dict, key: str) -> bool:
    """Whether PEFT's target_parameters take the parameter `key` (its rule: the name, or a dotted suffix of it)."""
    return any(key == t or key.endswith(f".{t}") for t in config.get("target_parameters") or ())


def load_peft_adapter(model: nn.Module, folder: str | Path) -> int:
    """Wrap `model` (an lmforge decoder, not yet adapted) with the PEFT adapter in `folder`: afterwards the model
    computes what PeftModel.from_pretrained(base, folder) does. Returns the number of adapted modules."""
    folder = Path(folder)
    cfg: ModelConfig = model.config
    config = read_peft_config(folder, classifier=bool(cfg.num_labels))
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise UserError(f"no {WEIGHTS} in '{folder}'")
    with open_safetensors(weights) as f:
        stored = {k.removeprefix(PREFIX).replace(".default.", "."): f.get_tensor(k) for k in f.keys()}
    used: set[str] = set()

    def get(name: str, which: str) -> torch.Tensor | None:
        key = f"{name}.lora_{which}.weight"
        if key in stored:
            used.add(key)
            return stored[key].float()
        return None

    def scaled(name: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
        return a, b, _scaling(config, (name, f"{name}.weight"), a.shape[0])

    count = 0
    for module, (names, kind) in hf_modules(cfg).items():
        if module.split(".", 2)[-1] in ("mlp.router", "mlp.experts.gate_up", "mlp.experts.down"):
            continue  # a mixture of experts' (below)
        if kind in (PLAIN, CONV1D):
            a = get(names, "A")
            if a is None:
                continue
            part = PART_OF.get(module.split(".", 2)[-1])
            if part is None:
                raise UserError(f"'{folder}' adapts {names}, which lmforge's LoRA does not wrap (it adapts "
                                "q, k, v, o, gate, up, down, the router and the experts)")
            parts = {part: scaled(names, a, get(names, "B"))}
        elif kind in (FIRST_HALF, SECOND_HALF):  # Phi-3's gate_up_proj: gate's rows, then up's
            a = get(names, "A")
            if a is None:
                continue
            rows = cfg.intermediate_size
            b = get(names, "B")
            a, b, s = scaled(names, a, b[:rows] if kind == FIRST_HALF else b[rows:])
            parts = {PART_OF[module.split(".", 2)[-1]]: (*_used_rank(a, b), s)}
        elif kind in (QKV_GROUPED, QKV_STACKED, QKV_ROWS):
            a = get(names, "A")
            if a is None:
                continue
            b = get(names, "B")
            if kind in (QKV_STACKED, QKV_ROWS):
                sizes = qkv_rows(cfg)
                b = fuse_parts(dict(zip(QKV, (x.t() for x in b.split([sizes[p] for p in QKV])))), cfg).t()
            parts = {"qkv": scaled(names, a, permute_rotary(b, cfg))}
        elif kind == QKV_SEPARATE:
            found = {p: (n, get(n, "A"), get(n, "B")) for n, p in zip(names, QKV)}
            found = {p: scaled(n, a, b) for p, (n, a, b) in found.items() if a is not None}
            if not found:
                continue
            total = sum(a.shape[0] for a, _, _ in found.values())
            blocks, at = {}, 0
            for p, (a, b, _) in found.items():
                blocks[p] = torch.zeros(b.shape[0], total).index_copy_(1, torch.arange(at, at + a.shape[0]), b).t()
                at += a.shape[0]
            b_full = permute_rotary(fuse_parts(blocks, cfg).t(), cfg)
            split, at, parts = split_parts(b_full.t(), cfg), 0, {}
            for p, (a, _, s) in found.items():
                parts[p] = (a, split[p].t()[:, at : at + a.shape[0]], s)
                at += a.shape[0]
        else:
            continue
        _wrap(model, module, parts, cfg)
        count += 1
    count += _load_moe(model, config, get, scaled)
    params = dict(model.named_parameters())
    for ours, theirs in hf_head_names(cfg).items():  # a classifier's head, saved whole
        if theirs in stored:
            with torch.no_grad():
                params[ours].copy_(stored[theirs])
            used.add(theirs)
    left = sorted(set(stored) - used)
    if left:
        per_expert = next((k for k in left if re.search(r"\.experts\.\d+\.", k)), None)
        if per_expert is not None:
            raise UserError(f"'{folder}' holds per-expert LoRA tensors ('{per_expert}': transformers 4's layout): "
                            "load it with PEFT on transformers 5 and save it again (PEFT converts it to the stacked "
                            "experts' target_parameters), then point lmforge at that")
        raise UserError(f"'{folder}' holds {len(left)} tensor(s) this {cfg.family} model has no place for, first "
                        f"'{left[0]}': is it an adapter for another model?")
    if not count:
        raise UserError(f"'{folder}' adapts no module of this {cfg.family} model")
    adapted = len({key.split(".lora_A.")[0] for key in used if ".lora_A." in key})  # as PEFT counts them
    log.info("loaded PEFT adapter %s: rank %d on %d modules", folder, int(config["r"]), adapted)
    return count


def _used_rank(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B less the rank's columns where B is zero (one half of a block-diagonal adapter, as lmforge writes
    Phi-3's gate_up_proj): the same update B A at the rank that computes it."""
    used = b.ne(0).any(0)
    return (a[used], b[:, used]) if used.any() else (a, b)


def _load_moe(model: nn.Module, config: dict, get, scaled) -> int:
    """The router and stacked-expert adapters of a mixture of experts (the module docstring's form); how many
    modules were adapted."""
    cfg: ModelConfig = model.config
    count = 0
    for layer in (i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)):
        block = MOE_BLOCK.format(layer)
        a = get(f"{block}.gate", "A")
        if a is not None:
            _wrap(model, f"layers.{layer}.mlp.router", {"router": scaled(f"{block}.gate", a, get(f"{block}.gate",
                                                                                                 "B"))}, cfg)
            count += 1
        targeted = [w for w in EXPERT_WEIGHTS if _targeted_parameter(config, f"{block}.experts.{PEFT_EXPERT[w]}")]
        factors = {}
        for i, w in enumerate(targeted):
            name = f"{block}.experts" + ".base_layer" * (len(targeted) - 1 - i)
            a, b = get(name, "A"), get(name, "B")
            if a is not None:
                factors[w] = (a, b, f"{block}.experts.{PEFT_EXPERT[w]}")
        if factors:
            _wrap_experts(model, f"layers.{layer}.mlp.experts", factors, config)
            count += 1
    return count


def _wrap_experts(model: nn.Module, module: str, factors: dict[str, tuple], config: dict) -> None:
    parent_name, _, attr = module.rpartition(".")
    parent = model.get_submodule(parent_name)
    base = getattr(parent, attr)
    experts = base.gate_up.shape[0]
    ranks, alphas, stacked = {}, {}, {}
    for w, (a, b, key) in factors.items():
        if a.shape[0] % experts or b.shape[1] != a.shape[0]:
            raise UserError(f"the adapter's {key} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}: not a "
                            f"PEFT adapter of {experts} stacked experts (lora_A (rank x {experts}, in))")
        stacked[w] = from_peft(a, b, experts)
        ranks[w] = stacked[w][0].shape[1]
        alphas[w] = _scaling(config, (key,), ranks[w]) * ranks[w]
    wrapped = LoRAExperts(base, ranks, alphas)
    with torch.no_grad():
        for w, (a, b) in stacked.items():
            if a.shape != wrapped.lora_A[w].shape or b.numel() != wrapped.lora_B[w].numel():
                raise UserError(f"the adapter's experts ({PEFT_EXPERT[w]}) have factors {tuple(a.shape)} / "
                                f"{tuple(b.shape)}, the model expects {tuple(wrapped.lora_A[w].shape)} / "
                                f"{tuple(wrapped.lora_B[w].shape)}")
            wrapped.lora_A[w].copy_(a)
            wrapped.lora_B[w].copy_(b.reshape(wrapped.lora_B[w].shape))
    wrapped.to(base.gate_up.device)
    wrapped.train(base.training)
    setattr(parent, attr, wrapped)


def _wrap(model: nn.Module, module: str, parts: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
          cfg: ModelConfig) -> None:
    """Wrap `module` with adapters {part: (A, B, scaling)}: one rank for all parts (their A's rows), one scaling
    (a part scaled otherwise has it folded into its B)."""
    parent_name, _, attr = module.rpartition(".")
    parent = model.get_submodule(parent_name)
    base = getattr(parent, attr)
    ranks = {a.shape[0] for a, _, _ in parts.values()}
    if len(ranks) > 1:
        raise UserError(f"the adapter gives the parts of {module} ({', '.join(parts)}) different ranks "
                        f"{sorted(ranks)}: lmforge's LoRA takes one rank per module")
    rank, scaling = ranks.pop(), next(iter(parts.values()))[2]
    wrapped = LoRALinear(base, list(parts), rank, scaling * rank, 0.0, cfg)
    with torch.no_grad():
        for p, (a, b, s) in parts.items():
            if a.shape != wrapped.lora_A[p].shape or b.shape != wrapped.lora_B[p].shape:
                raise UserError(f"the adapter's {module} ({p}) has shapes {tuple(a.shape)} / {tuple(b.shape)}, the "
                                f"model expects {tuple(wrapped.lora_A[p].shape)} / {tuple(wrapped.lora_B[p].shape)}")
            wrapped.lora_A[p].copy_(a)
            wrapped.lora_B[p].copy_(b * (s / scaling))
    wrapped.to(base.weight.device)
    wrapped.train(base.training)
    setattr(parent, attr, wrapped)
