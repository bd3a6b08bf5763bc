"""PEFT's LoRA adapter folders out of lmforge's LoRA (lmforge.models.lora); reading them: lmforge.models.peft_read.

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

Phi-3 fuses gate and up into one gate_up_proj (and q, k, v into qkv_proj, rows in that order), where lmforge adapts
gate and up apart: both adapted, its adapter stacks their A's (rank 2r) over a block-diagonal B, exactly their two
updates; read back, each half keeps the rank columns its rows use (r again). A weight whose rank is not `r` (that
gate_up_proj, the experts' gate_up at 2r where gate and up were targeted) gets rank_pattern and alpha_pattern
entries, as PEFT writes them; reading an adapter, both are honoured.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.hf import adapter_for, hf_modules
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
from lmforge.models.lora import HEADS, QKV, TARGETS, LoRAConfig, fuse_parts, split_parts
from lmforge.models.lora_experts import WEIGHTS as EXPERT_WEIGHTS
from lmforge.models.lora_experts import to_peft
from lmforge.models.lora_state import split_state

log = logging.getLogger(__name__)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# attn.proj -> o ...
PART_OF = {module: target for target, module in TARGETS.items() if target not in QKV}
# transformers 5 runs every MoE family's layer as `mlp` with `gate` (the router) and `experts`
# (stacked weights).
MOE_BLOCK = "model.layers.{}.mlp"
PEFT_EXPERT = {"gate_up": "gate_up_proj", "down": "down_proj"}
_MOE_MLP = ("mlp.router", "mlp.experts", "mlp.gate", "mlp.up", "mlp.down")


def _blocks(adapter: dict, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, slice]]:
    """One module's parts as A (R, in) stacked and B (out rows, R) with each part's rows in its
    own columns, in lmforge's layout (for q/k/v parts: the fused qkv rows): B A is the module's
    whole update."""
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
            blocks[p] = (
                torch.zeros(b.shape[0], at)
                .index_copy_(1, torch.arange(cols[p].start, cols[p].stop), b)
                .t()
            )
        return a, fuse_parts(blocks, cfg).t(), cols
    return a, adapter["B"][parts[0]].float(), cols


def peft_tensors(
    adapters: dict[str, dict],
    cfg: ModelConfig,
) -> tuple[dict[str, torch.Tensor], list[str], bool, dict[str, int]]:
    """lmforge adapters ({module: {"A": {part: A}, "B": {part: B}}}) -> (PEFT's tensors, the
    Hugging Face modules adapted, whether any is a Conv1D, {Hugging Face module: its rank}: A's
    rows)."""
    rows = hf_modules(cfg)
    tensors, modules, conv1d = {}, [], False
    # Phi-3's gate_up_proj: gate's, up's
    halves: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module in sorted(adapters, key=_layer_order):
        names, kind = rows[module]
        a, b, cols = _blocks(adapters[module], cfg)
        if kind in (PLAIN, CONV1D):
            out = [(names, a, b)]
            conv1d |= kind == CONV1D
        elif kind in (FIRST_HALF, SECOND_HALF):
            halves.setdefault(names, {})[kind] = (a, b)
            continue
        elif kind in (QKV_GROUPED, QKV_STACKED, QKV_ROWS, QKV_SEPARATE):
            b = permute_rotary(b, cfg, inverse=True)
            if kind == QKV_GROUPED:
                out = [(names, a, b)]
            elif kind in (QKV_STACKED, QKV_ROWS):  # one tensor, q's rows then k's then v's
                out = [(names, a, torch.cat([t.t() for t in split_parts(b.t(), cfg).values()]))]
                conv1d |= kind == QKV_STACKED
            else:
                split = split_parts(b.t(), cfg)
                out = [
                    (name, a[cols[p]], split[p].t()[:, cols[p]])
                    for name, p in zip(names, QKV)
                    if p in cols
                ]
        else:
            raise UserError(
                f"a LoRA adapter on {module} has no PEFT form for weight layout '{kind}' yet"
            )
        for name, a_, b_ in out:
            tensors[f"{PREFIX}{name}.lora_A.weight"] = a_.contiguous()
            tensors[f"{PREFIX}{name}.lora_B.weight"] = b_.contiguous()
            modules.append(name)
    for name, (a, b) in ((name, _stacked_halves(found, cfg)) for name, found in halves.items()):
        tensors[f"{PREFIX}{name}.lora_A.weight"] = a.contiguous()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = b.contiguous()
        modules.append(name)
    modules.sort(key=_layer_order)
    ranks = {name: tensors[f"{PREFIX}{name}.lora_A.weight"].shape[0] for name in modules}
    return tensors, modules, conv1d, ranks


def _stacked_halves(
    found: dict[str, tuple[torch.Tensor, torch.Tensor]],
    cfg: ModelConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter on a Hugging Face tensor holding two lmforge weights' rows (Phi-3's
    gate_up_proj: gate's, then up's) from the adapters of either or both: with both, A stacks
    theirs (rank r + r) and B is block-diagonal, so B A is gate's update over up's, exactly; a
    half without an adapter gets zero rows of B."""
    rows = cfg.intermediate_size
    a = torch.cat([found[k][0] for k in (FIRST_HALF, SECOND_HALF) if k in found])
    b = a.new_zeros(2 * rows, a.shape[0])
    col = 0
    for i, kind in enumerate((FIRST_HALF, SECOND_HALF)):
        if kind in found:
            part = found[kind][1]
            b[i * rows : (i + 1) * rows, col : col + part.shape[1]] = part
            col += part.shape[1]
    return a, b


def _layer_order(module: str) -> tuple:
    parts = module.split(".")
    return tuple(int(p) if p.isdigit() else p for p in parts)


