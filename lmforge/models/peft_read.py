"""PEFT's LoRA adapter folders into lmforge's LoRA: read_peft_config, check_peft_adapter (does it
fit this model), load_peft_adapter (the folder format, the Hugging Face names and row layouts:
lmforge.models.peft, which writes them)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from torch import nn

from lmforge.errors import UserError
from lmforge.fsutil import folder_file, open_safetensors
from lmforge.models.config import ModelConfig
from lmforge.models.hf import hf_modules, is_hf_dir
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
from lmforge.models.io import CONFIG_NAME, is_model_dir
from lmforge.models.lora import HEADS, QKV, LoRALinear, fuse_parts, qkv_rows, split_parts
from lmforge.models.lora_experts import WEIGHTS as EXPERT_WEIGHTS
from lmforge.models.lora_experts import LoRAExperts, from_peft
from lmforge.models.moe import stacked
from lmforge.models.peft import (
    CONFIG,
    MOE_BLOCK,
    PART_OF,
    PEFT_EXPERT,
    PREFIX,
    WEIGHTS,
    hf_head_names,
)

log = logging.getLogger(__name__)

LORA_KEY = re.compile(r"(.+)\.lora_([AB])\.weight")  # PEFT's factors of a module (its name, A or B)
# read by _load_moe, not the walk
_MOE_MODULES = ("mlp.router", "mlp.experts.gate_up", "mlp.experts.down")


def read_peft_config(folder: Path, classifier: bool = False) -> dict:
    """adapter_config.json of a LoRA adapter lmforge can load; `classifier`: into a
    classification model, whose head the adapter may hold whole (modules_to_save: score or
    classifier)."""
    path = folder_file(folder, CONFIG)
    if not path.is_file():
        raise UserError(f"no {CONFIG} in '{folder}': point --lora at a PEFT LoRA adapter folder")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"'{path}' is not valid JSON ({e})") from None
    if config.get("peft_type") != "LORA":
        raise UserError(
            f"'{path}' is a {config.get('peft_type')} adapter: lmforge loads LoRA adapters"
        )
    for key, fine in (("use_dora", False), ("bias", "none")):
        if config.get(key, fine) != fine:
            raise UserError(
                f"'{path}' has {key}={config[key]!r}: lmforge's LoRA supports {key}={fine!r} only"
            )
    saved = config.get("modules_to_save") or []
    if saved and set(saved) <= set(HEADS) and not classifier:
        raise UserError(
            f"'{path}' is a sequence classifier's adapter (it saves its head, {', '.join(saved)}, whole): "
            "it loads into a classifier of its base, not into a language model to generate, serve or "
            "evaluate"
        )
    for key in ("modules_to_save", "layers_to_transform"):
        # a classifier's head
        if config.get(key) and not (key == "modules_to_save" and set(saved) <= set(HEADS)):
            raise UserError(
                f"'{path}' sets {key}: lmforge's LoRA adapts the same modules in every layer and trains "
                "no whole module but a classifier's head"
            )
    return config


def _scaling(config: dict, keys: tuple[str, ...], rank: int) -> float:
    """The scaling PEFT gives the module or parameter named by the first of `keys` that a pattern
    matches (its alpha_pattern), for its (stored) rank."""
    alpha = _patterned(config, "alpha_pattern", keys, config["lora_alpha"])
    return alpha / (rank**0.5 if config.get("use_rslora") else rank)


def _patterned(config: dict, field: str, keys: tuple[str, ...], default):
    """The value PEFT's `field` (alpha_pattern, rank_pattern) gives the first of `keys` that one
    of its patterns matches (as peft.utils.other.get_pattern_key matches them), else `default`."""
    for key in keys:
        found = [
            v for p, v in (config.get(field) or {}).items() if re.match(rf"(.*\.)?({p})$", key)
        ]
        if found:
            return found[0]
    return default


def _targeted_parameter(config: dict, key: str) -> bool:
    """Whether PEFT's target_parameters take the parameter `key` (its rule: the name, or a dotted
    suffix of it)."""
    return any(key == t or key.endswith(f".{t}") for t in config.get("target_parameters") or ())


def check_peft_adapter(
    model: nn.Module, folder: str | Path
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, the tensors by PEFT name less its prefix) of the adapter in
    `folder`, checked against `model` (its shapes alone: a model on the meta device will do):
    each lora_A / lora_B has its pair and a module of the model that lmforge's LoRA wraps, with
    that module's in and out features. An adapter of another model is one line naming the first
    tensor that does not fit and the base the adapter records, before anything is reshaped
    (permute_rotary's reshape was a RuntimeError traceback)."""
    folder = Path(folder)
    cfg: ModelConfig = model.config
    config = read_peft_config(folder, classifier=bool(cfg.num_labels))
    weights = folder_file(folder, WEIGHTS)
    if not weights.is_file():
        raise UserError(f"no {WEIGHTS} in '{folder}'")
    with open_safetensors(weights) as f:
        stored = {
            k.removeprefix(PREFIX).replace(".default.", "."): f.get_tensor(k) for k in f.keys()
        }
    shapes, fix = _layer_shapes(model, config), _right_base(config)
    # a classifier's, saved whole
    heads = {theirs: ours for ours, theirs in hf_head_names(cfg).items()}

    def module(key: str) -> str | None:  # the module of the model a lora_A / lora_B key adapts
        found = LORA_KEY.fullmatch(key)
        return found[1] if found and found[1] in shapes else None

    left = sorted(k for k in stored if k not in heads and module(k) is None)
    if left:
        raise _no_place(folder, cfg, left, fix)
    factors: dict[str, dict[str, str]] = {}
    for key in stored:
        if key in heads:
            want = tuple(model.get_parameter(heads[key]).shape)
            if tuple(stored[key].shape) != want:
                raise UserError(
                    f"'{folder}' does not fit this {cfg.family} model: its {key} has shape "
                    f"{tuple(stored[key].shape)}, the model's head takes {want}: {fix}"
                )
        else:
            factors.setdefault(module(key), {})[LORA_KEY.fullmatch(key)[2]] = key
    for name, pair in factors.items():
        if len(pair) < 2:
            have = next(iter(pair))
            raise UserError(
                f"'{folder}' holds {pair[have]} without its lora_{'B' if have == 'A' else 'A'}: the "
                "adapter file is incomplete: save the adapter again"
            )
        if shapes[name] is None:
            raise UserError(
                f"'{folder}' adapts {name}, which lmforge's LoRA does not wrap (it adapts q, k, v, o, "
                "gate, up, down, the router and the experts)"
            )
        (features_in, features_out, rows), a, b = shapes[name], stored[pair["A"]], stored[pair["B"]]
        # a module's rank is its A's; stacked experts' are known
        rank = rows or (a.shape[0] if a.dim() else 0)
        for key, got, want in (
            (pair["A"], a.shape, (rank, features_in)),
            (pair["B"], b.shape, (features_out, rank)),
        ):
            if tuple(got) != want:
                raise UserError(
                    f"'{folder}' does not fit this {cfg.family} model: its {key} has shape "
                    f"{tuple(got)}, the layer it adapts here takes {want}: {fix}"
                )
    return config, stored


