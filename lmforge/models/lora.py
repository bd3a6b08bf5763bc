"""LoRA (Hu et al. 2021): low-rank adapters wrapped around a built model's linear layers, the base weights frozen.

    y = x W^T + b + (alpha / rank) * dropout(x) A^T B^T        A: (rank, in), Kaiming-uniform; B: (out, rank), zeros

so at initialisation the model computes exactly what the base computes (PEFT's default init). The model is not
edited: `apply_lora` swaps each targeted nn.Linear for a LoRALinear holding the same weight and bias tensors (so the
base keeps its parameter names, checkpoints and Hugging Face mapping) plus `lora_A.<part>` and `lora_B.<part>`.

Targets, by their usual short names (`LoRAConfig.targets`; "all-linear" for all of them; "default" for PEFT's
default: q and v, or the fused qkv where Hugging Face fuses it):

    q, k, v        the query, key and value rows of the fused `attn.qkv` projection
    o              attn.proj
    gate, up, down the MLP's projections (gate only in gated MLPs); on a mixture of experts, the experts' too
    router         a mixture of experts' router (mlp.router)
    experts        a mixture of experts' stacked expert weights, both (lmforge.models.lora_experts);
                   experts.gate_up or experts.down for one

Where Hugging Face keeps q, k and v as three projections (Llama, GPT-J, BERT) each gets its own adapter, as PEFT
gives q_proj, k_proj and v_proj; where it fuses them (GPT-NeoX's query_key_value, GPT-2's c_attn) one adapter
covers the fused projection, as PEFT's would, so q, k and v must then be targeted together. Either way an adapter
converts exactly to PEFT's format (lmforge.models.peft). A part's B rows are in lmforge's row layout of its rows of
qkv ([kv_heads, q_per_kv + 2, head_dim] groups, rotary pairs permuted), a row permutation of Hugging Face's.

A mixture of experts (Mixtral, Qwen3-MoE) is adapted as PEFT 0.21 adapts transformers 5's, whose experts are
stacked parameters (`mlp.experts.gate_up_proj`, `down_proj`) and whose router is no nn.Linear: PEFT's all-linear
there adapts the attention, the router and the experts (as target_parameters), and it turns gate_proj/up_proj/
down_proj (Mixtral's w1/w3/w2) into the experts' stacked weights, gate and up together at twice the rank. lmforge
does the same for the same names, never only some of the MLPs: `experts` (or experts.gate_up / experts.down) at
lora.rank; `gate,up,down` and all-linear on the experts with gate_up at rank 2r and alpha 2a (the scaling
unchanged: what two rank-r adapters on a dense MLP's gate and up hold), and also on any dense MLP layer
(Qwen3-MoE's mlp_only_layers, which PEFT's conversion leaves out; its export names them so PEFT loads them); gate or
up alone is refused (one stacked weight), as PEFT refuses it. The router is in all-linear, as in PEFT's. PEFT
refuses dropout on target_parameters, so lora.dropout > 0 with the experts or the router is refused too.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.hf import hf_module_count
from lmforge.models.lora_experts import EXPERT_TARGETS, MLP_ON_EXPERTS, LoRAExperts, expert_ranks
from lmforge.models.moe import Experts, stacked
from lmforge.models.nf4 import dense, is_nf4, nf4_linear, quantize_nf4

log = logging.getLogger(__name__)

# Short target name -> the linear module (relative to a block) it adapts.
TARGETS = {
    "q": "attn.qkv",
    "k": "attn.qkv",
    "v": "attn.qkv",
    "o": "attn.proj",
    "gate": "mlp.gate",
    "up": "mlp.up",
    "down": "mlp.down",
    "router": "mlp.router",
}
QKV = ("q", "k", "v")
# Hugging Face module names (what PEFT's target_modules holds) -> lmforge's: a PEFT recipe's list
# works as written. GPT-2's c_proj names both the attention's and the MLP's output projection, and
# PEFT's match takes both.
HF_TARGETS = {
    "q_proj": ("q",),
    "k_proj": ("k",),
    "v_proj": ("v",),
    "o_proj": ("o",),
    "gate_proj": ("gate",),
    "up_proj": ("up",),
    "down_proj": ("down",),
    "query_key_value": QKV,
    "dense": ("o",),
    "dense_h_to_4h": ("up",),
    "dense_4h_to_h": ("down",),
    "c_attn": QKV,
    "c_fc": ("up",),
    "c_proj": ("o", "down"),
    "qkv_proj": QKV,
    "gate_up_proj": ("gate", "up"),
    "out_proj": ("o",),
    # Mixtral
    "fc_in": ("up",),
    "fc_out": ("down",),
    "w1": ("gate",),
    "w3": ("up",),
    "w2": ("down",),
}
BASE_DTYPES = ("fp32", "bf16", "nf4")


@dataclass
class LoRAConfig:
    """The `lora:` section of a run: its presence turns LoRA on."""

    rank: int = 8  # r: each adapter is B (out x r) times A (r x in)
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input
    # Short names ("q,v", a list), "all-linear", or "default": PEFT's default for the family, q and
    # v (the fused qkv projection where Hugging Face has one).
    targets: list[str] | str = "default"
    bf16_base: bool = False  # hold the frozen base in bf16 (adapters stay fp32), under FSDP2 too
    # The frozen base's dtype: fp32 (the run's), bf16 (as bf16_base=true), or nf4: QLoRA, the
    # blocks' linears in torchao's 4-bit NormalFloat, the rest bf16 (torchao; CUDA GPU or CPU).
    base_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise UserError(f"lora.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise UserError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        names = self.targets.split(",") if isinstance(self.targets, str) else list(self.targets)
        names = [n.strip() for n in names if n.strip()]
        self._given = {short: n for n in reversed(names) for short in HF_TARGETS.get(n, ())}
        if self._given:
            given = ",".join(names)
            names = [short for n in names for short in HF_TARGETS.get(n, (n,))]
            log.info(
                "lora.targets %s: Hugging Face module names, read as %s",
                given,
                ",".join(dict.fromkeys(names)),
            )
        unknown = [
            n
            for n in names
            if n not in TARGETS
            and n not in EXPERT_TARGETS
            and names not in (["all-linear"], ["default"])
        ]
        if unknown or not names:
            raise UserError(
                f"lora.targets: unknown target {unknown[0] if unknown else '(none)'!r}: choose from "
                f"{', '.join([*TARGETS, *EXPERT_TARGETS])} (comma-separated; or PEFT's Hugging Face "
                "names, q_proj ...), all-linear or default"
            )
        self.targets = list(dict.fromkeys(names))
        if self.base_dtype not in BASE_DTYPES:
            raise UserError(
                f"lora.base_dtype must be one of {', '.join(BASE_DTYPES)}, got {self.base_dtype!r}"
            )
        if self.bf16_base and self.base_dtype == "fp32":
            self.base_dtype = "bf16"
        self.bf16_base = self.base_dtype != "fp32"  # nf4 keeps what it does not quantize in bf16

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def as_given(self, names: list[str]) -> str:
        """Short target names as the user wrote them, for errors: "q_proj,v_proj (read as q,v)"
        for PEFT's names (`_given`: a short name -> the Hugging Face name it was read from)."""
        given = ",".join(dict.fromkeys(self._given.get(n, n) for n in names))
        return given if given == ",".join(names) else f"{given} (read as {','.join(names)})"