def target_names(modules: list[str], cfg: ModelConfig) -> list[str]:
    """PEFT's target_modules: the short names ("q_proj") where they pick out exactly the adapted
    modules, else the full names (GPT-2's attn.c_proj alone: "c_proj" would also take
    mlp.c_proj)."""
    every = {
        n
        for names, _ in hf_modules(cfg).values()
        for n in (names if isinstance(names, tuple) else (names,))
    }
    short = sorted({m.rsplit(".", 1)[-1] for m in modules})
    if {n for n in every if n.rsplit(".", 1)[-1] in short} == set(modules):
        return short
    return sorted(modules, key=_layer_order)


def _on_moe_mlp(module: str, cfg: ModelConfig) -> bool:
    return bool(cfg.num_experts) and module.split(".", 2)[-1] in _MOE_MLP


def moe_peft_tensors(
    adapters: dict[str, dict], cfg: ModelConfig
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The adapters of a mixture of experts' MLPs (router, stacked experts, dense MLP layers) ->
    (PEFT's tensors, {target parameter: its rank}), in the module docstring's form."""
    rows = hf_modules(cfg)
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
                put(
                    f"{block}.experts" + ".base_layer" * (len(weights) - 1 - i),
                    *to_peft(ab["A"][w].float(), ab["B"][w].float()),
                )
                params[f"mlp.experts.{PEFT_EXPERT[w]}"] = ab["A"][w].shape[1]
            continue
        (a,), (b,) = ab["A"].values(), ab["B"].values()
        name = f"{block}.gate" if suffix == "mlp.router" else rows[module][0]
        put(name, a.float(), b.float())
        params[".".join(name.split(".")[-2:]) + ".weight"] = a.shape[0]
    return tensors, params


def hf_head_names(cfg: ModelConfig) -> dict[str, str]:
    """A classification model's head parameters (lmforge.models.lora.HEADS) -> their Hugging Face
    names."""
    rows = adapter_for(cfg.family).mapping(cfg) if cfg.num_labels else []
    return {ours: theirs for ours, theirs, _ in rows if ours.split(".")[0] in HEADS}


def write_peft_adapter(
    adapters: dict[str, dict],
    cfg: ModelConfig,
    rank: int,
    alpha: float,
    dropout: float,
    out_dir: Path,
    base_model: str | None = None,
    heads: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write PEFT's adapter folder into `out_dir` (an existing, e.g. atomic temporary, folder).
    `heads`: a classifier's trained head (score.weight ...), saved whole as PEFT's SEQ_CLS task
    saves its modules_to_save."""
    on_moe = {m: ab for m, ab in adapters.items() if _on_moe_mlp(m, cfg)}
    tensors, modules, conv1d, ranks = peft_tensors(
        {m: ab for m, ab in adapters.items() if m not in on_moe}, cfg
    )
    moe_tensors, params = moe_peft_tensors(on_moe, cfg)
    tensors.update(moe_tensors)
    head_names = hf_head_names(cfg)
    tensors.update({PREFIX + head_names[name]: t.contiguous() for name, t in (heads or {}).items()})
    saved = sorted({head_names[name].rpartition(".")[0] for name in heads or {}}) or None
    # keeping alpha / r: the scaling trained with
    other = {name: r for name, r in {**ranks, **params}.items() if r != rank}
    config = {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if saved else "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": target_names(modules, cfg),
        **({"target_parameters": sorted(params)} if params else {}),
        "bias": "none",
        "fan_in_fan_out": conv1d,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": saved,
        "init_lora_weights": True,
        "inference_mode": True,
        "rank_pattern": other,
        "alpha_pattern": {name: alpha * r / rank for name, r in other.items()},
        "layers_to_transform": None,
        "layers_pattern": None,
    }
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    (out_dir / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def write_adapter_folder(
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    lora: LoRAConfig,
    out: Path,
    base_model: str | None,
    side_files_from: Path | None = None,
) -> None:
    """The PEFT adapter folder `out`, written atomically, from a LoRA model's whole state dict,
    with the tokenizer and chat template files of `side_files_from` (the merged model's folder)
    beside it."""
    from lmforge.fsutil import atomic_dir
    from lmforge.models.hf.base import SIDE_FILES
    from lmforge.models.io import copy_licenses, copy_side_files

    base, adapters = split_state(state)
    heads = {name: base[name] for name in hf_head_names(cfg)}
    with atomic_dir(out, overwrite=True) as tmp:
        write_peft_adapter(
            adapters, cfg, lora.rank, lora.alpha, lora.dropout, tmp, base_model, heads
        )
        if side_files_from is not None:
            copy_side_files(
                side_files_from, tmp, [n for n in SIDE_FILES if n != "generation_config.json"]
            )
            copy_licenses(side_files_from, tmp)  # the base's terms go with a derivative of it
    log.info("wrote PEFT adapter %s", out)


def peft_base(base: str | Path | None) -> str | None:
    """adapter_config.json's base_model_name_or_path for an adapter trained on `base` (the run's
    model.init_from): its absolute path where transformers can load it; for an lmforge model
    folder written beside a Hugging Face one (a run's model/ and hf/, the same weights) that one,
    so peft.AutoPeftModelForCausalLM finds a base it reads."""
    from lmforge.models.hf import is_hf_dir
    from lmforge.models.io import is_model_dir

    if not base:
        return None
    path = Path(base).resolve()
    if is_hf_dir(path):
        return str(path)
    if is_model_dir(path) and is_hf_dir(path.parent / "hf"):
        return str(path.parent / "hf")
    log.warning(
        "the adapter's base_model_name_or_path, %s, is not a Hugging Face folder: load it with "
        "PeftModel.from_pretrained(base, ADAPTER) over an export of it (lmforge export-hf)",
        path,
    )
    return str(path)