def _layer_shapes(model: nn.Module, config: dict) -> dict[str, tuple[int, int, int | None] | None]:
    """PEFT's name of each module of `model` the adapter (`config`) may adapt -> its (in
    features, out features, rows) in Hugging Face's layout (PEFT's lora_A is (rows, in), lora_B
    (out, rows)): rows None where they are the adapter's rank, whatever it is; for a mixture of
    experts' stacked weights, its rank times the experts (a factor per expert, stacked), so
    another count of experts does not fit by chance. None for a module lmforge's LoRA does not
    wrap."""
    cfg: ModelConfig = model.config
    weights = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    shapes: dict[str, tuple[int, int, int | None] | None] = {}
    for module, (names, kind) in hf_modules(cfg).items():
        short = module.split(".", 2)[-1]
        shape = weights.get(f"{module}.weight")
        if short in _MOE_MODULES or shape is None or len(shape) != 2:
            continue
        out, features_in = shape
        if kind == QKV_SEPARATE:
            rows = qkv_rows(cfg)
            shapes.update({n: (features_in, rows[p], None) for n, p in zip(names, QKV)})
        elif kind in (FIRST_HALF, SECOND_HALF):  # Phi-3's gate_up_proj: gate's rows, then up's
            shapes[names] = (features_in, (shapes.get(names) or (0, 0))[1] + out, None)
        # Conv1D stores (in, out): PEFT's factors are a Linear's all the same
        elif kind in (PLAIN, CONV1D):
            shapes[names] = (features_in, out, None) if short in PART_OF else None
        elif kind in (QKV_GROUPED, QKV_STACKED, QKV_ROWS):
            shapes[names] = (features_in, out, None)
    for layer in (i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)):
        block = MOE_BLOCK.format(layer)
        out, features_in = weights[f"layers.{layer}.mlp.router.weight"]
        shapes[f"{block}.gate"] = (features_in, out, None)
        held = model.get_submodule(f"layers.{layer}.mlp.experts")
        experts, _, inter, hidden = stacked(held.gate_up, held.down)[0].shape
        sizes = {"gate_up": (hidden, 2 * inter), "down": (inter, hidden)}
        targeted = [
            w
            for w in EXPERT_WEIGHTS
            if _targeted_parameter(config, f"{block}.experts.{PEFT_EXPERT[w]}")
        ]
        for i, w in enumerate(targeted):  # as _load_moe names them: the first targeted innermost
            rank = _patterned(
                config, "rank_pattern", (f"{block}.experts.{PEFT_EXPERT[w]}",), config.get("r")
            )
            rows = int(rank) * experts if isinstance(rank, int | float) else None
            shapes[f"{block}.experts" + ".base_layer" * (len(targeted) - 1 - i)] = (*sizes[w], rows)
    return shapes