def hf_fused_qkv(cfg: ModelConfig) -> str | None:
    """Hugging Face's name for this family's one q, k and v projection (query_key_value, c_attn:
    then one adapter covers all three), or None where it keeps three."""
    from lmforge.models.hf import ADAPTERS
    from lmforge.models.hf.base import QKV_SEPARATE

    adapter = ADAPTERS.get(cfg.family)
    if adapter is None:
        return None
    theirs, kind = next(
        ((t, k) for ours, t, k in adapter.mapping(cfg) if ours == "layers.0.attn.qkv.weight"),
        (None, QKV_SEPARATE),
    )
    return None if kind == QKV_SEPARATE else theirs.split(".")[-2]


def qkv_rows(cfg: ModelConfig) -> dict[str, int]:
    kv = cfg.num_kv_heads * cfg.head_dim
    return {"q": cfg.num_heads * cfg.head_dim, "k": kv, "v": kv}


def fuse_parts(parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """q/k/v tensors (..., rows of that part) -> (..., fused qkv rows) in lmforge's grouped
    layout; a part that is absent is zeros. The inverse of split_parts."""
    kv, d = cfg.num_kv_heads, cfg.head_dim
    some = next(iter(parts.values()))
    lead = some.shape[:-1]
    groups = []
    for name, per_group in (("q", cfg.num_heads // kv), ("k", 1), ("v", 1)):
        t = parts.get(name)
        if t is None:
            t = some.new_zeros(*lead, kv * per_group * d)
        groups.append(t.reshape(*lead, kv, per_group, d))
    return torch.cat(groups, dim=-2).reshape(*lead, -1)


def split_parts(t: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """(..., fused qkv rows) -> q, k, v (..., rows of each) in lmforge's grouped layout."""
    kv, d = cfg.num_kv_heads, cfg.head_dim
    g = t.reshape(*t.shape[:-1], kv, -1, d)
    return {
        "q": g[..., :-2, :].flatten(-3),
        "k": g[..., -2, :].flatten(-2),
        "v": g[..., -1, :].flatten(-2),
    }


class LoRALinear(nn.Linear):
    """An nn.Linear (the same weight and bias tensors as the one it replaces) plus low-rank
    adapters, one per part: "q", "k", "v" (rows of a fused qkv, `model_config` gives the layout),
    or one part covering every row."""

    def __init__(
        self,
        base: nn.Linear,
        parts: list[str],
        rank: int,
        alpha: float,
        dropout: float,
        model_config: ModelConfig | None = None,
        generator: torch.Generator | None = None,
    ):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.scaling, self.model_config = rank, alpha / rank, model_config
        self.split = set(parts) <= set(QKV)  # parts are rows of the fused qkv
        if self.split and model_config is None:
            raise ValueError("q/k/v parts need the model config for the qkv layout")
        rows = qkv_rows(model_config) if self.split else {parts[0]: self.out_features}
        # Drawn on the CPU (a CPU generator makes them the same on every device and rank); the
        # caller moves them.
        device = "meta" if base.weight.is_meta else "cpu"
        self.lora_A = nn.ParameterDict(
            {p: nn.Parameter(torch.empty(rank, self.in_features, device=device)) for p in parts}
        )
        self.lora_B = nn.ParameterDict(
            {p: nn.Parameter(torch.zeros(rows[p], rank, device=device)) for p in parts}
        )
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.adapters_enabled = True
        if device != "meta":
            for a in self.lora_A.values():
                _draw_a(a, generator)

    def b_matrix(self) -> torch.Tensor:
        """Every part's B as one (out, R) matrix over the stacked parts' ranks: each part's rows
        (its rows of the fused qkv) in its own columns, zeros elsewhere; B_matrix @ stacked A is
        the module's whole update."""
        if not self.split:
            return next(iter(self.lora_B.values()))
        width = sum(b.shape[1] for b in self.lora_B.values())
        blocks, at = {}, 0
        for p, b in self.lora_B.items():  # (R, rows of p): the part's columns of B, transposed
            blocks[p] = F.pad(b, (at, width - at - b.shape[1])).t()
            at += b.shape[1]
        return fuse_parts(blocks, self.model_config).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # QLoRA's NF4 base: dequantized a chunk at a time (torchao's own dequantization holds ~14
        # bytes a weight).
        y = (nf4_linear if is_nf4(self.weight) else F.linear)(x, self.weight, self.bias)
        if not self.adapters_enabled:
            return y
        # Scale the rank-sized activations, not the output, and add B's product into y in one GEMM
        # (addmm's beta = 1): no extra output-sized temporaries.
        a_all = list(self.lora_A.values())
        # Autocast runs the product in its own dtype: a bf16 x cast to the fp32 adapters' would be
        # cast straight back (two activation-sized copies forward, two backward, the same bits).
        dtype = x.dtype if torch.is_autocast_enabled(x.device.type) else a_all[0].dtype
        if len(a_all) == 1 or not (self.training and isinstance(self.lora_dropout, nn.Dropout)):
            h = F.linear(
                self.lora_dropout(x).to(dtype), torch.cat(a_all) if len(a_all) > 1 else a_all[0]
            )
        else:  # each part its own dropout mask, as PEFT's separate q/k/v modules draw
            h = torch.cat([F.linear(self.lora_dropout(x).to(dtype), a) for a in a_all], -1)
        h = (h * self.scaling).reshape(-1, h.shape[-1])
        b = self.b_matrix()
        out = torch.addmm(y.reshape(-1, y.shape[-1]), h.to(y.dtype), b.t().to(y.dtype))
        return out.view(y.shape)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B A (out, in) in fp32: what merging adds to the weight."""
        parts = {p: self.lora_B[p].float() @ a.float() for p, a in self.lora_A.items()}
        w = (
            fuse_parts({p: t.t() for p, t in parts.items()}, self.model_config).t()
            if self.split
            else next(iter(parts.values()))
        )
        return w * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_rank={self.rank}, parts={list(self.lora_A)}"


def target_modules(
    model: nn.Module, lora: LoRAConfig
) -> tuple[dict[str, list[str]], dict[str, dict[str, int]]]:
    """(linear module -> the adapter parts to add there, experts module -> {stacked weight:
    rank}); a UserError naming the targets that match nothing or cannot be adapted as asked."""
    cfg: ModelConfig = model.config
    modules = dict(model.named_modules())
    experts = [name for name, m in modules.items() if isinstance(m, Experts)]
    fused = hf_fused_qkv(cfg)
    targets = lora.targets
    # on a mixture of experts: the router and the experts too, as PEFT's all-linear
    if targets == ["all-linear"]:
        targets = [
            t for t in TARGETS if _has(modules, TARGETS[t]) or (experts and t in MLP_ON_EXPERTS)
        ]
    elif targets == ["default"]:
        targets = list(QKV) if fused else ["q", "v"]
    wanted_qkv = [t for t in QKV if t in targets]
    if fused and wanted_qkv and len(wanted_qkv) < 3:
        raise UserError(
            f"lora.targets: {cfg.family} keeps q, k and v in one projection (as Hugging Face does: "
            f"{fused}), so one adapter covers all three: target q,k,v together (or {fused}), not "
            f"{lora.as_given(wanted_qkv)}"
        )
    ranks = expert_ranks(targets, lora.rank, cfg.family, bool(experts), lora.as_given)
    out: dict[str, list[str]] = {}
    matched = {t for t in targets if t in EXPERT_TARGETS or (experts and t in MLP_ON_EXPERTS)}
    for name, module in modules.items():
        if not isinstance(module, nn.Linear) or ".layers." not in f".{name}":
            continue
        suffix = name.split(".", 2)[-1]  # layers.N.<suffix>
        for target in targets:
            if TARGETS.get(target) != suffix:
                continue
            matched.add(target)
            part = "qkv" if fused and target in QKV else target
            if part not in out.setdefault(name, []):
                out[name].append(part)
    missing = [t for t in targets if t not in matched]
    if missing:
        raise UserError(
            f"lora.targets: {lora.as_given(missing)} {'matches' if len(missing) == 1 else 'match'} no "
            f"module of this {cfg.family} model (it has "
            f"{', '.join(t for t in TARGETS if t in matched or _has(modules, TARGETS[t]))}): drop "
            f"{'it' if len(missing) == 1 else 'them'}"
        )
    on_params = sorted({*(f"experts.{w}" for w in ranks), *(t for t in targets if t == "router")})
    if lora.dropout and on_params:
        raise UserError(
            f"lora.dropout={lora.dropout} with adapters on {', '.join(on_params)}: PEFT adapts "
            "those as target_parameters, which take no dropout (its ParamWrapper refuses lora_dropout "
            "!= 0): set lora.dropout=0, or target the attention (q,k,v,o) only"
        )
    return out, {name: dict(ranks) for name in experts} if ranks else {}


def _has(modules: dict[str, nn.Module], suffix: str) -> bool:
    return any(
        isinstance(m, nn.Linear) and n.endswith(f".{suffix}") and ".layers." in f".{n}"
        for n, m in modules.items()
    )


def _draw_a(a: torch.Tensor, generator: torch.Generator | None) -> None:
    """nn.Linear's (and PEFT's) init of an A matrix: kaiming_uniform_(a=sqrt(5)), from
    `generator`."""
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)


def apply_lora(model: nn.Module, lora: LoRAConfig, seed: int = 0, quiet: bool = False) -> int:
    """Freeze `model` and wrap its targeted linears (and stacked experts) with adapters (fp32;
    the base in bf16 with lora.bf16_base); a classification head (HEADS) stays trainable, in
    fp32. Returns the number of trainable parameters, which it logs unless `quiet` (a LoRA
    checkpoint read to be merged and used: nothing trains).

    A model on the meta device (a layout that shards it) gets meta adapters: once it is laid out
    and its base filled, init_adapters gives each rank its pieces of the adapters this call would
    have drawn."""
    targets, experts = target_modules(model, lora)
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    if lora.bf16_base:
        model.to(torch.bfloat16)
    # NF4 quantizes whole weights: a meta model's are read and quantized before it is laid out
    # (lmforge.parallel.load.read_nf4_base).
    if lora.base_dtype == "nf4" and not any(p.is_meta for p in model.parameters()):
        quantize_nf4(model)
    wrappers = [
        (
            name,
            lambda base, parts=parts: LoRALinear(
                base, parts, lora.rank, lora.alpha, lora.dropout, model.config, generator
            ),
        )
        for name, parts in targets.items()
    ]
    wrappers += [
        (
            name,
            lambda base, ranks=ranks: LoRAExperts(
                base, ranks, {w: lora.alpha * r / lora.rank for w, r in ranks.items()}, generator
            ),
        )
        for name, ranks in experts.items()
    ]
    # a classifier's new head trains whole, in fp32 (PEFT's SEQ_CLS modules_to_save)
    if model.config.num_labels:
        for head in filter(None, (getattr(model, name, None) for name in HEADS)):
            head.float().requires_grad_(True)
    for name, wrap in wrappers:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, attr)
        wrapped = wrap(base)
        device = next(base.parameters()).device
        if device.type != "meta":  # adapters drawn on the CPU generator, then moved
            wrapped.to(device)
        wrapped.train(base.training)
        setattr(parent, attr, wrapped)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if quiet:
        return trainable
    total = sum(p.numel() for p in model.parameters())
    adapted = sorted({p for parts in targets.values() for p in parts})
    adapted += [f"experts.{w} (rank {r})" for w, r in next(iter(experts.values()), {}).items()]
    adapted += [
        f"{name} (whole)"
        for name in HEADS
        if model.config.num_labels and getattr(model, name, None)
    ]
    blocks = len({f".{name}".split(".layers.")[1].split(".")[0] for name in (*targets, *experts)})
    log.info(
        "LoRA rank %d alpha %g on %s in %d block%s (%d modules as PEFT counts them): %d trainable parameters "
        "of %d (%.2f%%)",
        lora.rank,
        lora.alpha,
        ",".join(adapted),
        blocks,
        "s" * (blocks != 1),
        hf_module_count(targets, QKV, model.config) + sum(len(r) for r in experts.values()),
        trainable,
        total,
        100 * trainable / total,
    )
    return trainable


@torch.no_grad()
def init_adapters(parts: list[nn.Module], lora: LoRAConfig, seed: int = 0) -> None:
    """Initialise the adapters of a meta-wrapped model once laid out (`parts`: a ParallelModel's,
    its tensors allocated): each A as apply_lora(model, lora, seed) draws it on a whole model, B
    zeros, bit for bit.

    A is drawn whole on the CPU in apply_lora's order, one CPU generator from `seed` over every
    target of the model (the modules of other pipeline stages too: their draws advance the
    generator), and each rank copies the rows and columns it holds (a DTensor's local piece under
    FSDP2 or tensor parallelism). An A is rank x in: a draw is small next to any weight."""
    from lmforge.models.build import build, local_piece, unwrapped_name

    # the whole model's targets, in apply_lora's order
    model = build(parts[0].config, device="meta")
    held = {
        unwrapped_name(n): p for part in parts for n, p in part.named_parameters() if is_adapter(n)
    }
    generator = torch.Generator().manual_seed(seed)
    targets, experts = target_modules(model, lora)
    # Meta twins of apply_lora's modules in its order (linears, then experts): a twin's lora_A keys
    # come in its constructor's draw order, and each A is drawn as that constructor draws it.
    twins = [
        (
            name,
            LoRALinear(model.get_submodule(name), names, lora.rank, lora.alpha, 0.0, model.config),
            lambda a: _draw_a(a, generator),
        )
        for name, names in targets.items()
    ]
    twins += [
        (
            name,
            LoRAExperts(
                model.get_submodule(name),
                ranks,
                {w: lora.alpha * r / lora.rank for w, r in ranks.items()},
            ),
            lambda a: _draw_a(a.view(-1, a.shape[-1]), generator),
        )
        for name, ranks in experts.items()
    ]
    for name, twin, draw in twins:
        for key, meta_a in twin.lora_A.items():
            a = torch.empty(meta_a.shape)
            draw(a)
            for param, whole in (
                (held.pop(f"{name}.lora_A.{key}", None), a),
                (held.pop(f"{name}.lora_B.{key}", None), None),
            ):
                if param is None:  # another pipeline stage's module
                    continue
                local, box = local_piece(param)
                if whole is None:
                    local.zero_()
                else:
                    local.copy_(whole[box])
    if held:
        raise RuntimeError(
            f"init_adapters: {sorted(held)[0]} is not an adapter apply_lora({lora}) adds"
        )


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear | LoRAExperts]]:
    for name, module in model.named_modules():
        if isinstance(module, (LoRALinear, LoRAExperts)):
            yield name, module


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model's forward (DPO's reference): every adapter off inside the block."""
    modules = [m for _, m in lora_modules(model)]
    for m in modules:
        m.adapters_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.adapters_enabled = True


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight and put plain nn.Linear (and moe.Experts) modules back:
    the merged model."""
    for name, module in list(lora_modules(model)):
        parent_name, _, attr = name.rpartition(".")
        if isinstance(module, LoRAExperts):
            # In place; QLoRA's NF4 experts merge into new stacked bf16 weights.
            held = dict(zip(("gate_up", "down"), stacked(module.gate_up, module.down), strict=True))
            for weight in module.rank:
                w = held[weight]
                w.copy_((w.float() + module.delta(weight).to(w.device)).to(w.dtype))
            params = [
                getattr(module, k)
                if w is getattr(module, k)
                else nn.Parameter(w, requires_grad=False)
                for k, w in held.items()
            ]
            setattr(model.get_submodule(parent_name), attr, Experts.holding(*params))
            continue
        w = dense(module.weight)  # an NF4 base merges into a new bf16 weight, any other in place
        merged = (w.float() + module.delta_weight().to(w.device)).to(w.dtype)
        weight = module.weight if w is module.weight else nn.Parameter(merged, requires_grad=False)
        weight.copy_(merged)
        plain = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
        plain.weight, plain.bias = weight, module.bias
        setattr(model.get_submodule(parent_name), attr, plain)
    return model


# A classification model's head (decoders' score, BERT's classifier): trained whole beside the
# adapters.
HEADS = ("score", "classifier")


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name
