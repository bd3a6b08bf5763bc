"""What every Hugging Face family adapter shares: the adapter protocol, tensor surgery, and
the generic converter that turns an adapter's name table into tensors both ways.

An adapter (one small file per family) maps config.json <-> ModelConfig and streams tensors
HF name <-> lmforge name, one layer at a time, so memory stays near one shard, not one model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.hf.weights import Source
from lmforge.models.rope import rotary_permutation

# Files copied along with the weights (tokenizer and generation settings).
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "generation_config.json",
    # transformers 5 keeps the chat template here, not in tokenizer_config.json
    "chat_template.jinja",
)

Tensors = Iterator[tuple[str, torch.Tensor]]
# Kinds of mapping row: how an HF tensor becomes an lmforge one.
PLAIN = "plain"  # same layout
CONV1D = "conv1d"  # GPT-2 Conv1D: 2-D weights stored transposed
QKV_GROUPED = "qkv_grouped"  # one fused tensor already in [heads, 3, head_dim] order (GPT-NeoX)
QKV_STACKED = "qkv_stacked"  # one fused Conv1D tensor in [q; k; v] order (GPT-2)
QKV_SEPARATE = "qkv_separate"  # three tensors q, k, v (Llama, GPT-J, BERT)
QKV_ROWS = "qkv_rows"  # one fused Linear tensor in [q; k; v] row order (Phi-3)
# a q/k norm's per-head weights (Qwen3, OLMo 2): rotary pairing applies to them too
QK_NORM = "qk_norm"
# Two lmforge tensors stored as one HF tensor, the first's rows then the second's (Phi-3's
# gate_up_proj): rows FIRST_HALF and SECOND_HALF name the same HF tensor, in that order.
FIRST_HALF, SECOND_HALF = "first_half", "second_half"
# Stacked experts (Mixtral, Qwen3-MoE) stored one tensor per expert: EXPERTS names each expert's
# tensor in expert order (stacked as they are); EXPERTS_GATE_UP names every expert's gate, then
# every expert's up projection (expert e's in lmforge: gate_up[e, 0] its gate, gate_up[e, 1] its up
# projection).
EXPERTS, EXPERTS_GATE_UP = "experts", "experts_gate_up"
Mapping = list[tuple[str, "str | tuple[str, str, str]", str]]


class HFAdapter:
    """One per family: config.json <-> ModelConfig, and a table of lmforge <-> HF tensor names.

    `mapping(cfg)` lists (lmforge name, HF name(s), kind) in checkpoint order, layer by layer;
    the generic import_tensors/export_tensors below do the transposes, q/k/v fusing, rotary
    permutation and vocabulary padding that the kind implies.
    """

    model_type: str
    # Checkpoint entries that are not weights (old buffers, unused heads) and may be dropped.
    ignorable: tuple[str, ...] = (
        "rotary_emb.inv_freq",
        ".attn.bias",
        ".attn.masked_bias",
        "attention.bias",
        "attention.masked_bias",
        "position_ids",
    )

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        raise NotImplementedError

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        raise NotImplementedError

    def mapping(self, cfg: ModelConfig) -> Mapping:
        raise NotImplementedError

    def aliases(self, name: str) -> list[str]:
        """Other names the same tensor goes by in older checkpoints."""
        return []


# --- shared tensor surgery -------------------------------------------------------------------


def pad_vocab(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Append zero rows up to padded_vocab_size (Megatron's make_vocab_size_divisible_by)."""
    extra = cfg.padded_vocab_size - t.shape[0]
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def unpad_vocab(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    return t[: cfg.vocab_size]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Separate q/k/v rows -> lmforge's grouped [kv_heads, q_per_kv + 2, head_dim] rows."""
    kv, d = cfg.num_kv_heads, cfg.head_dim
    rest = q.shape[1:]
    q = q.reshape(kv, -1, d, *rest)
    return torch.cat([q, k.reshape(kv, 1, d, *rest), v.reshape(kv, 1, d, *rest)], dim=1).reshape(
        -1, *rest
    )


def split_qkv(
    qkv: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv, d = cfg.num_kv_heads, cfg.head_dim
    rest = qkv.shape[1:]
    g = qkv.reshape(kv, -1, d, *rest)
    return (g[:, :-2].reshape(-1, *rest), g[:, -2].reshape(-1, *rest), g[:, -1].reshape(-1, *rest))


def permute_rotary(qkv: torch.Tensor, cfg: ModelConfig, inverse: bool = False) -> torch.Tensor:
    """Reorder the q and k rows of each head into lmforge's full-head rotary pairing (rope.py)."""
    if cfg.position_embedding != "rotary":
        return qkv
    perm = rotary_permutation(cfg.head_dim, cfg.rotary_dim, cfg.rotary_interleaved)
    if torch.equal(perm, torch.arange(cfg.head_dim)):
        return qkv
    if inverse:
        perm = torch.argsort(perm)
    kv, d = cfg.num_kv_heads, cfg.head_dim
    rest = qkv.shape[1:]
    g = qkv.reshape(kv, -1, d, *rest).clone()
    g[:, :-1] = g[:, :-1, perm]  # query heads and the key head; values keep their order
    return g.reshape(-1, *rest)


def permute_head_vector(t: torch.Tensor, cfg: ModelConfig, inverse: bool = False) -> torch.Tensor:
    """A q/k norm weight (one head's dims, or every head's in a row) in the rotary pairing's dim
    order."""
    perm = rotary_permutation(cfg.head_dim, cfg.rotary_dim, cfg.rotary_interleaved)
    if torch.equal(perm, torch.arange(cfg.head_dim)):
        return t
    if inverse:
        perm = torch.argsort(perm)
    return t.reshape(-1, cfg.head_dim)[:, perm].reshape(t.shape)


# --- the generic converter: adapters describe, these two functions do -------------------------


_ACT_FROM_HF = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
}
_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu", "relu": "relu"}


def activation_from_hf(name: str) -> str:
    if not isinstance(name, str) or name not in _ACT_FROM_HF:
        raise UserError(
            f"activation '{name}' in config.json is not supported: lmforge has {', '.join(_ACT_FROM_HF)}"
        )
    return _ACT_FROM_HF[name]


def activation_to_hf(name: str) -> str:
    return _ACT_TO_HF[name]


def _qkv_rows(cfg: ModelConfig) -> tuple[int, int]:
    return cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim


def import_tensors(
    mapping: Mapping,
    cfg: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    vocab_params: tuple[str, ...],
    get: Source,
) -> Tensors:
    """Yield lmforge (name, tensor) for each mapping row, checking every HF shape on the way."""
    q_rows, kv_rows = _qkv_rows(cfg)
    for ours, theirs, kind in mapping:
        shape = shapes[ours]
        rest = shape[1:]
        if ours in vocab_params:
            shape = (cfg.vocab_size, *rest)
        if kind == PLAIN:
            t = get(theirs, *shape)
        elif kind == QK_NORM:
            t = permute_head_vector(get(theirs, *shape), cfg)
        elif kind in (FIRST_HALF, SECOND_HALF):
            t = get(theirs, 2 * shape[0], *rest).chunk(2)[kind == SECOND_HALF]
        elif kind == CONV1D:
            t = get(theirs, *shape[::-1]).t() if len(shape) == 2 else get(theirs, *shape)
        elif kind == EXPERTS:
            t = torch.stack([get(name, *rest) for name in theirs])
        elif kind == EXPERTS_GATE_UP:
            gates, ups = theirs[: len(theirs) // 2], theirs[len(theirs) // 2 :]
            t = torch.stack(
                [
                    torch.stack([get(g, *rest[1:]), get(u, *rest[1:])])
                    for g, u in zip(gates, ups, strict=True)
                ]
            )
        else:
            if kind == QKV_GROUPED:
                t = get(theirs, *shape)
            elif kind == QKV_STACKED:  # GPT-2 c_attn: [q; k; v] columns of a Conv1D
                t = get(theirs, *shape[::-1]).t() if len(shape) == 2 else get(theirs, *shape)
                t = fuse_qkv(*t.split([q_rows, kv_rows, kv_rows]), cfg)
            elif kind == QKV_ROWS:
                t = fuse_qkv(*get(theirs, *shape).split([q_rows, kv_rows, kv_rows]), cfg)
            else:
                qn, kn, vn = theirs
                t = fuse_qkv(
                    get(qn, q_rows, *rest), get(kn, kv_rows, *rest), get(vn, kv_rows, *rest), cfg
                )
            t = permute_rotary(t, cfg)
        if ours in vocab_params:
            t = pad_vocab(t, cfg)
        yield ours, t.contiguous()


def export_tensors(
    mapping: Mapping,
    cfg: ModelConfig,
    vocab_params: tuple[str, ...],
    get: Callable[[str], torch.Tensor],
) -> Tensors:
    """Yield HF (name, tensor) for each mapping row: the exact inverse of import_tensors."""
    first_halves: dict[str, torch.Tensor] = {}
    for ours, theirs, kind in mapping:
        t = get(ours)
        if ours in vocab_params:
            t = unpad_vocab(t, cfg)
        if kind == PLAIN:
            yield theirs, t.contiguous()
        elif kind == QK_NORM:
            yield theirs, permute_head_vector(t, cfg, inverse=True).contiguous()
        elif kind == FIRST_HALF:
            first_halves[theirs] = t
        elif kind == SECOND_HALF:
            yield theirs, torch.cat([first_halves.pop(theirs), t]).contiguous()
        elif kind == CONV1D:
            yield theirs, (t.t() if t.dim() == 2 else t).contiguous()
        elif kind == EXPERTS:
            for name, part in zip(theirs, t, strict=True):
                yield name, part.contiguous()
        elif kind == EXPERTS_GATE_UP:
            gates, ups = theirs[: len(theirs) // 2], theirs[len(theirs) // 2 :]
            for e, (g, u) in enumerate(zip(gates, ups, strict=True)):
                gate, up = t[e]
                yield g, gate.contiguous()
                yield u, up.contiguous()
        else:
            t = permute_rotary(t, cfg, inverse=True)
            if kind == QKV_GROUPED:
                yield theirs, t.contiguous()
            elif kind == QKV_STACKED:
                t = torch.cat(split_qkv(t, cfg))
                yield theirs, (t.t() if t.dim() == 2 else t).contiguous()
            elif kind == QKV_ROWS:
                yield theirs, torch.cat(split_qkv(t, cfg)).contiguous()
            else:
                for name, part in zip(theirs, split_qkv(t, cfg), strict=True):
                    yield name, part.contiguous()


def rope_scaling_check(hf: dict) -> None:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None):
        raise UserError(
            f"rope scaling '{kind}' in config.json is not supported yet: lmforge implements plain RoPE"
        )


# What the classic families' transformers classes (GPTNeoX, GPT2, GPTJ, Bert) have none of: their
# adapters start from these, and num_kv_heads = num_heads (no grouped-query attention there).
CLASSIC_SWITCHES = {
    "norm": "layernorm",
    "gated_mlp": False,
    "qk_norm": "none",
    "sliding_window": None,
    "layer_types": None,
    "norm_scale_fp32": False,
    "norm_unit_offset": False,
    "scale_embeddings": False,
    "query_pre_attn_scalar": None,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "rope_scaling": None,
    "rotary_base_local": None,
    "mlp_bias": True,
}


def require(cfg: ModelConfig, fixed: dict, model_type: str) -> None:
    """UserError naming the first switch whose value the family's Hugging Face model hard-wires
    otherwise (a value of ... : free in this family)."""
    for name, value in fixed.items():
        if value is not ... and getattr(cfg, name) != value:
            raise UserError(
                f"a {model_type} checkpoint has {name}={value!r}, this model has {getattr(cfg, name)!r}: "
                f"it cannot be written as that family: set {name}={value!r}, or choose a family that "
                "has it"
            )


def module_rows(ours: str, theirs: str, bias: bool, kind: str = PLAIN) -> Mapping:
    """Mapping rows for one module's weight (and bias)."""
    params = ("weight", "bias") if bias else ("weight",)
    return [(f"{ours}.{p}", f"{theirs}.{p}", kind) for p in params]


def qkv_rows(ours: str, q: str, k: str, v: str, bias: bool) -> Mapping:
    """Mapping rows fusing three separate q/k/v projections into lmforge's qkv."""
    params = ("weight", "bias") if bias else ("weight",)
    return [(f"{ours}.{p}", (f"{q}.{p}", f"{k}.{p}", f"{v}.{p}"), QKV_SEPARATE) for p in params]


def decoder_num_labels(hf: dict, keys: list[str]) -> int:
    """Labels of an *ForSequenceClassification decoder checkpoint (its `score` head), else 0."""
    if "score.weight" not in keys:
        return 0
    return len(hf.get("id2label") or {}) or hf.get("num_labels", 2)


def decoder_head(cfg: ModelConfig, lm_head: Mapping) -> Mapping:
    """The rows for a decoder's head: `score` for classification, else the LM head (unless tied)."""
    if cfg.num_labels:
        return [("score.weight", "score.weight", PLAIN)]
    return [] if cfg.tie_embeddings else lm_head


def architecture(cfg: ModelConfig, prefix: str, lm_suffix: str = "ForCausalLM") -> dict:
    """`architectures` (and labels) for config.json."""
    if not cfg.num_labels:
        return {"architectures": [prefix + lm_suffix]}
    return {
        "architectures": [prefix + "ForSequenceClassification"],
        "id2label": {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)},
        "label2id": {f"LABEL_{i}": i for i in range(cfg.num_labels)},
    }