def _right_base(config: dict) -> str:
    """The fix for an adapter that does not fit the model: the base it says it was trained on."""
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and base:
        return f"load it onto the model it was trained on, {base} (its base_model_name_or_path)"
    return f"load it onto the model it was trained on (its {CONFIG} names none)"


def _no_place(folder: Path, cfg: ModelConfig, left: list[str], fix: str) -> UserError:
    """The error for adapter tensors `left` this model has no place for."""
    per_expert = next((k for k in left if re.search(r"\.experts\.\d+\.", k)), None)
    if per_expert is not None:
        return UserError(
            f"'{folder}' holds per-expert LoRA tensors ('{per_expert}': transformers 4's layout): "
            "load it with PEFT on transformers 5 and save it again (PEFT converts it to the stacked "
            "experts' target_parameters), then point lmforge at that"
        )
    return UserError(
        f"'{folder}' holds {len(left)} tensor(s) this {cfg.family} model has no place for, first "
        f"'{left[0]}': is it an adapter of another model? {fix[0].upper()}{fix[1:]}"
    )


def _warn_other_base(config: dict, folder: Path, base: str | Path | None) -> None:
    """A warning where the adapter records a base folder on this machine other than `base`, the
    one it is loaded onto: shapes fit every model of one architecture and size (a base and its
    fine-tunes alike), but the adapter computes what it was trained to only on its own base's
    weights."""
    recorded = config.get("base_model_name_or_path")
    if base is None or not isinstance(recorded, str) or not recorded or not Path(recorded).exists():
        return  # a Hub id, or a folder not on this machine: nothing to compare
    if Path(recorded).resolve() not in _same_weights(Path(base)):
        log.warning(
            "PEFT adapter %s was trained on %s (its base_model_name_or_path) but is loaded onto %s: the "
            "shapes fit, but unless that folder holds the same weights the adapter computes something else "
            "there: give it its own base, %s",
            folder,
            recorded,
            base,
            recorded,
        )


