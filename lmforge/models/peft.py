"""PEFT's LoRA adapter folders, out of and into lmforge's LoRA (lmforge.models.lora).

    FOLDER/adapter_config.json         {"peft_type": "LORA", "r", "lora_alpha", "target_modules", ...}
    FOLDER/adapter_model.safetensors   base_model.model.<HF module>.lora_A.weight (r, in) / .lora_B.weight (out, r)

what `peft.PeftModel.from_pretrained(base, FOLDER)` loads (and vLLM serves). The Hugging Face module names and
their row layout come from the family's adapter table (lmforge.models.hf): A is the same matrix either way; B's rows
are permuted as the weight's are (rotary pairing, q/k/v grouping, GPT-2's stacked c_attn), so B A is exactly the
update of the Hugging Face weight. GPT-2's Conv1D modules take fan_in_fan_out, as PEFT sets it.

A mixture of experts (Mixtral, Qwen3-MoE) is adapted in PEFT's `target_parameters` form, the module paths those of
transformers 5's model as it runs (`model.layers.N.mlp.experts`, `.mlp.gate`), not its checkpoint's (Mixtral's
block_sparse_moe.experts.E.w1):

    mlp.experts.gate_up_proj, mlp.experts.down_proj   the stacked experts (lmforge.models.lora_experts has the
                                                     layout); with both adapted, PEFT nests one ParamWrapper in the
                                                     other in the order the module registers them: gate_up_proj's
                                                     tensors are under `mlp.experts.base_layer.`, down_proj's under
                                                     `mlp.experts.`
    mlp.gate.weight                                  the router
    mlp.gate_proj.weight, ...                        a dense MLP layer's projections (Qwen3-MoE's mlp_only_layers):
                                                     as target_modules PEFT 0.21 would turn their names into the
                                                     experts' (its transformers-4 conversion), so they are named as
                                                     parameters (a 2-D ParamWrapper computes what lora.Linear does)

A weight whose rank is not `r` (gate_up at 2r where gate and up were targeted) gets rank_pattern and alpha_pattern
entries, as PEFT writes them; reading an adapter, both are honoured.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from lmforge.errors import UserError
from lmforge.fsutil import open_safetensors
from lmforge.models.config import ModelConfig
from lmforge.models.hf import adapter_for
from lmforge.models.hf.base import CONV1D, PLAIN, QKV_GROUPED, QKV_SEPARATE, QKV_STACKED, permute_rotary
from lmforge.models.lora import (
    HEADS,
    QKV,
    TARGETS,
    LoRAConfig,
    LoRALinear,
    fuse_parts,
    qkv_rows,
    split_parts,
    split_state,
)
from lmforge.models.lora_experts import WEIGHTS as EXPERT_WEIGHTS
from lmforge.models.lora_experts import LoRAExperts, from_peft, to_peft

log = logging.getLogger(__name__)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_PART_OF = {module: target for target, module in TARGETS.items() if target not in QKV}  # attn.proj -> o ...
# transformers 5 runs every MoE family's layer as `mlp` with `gate` (the router) and `experts` (stacked weights).
MOE_BLOCK = "model.layers.{}.mlp"
PEFT_EXPERT = {"gate_up": "gate_up_proj", "down": "down_proj"}
_MOE_MLP = ("mlp.router", "mlp.experts", "mlp.gate", "mlp.up", "mlp.down")


def _rows(cfg: ModelConfig) -> dict[str, tuple[str | tuple[str, ...], str]]:
    """lmforge module -> (its Hugging Face module name(s), the mapping kind)."""
    out = {}
    for ours, theirs, kind in adapter_for(cfg.family).mapping(cfg):
        if ours.endswith(".weight"):
            names = tuple(t.removesuffix(".weight") for t in theirs) if isinstance(theirs, tuple) \
                else theirs.removesuffix(".weight")
            out[ours.removesuffix(".weight")] = (names, kind)
    return out


def _blocks(adapter: dict, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, slice]]:
    """One module's parts as A (R, in) stacked and B (out rows, R) with each part's rows in its own columns, in
    lmforge's layout (for q/k/v parts: the fused qkv rows): B A is the module's whole update."""
    parts = list(adapter["A"])
    cols, at = {}, 0
    for p in parts:
        r = adapter["A"][p].shape[0]
        cols[p], at = slice(at, at + r), at + r
    a = torch.cat([adapter["A"][p].float() for p in parts])
    if set(parts) <= set(QKV):
        blocks = {}
        for p in parts:
            b = adapter["B"][p].float()
            blocks[p] = torch.zeros(b.shape[0], at).index_copy_(1, torch.arange(cols[p].start, cols[p].stop), b).t()
        return a, fuse_parts(blocks, cfg).t(), cols
    return a, adapter["B"][parts[0]].float(), cols


def peft_tensors(adapters: dict[str, dict], cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], list[str], bool]:
    """lmforge adapters ({module: {"A": {part: A}, "B": {part: B}}}) -> (PEFT's tensors, the Hugging Face modules
    adapted, whether any is a Conv1D)."""
    rows = _rows(cfg)
    tensors, modules, conv1d = {}, [], False
    for module in sorted(adapters, key=_layer_order):
        names, kind = rows[module]
        a, b, cols = _blocks(adapters[module], cfg)
        if kind in (PLAIN, CONV1D):
            out = [(names, a, b)]
            conv1d |= kind == CONV1D
        elif kind in (QKV_GROUPED, QKV_STACKED, QKV_SEPARATE):
            b = permute_rotary(b, cfg, inverse=True)
            if kind == QKV_GROUPED:
                out = [(names, a, b)]
            elif kind == QKV_STACKED:
                out = [(names, a, torch.cat([t.t() for t in split_parts(b.t(), cfg).values()]))]
                conv1d = True
            else:
                split = split_parts(b.t(), cfg)
                out = [(name, a[cols[p]], split[p].t()[:, cols[p]]) for name, p in zip(names, QKV) if p in cols]
        else:
            raise UserError(f"a LoRA adapter on {module} has no PEFT form for weight layout '{kind}' yet")
        for name, a_, b_ in out:
            tensors[f"{PREFIX}{name}.lora_A.weight"] = a_.contiguous()
            tensors[f"{PREFIX}{name}.lora_B.weight"] = b_.contiguous()
            modules.append(name)
    return tensors, modules, conv1d


def _layer_order(module: str) -> tuple:
    parts = module.split(".")
    return tuple(int(p) if p.isdigit() else p for p in parts)


def target_names(modules: list[str], cfg: ModelConfig) -> list[str]:
    """PEFT's target_modules: the short names ("q_proj") where they pick out exactly the adapted modules, else the
    full names (GPT-2's attn.c_proj alone: "c_proj" would also take mlp.c_proj)."""
    every = {n for names, _ in _rows(cfg).values() for n in (names if isinstance(names, tuple) else (names,))}
    short = sorted({m.rsplit(".", 1)[-1] for m in modules})
    if {n for n in every if n.rsplit(".", 1)[-1] in short} == set(modules):
        return short
    return sorted(modules, key=_layer_order)


def _on_moe_mlp(module: str, cfg: ModelConfig) -> bool:
    return bool(cfg.num_experts) and module.split(".", 2)[-1] in _MOE_MLP


def moe_peft_tensors(adapters: dict[str, dict], cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The adapters of a mixture of experts' MLPs (router, stacked experts, dense MLP layers) -> (PEFT's tensors,
    {target parameter: its rank}), in the module docstring's form."""
    rows = _rows(cfg)
    tensors, params = {}, {}

    def put(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        tensors[f"{PREFIX}{name}.lora_A.weight"] = a.contiguous()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = b.contiguous()

    for module in sorted(adapters, key=_layer_order):
        ab, suffix = adapters[module], module.split(".", 2)[-1]
        block = MOE_BLOCK.format(module.split(".")[1])
        if suffix == "mlp.experts":
            weights = [w for w in EXPERT_WEIGHTS if w in ab["A"]]
            for i, w in enumerate(weights):  # the last one wrapped is the outermost ParamWrapper
                put(f"{block}.experts" + ".base_layer" * (len(weights) - 1 - i),
                    *to_peft(ab["A"][w].float(), ab["B"][w].float()))
                params[f"mlp.experts.{PEFT_EXPERT[w]}"] = ab["A"][w].shape[1]
            continue
        (a,), (b,) = ab["A"].values(), ab["B"].values()
        name = f"{block}.gate" if suffix == "mlp.router" else rows[module][0]
        put(name, a.float(), b.float())
        params[".".join(name.split(".")[-2:]) + ".weight"] = a.shape[0]
    return tensors, params


def _head_names(cfg: ModelConfig) -> dict[str, str]:
    """A classification model's head parameters (lmforge.models.lora.HEADS) -> their Hugging Face names."""
    rows = adapter_for(cfg.family).mapping(cfg) if cfg.num_labels else []
    return {ours: theirs for ours, theirs, _ in rows if ours.split(".")[0] in HEADS}


def write_peft_adapter(adapters: dict[str, dict], cfg: ModelConfig, rank: int, alpha: float, dropout: float,
                       out_dir: Path, base_model: str | None = None,
                       heads: dict[str, torch.Tensor] | None = None) -> None:
    """Write PEFT's adapter folder into `out_dir` (an existing, e.g. atomic temporary, folder). `heads`: a
    classifier's trained head (score.weight ...), saved whole as PEFT's SEQ_CLS task saves its modules_to_save."""
    on_moe = {m: ab for m, ab in adapters.items() if _on_moe_mlp(m, cfg)}
    tensors, modules, conv1d = peft_tensors({m: ab for m, ab in adapters.items() if m not in on_moe}, cfg)
    moe_tensors, params = moe_peft_tensors(on_moe, cfg)
    tensors.update(moe_tensors)
    head_names = _head_names(cfg)
    tensors.update({PREFIX + head_names[name]: t.contiguous() for name, t in (heads or {}).items()})
    saved = sorted({head_names[name].rpartition(".")[0] for name in heads or {}}) or None
    other = {name: r for name, r in params.items() if r != rank}  # keeping alpha / r: the scaling trained with
    config = {
        "peft_type": "LORA", "task_type": "SEQ_CLS" if saved else "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": target_names(modules, cfg),
        **({"target_parameters": sorted(params)} if params else {}),
        "bias": "none", "fan_in_fan_out": conv1d, "use_rslora": False, "use_dora": False,
        "modules_to_save": saved, "init_lora_weights": True, "inference_mode": True, "rank_pattern": other,
        "alpha_pattern": {name: alpha * r / rank for name, r in other.items()}, "layers_to_transform": None,
        "layers_pattern": None,
    }
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    (out_dir / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def write_adapter_folder(state: dict[str, torch.Tensor], cfg: ModelConfig, lora: LoRAConfig, out: Path,
                         base_model: str | None, side_files_from: Path | None = None) -> None:
    """The PEFT adapter folder `out`, written atomically, from a LoRA model's whole state dict, with the tokenizer and
    chat template files of `side_files_from` (the merged model's folder) beside it."""
    from lmforge.fsutil import atomic_dir
    from lmforge.models.hf.base import SIDE_FILES
    from lmforge.models.io import copy_licenses, copy_side_files

    base, adapters = split_state(state)
    heads = {name: base[name] for name in _head_names(cfg)}
    with atomic_dir(out, overwrite=True) as tmp:
        write_peft_adapter(adapters, cfg, lora.rank, lora.alpha, lora.dropout, tmp, base_model, heads)
        if side_files_from is not None:
            copy_side_files(side_files_from, tmp, [n for n in SIDE_FILES if n != "generation_config.json"])
            copy_licenses(side_files_from, tmp)  # the base's terms go with a derivative of it
    log.info("wrote PEFT adapter %s", out)


def peft_base(base: str | Path | None) -> str | None:
    """adapter_config.json's base_model_name_or_path for an adapter trained on `base` (the run's model.init_from):
    its absolute path where transformers can load it; for an lmforge model folder written beside a Hugging Face one
    (a run's model/ and hf/, the same weights) that one, so peft.AutoPeftModelForCausalLM finds a base it reads."""
    from lmforge.models.hf import is_hf_dir
    from lmforge.models.io import is_model_dir

    if not base:
        return None
    path = Path(base).resolve()
    if is_hf_dir(path):
        return str(path)
    if is_model_dir(path) and is_hf_dir(path.parent / "hf"):
        return str(path.parent / "hf")
    log.warning("the adapter's base_model_name_or_path, %s, is not a Hugging Face folder: load it with "
                "PeftModel.from_pretrained(base, ADAPTER) over an export of it (lmforge export-hf)", path)
    return str(path)


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
    for key in ("modules_to_save", "layers_to_transform"):
        if config.get(key) and not (key == "modules_to_save" and classifier and set(config[key]) <= set(HEADS)):
            raise UserError(f"'{path}' sets {key}: lmforge's LoRA adapts the same modules in every layer and trains "
                            "no whole module")
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
    for module, (names, kind) in _rows(cfg).items():
        if module.split(".", 2)[-1] in ("mlp.router", "mlp.experts.gate_up", "mlp.experts.down"):
            continue  # a mixture of experts' (below)
        if kind in (PLAIN, CONV1D):
            a = get(names, "A")
            if a is None:
                continue
            part = _PART_OF.get(module.split(".", 2)[-1])
            if part is None:
                raise UserError(f"'{folder}' adapts {names}, which lmforge's LoRA does not wrap (it adapts "
                                "q, k, v, o, gate, up, down, the router and the experts)")
            parts = {part: scaled(names, a, get(names, "B"))}
        elif kind in (QKV_GROUPED, QKV_STACKED):
            a = get(names, "A")
            if a is None:
                continue
            b = get(names, "B")
            if kind == QKV_STACKED:
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
    for ours, theirs in _head_names(cfg).items():  # a classifier's head, saved whole
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
    log.info("loaded PEFT adapter %s: rank %d on %d modules", folder, int(config["r"]), count)
    return count


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
