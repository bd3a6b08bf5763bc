"""ModelConfig: every switch that separates the families (GPT-NeoX/Pythia, Llama 2/3, GPT-2, GPT-J,
BERT ...).

One decoder (and one encoder for BERT) reads these switches; a family is a set of values,
not a class. Names follow the words Megatron/NeMo and Hugging Face users already know.
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass, fields

from lmforge.config import checked, closest
from lmforge.errors import UserError

FAMILIES = (
    "gpt_neox",
    "llama",
    "gpt2",
    "gptj",
    "bert",
    "qwen2",
    "mistral",
    "qwen3",
    "olmo2",
    "phi3",
    "gemma2",
    "gemma3_text",
    "mixtral",
    "qwen3_moe",
)
NORMS = ("layernorm", "rmsnorm")
QK_NORMS = ("none", "head", "full")
NORM_POSITIONS = ("pre", "post", "output", "sandwich")
ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")
POSITION_EMBEDDINGS = ("rotary", "learned")
ROPE_SCALINGS = ("linear", "dynamic", "yarn", "llama3", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names
# Families whose Hugging Face config has no head_dim: it is always hidden_size // num_heads there.
FIXED_HEAD_DIM = ("gpt_neox", "gpt2", "gptj", "bert", "qwen2", "olmo2", "phi3")
# Families whose transformers config rejects hidden_size % num_heads != 0 even with an explicit
# head_dim.
HEADS_DIVIDE_HIDDEN = ("llama", "gemma2", "gemma3_text")
# How far from a size its advice looks for one that fits (a divisor, an even head_dim): the nearest
# is close by.
SEARCH = 4096


@dataclass
class RopeScaling:
    """Rotary context extension, named as transformers' rope_parameters name it (rope_type -> type).

    linear: every frequency / factor. dynamic (NTK): the base grows with the longest position of the
    forward once it passes max_position_embeddings. yarn: frequencies blended between interpolated
    and original by a ramp over beta_fast..beta_slow rotations, cos/sin scaled by attention_factor.
    llama3: low frequencies / factor, high ones kept, a smooth blend between low_freq_factor and
    high_freq_factor. longrope (Phi-3 128k, Phi-3.5): each pair's frequency divided by its
    short_factor, or by its long_factor in a forward reaching past original_max_position_embeddings;
    cos/sin scaled by attention_factor. Fields left None take transformers' defaults (and are left
    out of an exported config.json).
    """

    type: str  # linear | dynamic | yarn | llama3 | longrope
    factor: float = 1.0  # how many times the pretraining context to reach
    # llama3, yarn, longrope: the pretraining context
    original_max_position_embeddings: int | None = None
    # llama3: wavelengths above original / this are slowed by factor
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None  # llama3: wavelengths below original / this are kept
    beta_fast: float | None = None  # yarn (32)
    beta_slow: float | None = None  # yarn (1)
    # yarn: with mscale_all_dim, attention_factor = m(factor, mscale) / m(.., all_dim)
    mscale: float | None = None
    mscale_all_dim: float | None = None  # yarn: the divisor's mscale (see mscale)
    # yarn, longrope: cos/sin scale; default from factor (and mscale)
    attention_factor: float | None = None
    truncate: bool | None = None  # yarn: floor/ceil the correction range (True)
    short_factor: list[float] | None = None  # longrope: one per rotated pair
    long_factor: list[float] | None = None  # longrope

    def __post_init__(self) -> None:
        hints = _field_types(RopeScaling)
        for f in fields(self):
            checked(getattr(self, f.name), hints[f.name], f"rope_scaling.{f.name}")
        if self.type not in ROPE_SCALINGS:
            hint = closest(str(self.type), ROPE_SCALINGS)
            raise UserError(
                f"unknown rope_scaling.type '{self.type}'{hint}: choose one of {', '.join(ROPE_SCALINGS)}"
            )
        if not self.factor > 0:
            raise UserError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if (
            self.type in ("llama3", "yarn", "longrope")
            and self.original_max_position_embeddings is None
        ):
            raise UserError(
                f"rope_scaling type {self.type} needs rope_scaling.original_max_position_embeddings "
                "(the context length the model was pretrained with)"
            )
        if self.type == "llama3":
            if self.low_freq_factor is None or self.high_freq_factor is None:
                raise UserError(
                    "rope_scaling type llama3 needs low_freq_factor and high_freq_factor"
                )
            if self.high_freq_factor <= self.low_freq_factor:
                raise UserError(
                    f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must be above "
                    f"low_freq_factor ({self.low_freq_factor})"
                )
        if self.type == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise UserError(
                "rope_scaling type longrope needs short_factor and long_factor (one per rotated pair)"
            )


@dataclass
class ModelConfig:
    # the architecture: gpt_neox, llama, gpt2, gptj, bert, qwen2, mistral, qwen3, olmo2, phi3,
    # ...
    family: str
    # ids the model can see; rows past it are Megatron padding (see padded_vocab_size)
    vocab_size: int
    hidden_size: int  # the residual stream's width
    num_layers: int  # transformer blocks
    num_heads: int  # query heads per attention layer
    num_kv_heads: int | None = None  # grouped-query attention when < num_heads (Llama-2-70B: 8)
    head_dim: int | None = None  # default hidden_size // num_heads
    intermediate_size: int | None = None  # default 4 * hidden_size
    max_position_embeddings: int = 2048  # the context: positions a forward may reach

    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5  # the norms' epsilon
    # "post" (BERT): norm(x + f(x)); "output" (OLMo 2): x + norm(f(x)); "sandwich" (Gemma)
    norm_position: str = "pre"
    # RMSNorm scales before casting back from fp32 (OLMo 2, Gemma), not after (Llama)
    norm_scale_fp32: bool = False
    norm_unit_offset: bool = False  # RMSNorm scales by 1 + weight, the weight starting at 0 (Gemma)
    activation: str = "gelu"  # the MLP's: gelu | gelu_tanh | silu | relu
    gated_mlp: bool = False  # SwiGLU: down(act(gate(x)) * up(x))
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x))  (NeoX, GPT-J)
    shared_norm: bool = False  # GPT-J: one norm feeds both attention and MLP

    position_embedding: str = "rotary"  # rotary | learned (GPT-2, BERT: a weight per position)
    rotary_pct: float = 1.0  # fraction of each head that rotates (Pythia/NeoX 0.25, GPT-J 64/256)
    rotary_base: float = 10000.0  # rotary's theta: the frequencies are base^(-2i/d)
    # the HF checkpoint pairs dims (2i, 2i+1) (GPT-J), not (i, i+r/2)
    rotary_interleaved: bool = False
    rope_scaling: RopeScaling | None = None  # context extension (Llama 3.1: llama3, factor 8)
    # sliding-window layers' own plain rotary base (Gemma 3: 10,000)
    rotary_base_local: float | None = None
    # Sliding-window attention (Mistral, Gemma 2/3): a token sees itself and the window - 1 before
    # it, on layer_types' "sliding_attention" layers (every layer when layer_types is None).
    sliding_window: int | None = None
    # per layer: full_attention | sliding_attention (transformers' names)
    layer_types: list[str] | None = None

    attention_bias: bool = True  # biases on the attention projections
    # the q/k/v projections' bias; default attention_bias (Qwen2: True, o_proj none)
    qkv_bias: bool | None = None
    # Norm of queries and keys before the rotation (the model's norm and eps): "head" over each
    # head's dims, one weight for all heads (Qwen3, Gemma 3); "full" over all of q and k (OLMo 2).
    qk_norm: str = "none"
    mlp_bias: bool = True  # biases on the MLP's linears
    lm_head_bias: bool = False  # a bias on the output head
    tie_embeddings: bool = False  # the output head is the input embedding's weight
    scale_embeddings: bool = False  # input embeddings times sqrt(hidden_size) (Gemma)
    # attention scores scaled by its -1/2, not head_dim's (Gemma)
    query_pre_attn_scalar: int | None = None
    # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    causal: bool = True  # false: every token sees every other (BERT)
    type_vocab_size: int = 0  # BERT token-type (segment) embeddings
    num_labels: int = 0  # > 0: sequence-classification head instead of the LM/MLM head
    pooler: bool = False  # BERT pooler (dense + tanh over [CLS]); implied by num_labels > 0

    # Mixture of experts (Mixtral, Qwen3-MoE): > 0 replaces the MoE layers' MLP by a router and this
    # many SwiGLU experts of moe_intermediate_size, each token going to its experts_per_token best.
    num_experts: int = 0
    experts_per_token: int = 2  # the top k experts a token is routed to
    # default intermediate_size (which the dense layers keep)
    moe_intermediate_size: int | None = None
    # The chosen experts' softmax weights renormalised to sum 1 (Mixtral; Qwen3-MoE's
    # norm_topk_prob), else the softmax over all experts as it is.
    router_norm_topk: bool = True
    # layer i is a MoE layer when (i + 1) % moe_every == 0 (Qwen3-MoE's decoder_sparse_step)
    # ...
    moe_every: int = 1
    # ... and it is not listed here (Qwen3-MoE's mlp_only_layers)
    dense_layers: list[int] | None = None
    # the load-balancing loss's weight in the training loss (Switch Transformer's, as transformers
    # computes it over all MoE layers)
    router_aux_loss_coef: float = 0.001
    # the router z-loss's weight in the training loss (ST-MoE: mean squared logsumexp of the logits)
    router_z_loss_coef: float = 0.0

    # embedding rows padded to a multiple (Megatron's); x the TP degree
    make_vocab_size_divisible_by: int = 128
    # a fresh model's weights: N(0, init_std), output projections / sqrt(2 layers)
    init_std: float = 0.02
    dropout: float = 0.0  # on the embeddings and the residual branches, in training
    attention_dropout: float = 0.0  # on the attention probabilities, in training
    bos_token_id: int | None = None  # as config.json names it (the tokenizer's)
    # a list: each ends a generation (Llama 3.1 Instruct, Gemma 3)
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None  # a classifier finds each row's last token by it

    def __post_init__(self) -> None:
        # Built from a config.json as well as through from_dict: a "32" or a 2.5 is named here, not
        # a TypeError deep in the build.
        hints = _field_types(ModelConfig)
        for f in fields(self):
            checked(getattr(self, f.name), hints[f.name], f.name)
        self._check_choice("family", FAMILIES)
        self._check_choice("norm", NORMS)
        self._check_choice("norm_position", NORM_POSITIONS)
        self._check_choice("qk_norm", QK_NORMS)
        self._check_choice("activation", ACTIVATIONS)
        self._check_choice("position_embedding", POSITION_EMBEDDINGS)
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.qkv_bias is None:
            self.qkv_bias = self.attention_bias
        if isinstance(self.rope_scaling, dict):  # built by hand rather than through from_dict
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        self._check_sizes()
        self._check_family_shapes()
        self._check_layer_types()
        self._check_experts()
        derived_head_dim = self.head_dim is None
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                fixed = self.family in FIXED_HEAD_DIM
                raise UserError(
                    _indivisible(
                        self.hidden_size,
                        self.num_heads,
                        f" (a {self.family} head is hidden_size / num_heads)" if fixed else "",
                        "" if fixed else ", or set head_dim",
                        self._rotary_pct(),
                    )
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.moe_intermediate_size is None and self.num_experts:
            self.moe_intermediate_size = self.intermediate_size
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}: each key/value "
                f"head must serve the same number of query heads: use num_kv_heads="
                f"{_nearest_divisor(self.num_heads, self.num_kv_heads)}"
            )
        if self.num_labels > 0:
            self.pooler = self.pooler or self.family == "bert"
        if self.position_embedding == "rotary":
            pairs = int(self.head_dim * self.rotary_pct + 1e-6) // 2
            for name in ("short_factor", "long_factor"):
                factors = getattr(self.rope_scaling, name, None)
                if factors is not None and len(factors) != pairs:
                    raise UserError(
                        f"rope_scaling.{name} has {len(factors)} entries, the model rotates {pairs} "
                        "pairs per head: give one per pair"
                    )
            if not 0.0 < self.rotary_pct <= 1.0:
                raise UserError(f"rotary_pct must be in (0, 1], got {self.rotary_pct}")
            if self.rotary_dim % 2 or (self.head_dim - self.rotary_dim) % 2:
                raise UserError(
                    f"rotary_pct {self.rotary_pct} of head_dim {self.head_dim} gives {self.rotary_dim} rotary dims: "
                    f"both the rotary and the pass-through part must be even: {self._even_rotary(derived_head_dim)}"
                )

    def _rotary_pct(self) -> float | None:
        """rotary_pct where the heads rotate (what a head_dim must fit), else None."""
        return (
            self.rotary_pct
            if self.position_embedding == "rotary" and 0.0 < self.rotary_pct <= 1.0
            else None
        )

    def _even_rotary(self, derived_head_dim: bool) -> str:
        """A rotary_pct (or head_dim, or the hidden_size that gives it) whose rotary and
        pass-through dims are both even."""
        h, n = self.head_dim, self.num_heads

        def fits(d: int) -> bool:
            rotary = int(d * self.rotary_pct + 1e-6)
            return d >= 2 and rotary % 2 == 0 and (d - rotary) % 2 == 0

        near = [d for d in (h + 1, h - 1, h + 3, h - 3, h + 5, h - 5) if fits(d)][:2]
        if h % 2 and derived_head_dim and near:
            sizes = " or ".join(str(d * n) for d in near)
            return f"use an even head_dim (now {h} = hidden_size {self.hidden_size} / {n} heads): hidden_size={sizes}"
        if h % 2 and near:
            return f"use an even head_dim (now {h}): head_dim={near[0]}"
        dims = max(2, round(self.rotary_dim / 2) * 2)
        return f"use rotary_pct={dims / self.head_dim:g} ({dims} of {self.head_dim} dims rotate)"

    def _check_sizes(self) -> None:
        """Sizes no model has (a zero or negative count, an empty MLP) fail here, not as a
        ZeroDivisionError or an empty tensor that trains and exports a folder nothing can load."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
            "make_vocab_size_divisible_by",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{name} must be a positive integer, got {value}")
        if self.num_kv_heads > self.num_heads:
            raise UserError(
                f"num_kv_heads {self.num_kv_heads} is more than num_heads {self.num_heads}: use "
                f"num_kv_heads={_nearest_divisor(self.num_heads, self.num_kv_heads)} or fewer"
            )
        if not self.norm_eps > 0:
            raise UserError(f"norm_eps must be > 0, got {self.norm_eps}")
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            ids = getattr(self, name)
            if any(
                not isinstance(i, int) or i < 0
                for i in (ids if isinstance(ids, list) else [ids])
                if i is not None
            ):
                raise UserError(f"{name} must be a token id (an integer >= 0) or null, got {ids!r}")

    def _check_family_shapes(self) -> None:
        """Shapes the family's Hugging Face config cannot express fail here, not at export after
        training."""
        hidden, heads, head_dim = self.hidden_size, self.num_heads, self.head_dim
        divides = hidden % heads == 0
        if self.family in HEADS_DIVIDE_HIDDEN and not divides:
            raise UserError(
                _indivisible(
                    hidden,
                    heads,
                    f" (transformers rejects such a {self.family} config, even with head_dim set)",
                    rotary_pct=self._rotary_pct(),
                )
            )
        if (
            self.family in FIXED_HEAD_DIM
            and head_dim is not None
            and (not divides or head_dim != hidden // heads)
        ):
            if not divides:
                raise UserError(
                    _indivisible(
                        hidden,
                        heads,
                        f" (a {self.family} head is hidden_size / num_heads)",
                        rotary_pct=self._rotary_pct(),
                    )
                )
            keep = (
                f", or num_heads={hidden // head_dim} to keep head_dim {head_dim}"
                if hidden % head_dim == 0
                else ""
            )
            raise UserError(
                f"head_dim {head_dim} does not fit a {self.family} model: its head_dim is always "
                f"hidden_size / num_heads ({hidden} / {heads}): use head_dim={hidden // heads}{keep}"
            )

    def _check_experts(self) -> None:
        if self.num_experts < 0:
            raise UserError(f"num_experts must be >= 0 (0: a dense model), got {self.num_experts}")
        if not self.num_experts:
            return
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise UserError(
                f"experts_per_token {self.experts_per_token} must be between 1 and num_experts "
                f"{self.num_experts}: each token goes to that many different experts; set it from 1 to "
                f"{self.num_experts} (in a Hugging Face config.json: num_experts_per_tok, against "
                "num_local_experts or num_experts)"
            )
        if not self.gated_mlp or self.mlp_bias:
            raise UserError(
                "experts are SwiGLU MLPs without biases: a model with num_experts > 0 needs "
                "gated_mlp=true and mlp_bias=false"
            )
        if self.moe_every < 1:
            raise UserError(
                f"moe_every must be >= 1 (every n-th layer is a MoE layer), got {self.moe_every}"
            )
        bad = [i for i in self.dense_layers or [] if not 0 <= i < self.num_layers]
        if bad:
            raise UserError(
                f"dense_layers names layer {bad[0]}, the model has layers 0..{self.num_layers - 1}"
            )
        if self.router_aux_loss_coef < 0 or self.router_z_loss_coef < 0:
            raise UserError("router_aux_loss_coef and router_z_loss_coef must be >= 0")
        if not any(self.is_moe_layer(i) for i in range(self.num_layers)):
            raise UserError(
                f"num_experts is {self.num_experts} but no layer is a MoE layer (moe_every "
                f"{self.moe_every}, dense_layers {self.dense_layers}): set num_experts=0 for a dense model"
            )
        if self.dense_layers is not None:
            self.dense_layers = sorted(set(self.dense_layers)) or None  # one spelling per model

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return (
            self.num_experts > 0
            and (layer + 1) % self.moe_every == 0
            and layer not in (self.dense_layers or ())
        )

    def _check_layer_types(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UserError(
                f"sliding_window must be >= 1 (tokens a query sees, itself included), got "
                f"{self.sliding_window}"
            )
        if self.layer_types is None:
            return
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_layers:
            raise UserError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers: give one "
                "per layer"
            )
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise UserError(
                    f"unknown layer type '{t}'{closest(str(t), LAYER_TYPES)}: choose one of "
                    f"{', '.join(LAYER_TYPES)}"
                )
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise UserError(
                "layer_types names sliding_attention layers but sliding_window is not set"
            )
        if self.layer_types == self._default_layer_types():
            self.layer_types = None  # one spelling per model, so configs compare equal

    def _default_layer_types(self) -> list[str]:
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return [kind] * self.num_layers

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None where it attends to everything before it."""
        kind = (self.layer_types or self._default_layer_types())[layer]
        return self.sliding_window if kind == "sliding_attention" else None

    def _check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in choices:
            hint = closest(str(value), choices)
            raise UserError(f"unknown {name} '{value}'{hint}: choose one of {', '.join(choices)}")

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that rotate; floor like GPT-NeoX's int(head_dim * rotary_pct)."""
        return (
            int(self.head_dim * self.rotary_pct + 1e-6)
            if self.position_embedding == "rotary"
            else 0
        )

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows: vocab_size rounded up to a multiple of make_vocab_size_divisible_by
        (Megatron).

        The extra rows exist for GEMM shapes and (later) tensor-parallel divisibility; logits and
        exports only ever cover the first vocab_size rows.
        """
        multiple = max(1, self.make_vocab_size_divisible_by)
        return math.ceil(self.vocab_size / multiple) * multiple

    @property
    def is_decoder(self) -> bool:
        return self.family != "bert"


@functools.cache
def _field_types(cls: type) -> dict:
    """A config dataclass's field types (typing.get_type_hints takes 0.7 ms: a config is built
    often)."""
    return typing.get_type_hints(cls)


def _nearest(
    target: float, ok, lowest: int, highest: int, larger_on_tie: bool = False
) -> int | None:
    """The integer in [lowest, highest] nearest `target` for which ok(d), among those within
    SEARCH of it (a config from elsewhere may give a size of 2**40: its advice must not count up
    to it); None where there is none."""
    centre = round(target)
    found = [
        d for d in range(max(lowest, centre - SEARCH), min(highest, centre + SEARCH) + 1) if ok(d)
    ]
    return min(found, key=lambda d: (abs(d - target), -d if larger_on_tie else d), default=None)


def _nearest_divisor(n: int, target: int) -> int:
    """The divisor of n closest to target (the larger one on a tie); 1 where none is within
    SEARCH of it."""
    return _nearest(target, lambda d: n % d == 0, 1, n, larger_on_tie=True) or 1


def _indivisible(
    hidden: int, heads: int, note: str, other: str = "", rotary_pct: float | None = None
) -> str:
    """One line for a hidden_size that num_heads does not divide, with two shapes that fit: a
    head_dim whose rotary part (`rotary_pct` of it, for a rotary model) and pass-through part are
    even, as the rotary embeddings need (without rotary: any divisor, and an even head_dim for
    the second)."""

    def fits(head_dim: int) -> bool:
        rotary = int(head_dim * rotary_pct + 1e-6) if rotary_pct is not None else 0
        return (
            rotary % 2 == 0 and (head_dim - rotary) % 2 == 0 and (rotary_pct is None or rotary > 0)
        )

    use_heads = _nearest(
        heads,
        lambda d: hidden % d == 0 and (rotary_pct is None or fits(hidden // d)),
        1,
        hidden,
        larger_on_tie=True,
    )
    head_dim = _nearest(hidden / heads, fits, 2, 4 * max(hidden, 8) - 1)
    shapes = [f"num_heads={use_heads or heads}"] + (
        [f"hidden_size={head_dim * heads}{other}"] if head_dim else []
    )
    return (
        f"hidden_size {hidden} is not divisible by num_heads {heads}{note}: use {' or '.join(shapes)} (a Hugging "
        "Face config.json: num_attention_heads)"
    )