def _same_weights(base: Path) -> set[Path]:
    """The folders known to hold `base`'s weights: itself, and for an lmforge folder the Hugging
    Face folder it was imported from (lmforge.json's source) and the hf/ beside it (a run's
    export, which lmforge.models.peft.peft_base records as a run's adapter's base)."""
    base = base.resolve()
    same = {base}
    if is_model_dir(base):
        if is_hf_dir(base.parent / "hf"):
            same.add((base.parent / "hf").resolve())
        try:
            source = json.loads((base / CONFIG_NAME).read_text()).get("source")
        except (OSError, ValueError, AttributeError):
            source = None
        if isinstance(source, dict) and isinstance(source.get("hf_dir"), str):
            same.add(Path(source["hf_dir"]).resolve())
    return same


def load_peft_adapter(model: nn.Module, folder: str | Path, base: str | Path | None = None) -> int:
    """Wrap `model` (an lmforge decoder, not yet adapted) with the PEFT adapter in `folder`:
    afterwards the model computes what PeftModel.from_pretrained(base, folder) does. Returns the
    number of adapted modules. `base`: the folder `model` was read from (default: the one
    lmforge.models.source.load_pretrained noted on it), for a warning where the adapter records
    another base. An adapter of another model (check_peft_adapter) is one UserError before the
    model is touched."""
    folder = Path(folder)
    cfg: ModelConfig = model.config
    config, stored = check_peft_adapter(model, folder)
    _warn_other_base(
        config, folder, base if base is not None else getattr(model, "source_folder", None)
    )
    used: set[str] = set()

    def get(name: str, which: str) -> torch.Tensor | None:
        key = f"{name}.lora_{which}.weight"
        if key in stored:
            used.add(key)
            return stored[key].float()
        return None

    def scaled(
        name: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        return a, b, _scaling(config, (name, f"{name}.weight"), a.shape[0])

    count = 0
    for module, (names, kind) in hf_modules(cfg).items():
        if module.split(".", 2)[-1] in _MOE_MODULES:
            continue  # a mixture of experts' (below)
        if kind in (PLAIN, CONV1D):
            a = get(names, "A")
            if a is None:
                continue
            # checked: one it wraps
            parts = {PART_OF[module.split(".", 2)[-1]]: scaled(names, a, get(names, "B"))}
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
                b = fuse_parts(
                    dict(zip(QKV, (x.t() for x in b.split([sizes[p] for p in QKV])))), cfg
                ).t()
            parts = {"qkv": scaled(names, a, permute_rotary(b, cfg))}
        elif kind == QKV_SEPARATE:
            found = {p: (n, get(n, "A"), get(n, "B")) for n, p in zip(names, QKV)}
            found = {p: scaled(n, a, b) for p, (n, a, b) in found.items() if a is not None}
            if not found:
                continue
            total = sum(a.shape[0] for a, _, _ in found.values())
            blocks, at = {}, 0
            for p, (a, b, _) in found.items():
                blocks[p] = (
                    torch.zeros(b.shape[0], total)
                    .index_copy_(1, torch.arange(at, at + a.shape[0]), b)
                    .t()
                )
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
        raise _no_place(folder, cfg, left, _right_base(config))
    if not count:
        raise UserError(f"'{folder}' adapts no module of this {cfg.family} model")
    # as PEFT counts them
    adapted = len({key.split(".lora_A.")[0] for key in used if ".lora_A." in key})
    log.info("loaded PEFT adapter %s: rank %d on %d modules", folder, int(config["r"]), adapted)
    return count


def _used_rank(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B less the rank's columns where B is zero (one half of a block-diagonal adapter, as
    lmforge writes Phi-3's gate_up_proj): the same update B A at the rank that computes it."""
    used = b.ne(0).any(0)
    return (a[used], b[:, used]) if used.any() else (a, b)


def _load_moe(model: nn.Module, config: dict, get, scaled) -> int:
    """The router and stacked-expert adapters of a mixture of experts (the module docstring's
    form); how many modules were adapted."""
    cfg: ModelConfig = model.config
    count = 0
    for layer in (i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)):
        block = MOE_BLOCK.format(layer)
        a = get(f"{block}.gate", "A")
        if a is not None:
            _wrap(
                model,
                f"layers.{layer}.mlp.router",
                {"router": scaled(f"{block}.gate", a, get(f"{block}.gate", "B"))},
                cfg,
            )
            count += 1
        targeted = [
            w
            for w in EXPERT_WEIGHTS
            if _targeted_parameter(config, f"{block}.experts.{PEFT_EXPERT[w]}")
        ]
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
            raise UserError(
                f"the adapter's {key} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}: not a "
                f"PEFT adapter of {experts} stacked experts (lora_A (rank x {experts}, in))"
            )
        stacked[w] = from_peft(a, b, experts)
        ranks[w] = stacked[w][0].shape[1]
        alphas[w] = _scaling(config, (key,), ranks[w]) * ranks[w]
    wrapped = LoRAExperts(base, ranks, alphas)
    with torch.no_grad():
        for w, (a, b) in stacked.items():
            if a.shape != wrapped.lora_A[w].shape or b.numel() != wrapped.lora_B[w].numel():
                raise UserError(
                    f"the adapter's experts ({PEFT_EXPERT[w]}) have factors {tuple(a.shape)} / "
                    f"{tuple(b.shape)}, the model expects {tuple(wrapped.lora_A[w].shape)} / "
                    f"{tuple(wrapped.lora_B[w].shape)}"
                )
            wrapped.lora_A[w].copy_(a)
            wrapped.lora_B[w].copy_(b.reshape(wrapped.lora_B[w].shape))
    wrapped.to(base.gate_up.device)
    wrapped.train(base.training)
    setattr(parent, attr, wrapped)


def _wrap(
    model: nn.Module,
    module: str,
    parts: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
    cfg: ModelConfig,
) -> None:
    """Wrap `module` with adapters {part: (A, B, scaling)}: one rank for all parts (their A's
    rows), one scaling (a part scaled otherwise has it folded into its B)."""
    parent_name, _, attr = module.rpartition(".")
    parent = model.get_submodule(parent_name)
    base = getattr(parent, attr)
    ranks = {a.shape[0] for a, _, _ in parts.values()}
    if len(ranks) > 1:
        raise UserError(
            f"the adapter gives the parts of {module} ({', '.join(parts)}) different ranks "
            f"{sorted(ranks)}: lmforge's LoRA takes one rank per module"
        )
    rank, scaling = ranks.pop(), next(iter(parts.values()))[2]
    wrapped = LoRALinear(base, list(parts), rank, scaling * rank, 0.0, cfg)
    with torch.no_grad():
        for p, (a, b, s) in parts.items():
            if a.shape != wrapped.lora_A[p].shape or b.shape != wrapped.lora_B[p].shape:
                raise UserError(
                    f"the adapter's {module} ({p}) has shapes {tuple(a.shape)} / {tuple(b.shape)}, the "
                    f"model expects {tuple(wrapped.lora_A[p].shape)} / {tuple(wrapped.lora_B[p].shape)}"
                )
            wrapped.lora_A[p].copy_(a)
            wrapped.lora_B[p].copy_(b * (s / scaling))
    wrapped.to(base.weight.device)
    wrapped.train(base.training)
    setattr(parent, attr, wrapped)
