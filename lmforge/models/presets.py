"""Published model shapes by name, plus tiny shapes for tests.

Each preset is a ModelConfig; `build("pythia-160m", device="meta")` gives exactly the
parameter count of the transformers model with the same config (vocabulary padding excluded).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import replace
from typing import Any

from lmforge.config import closest
from lmforge.errors import UserError
from lmforge.models.config import ModelConfig, RopeScaling


def _neox(hidden: int, layers: int, heads: int, vocab: int = 50304) -> ModelConfig:
    # GPT-NeoX-20B tokenizer; eod/bos/eos are <|endoftext|> = 0 in the Pythia configs.
    return ModelConfig(
        family="gpt_neox",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        max_position_embeddings=2048,
        parallel_residual=True,
        rotary_pct=0.25,
        bos_token_id=0,
        eos_token_id=0,
    )


def _llama(
    hidden: int, layers: int, heads: int, ffn: int, kv_heads: int | None = None
) -> ModelConfig:
    return ModelConfig(
        family="llama",
        vocab_size=32000,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=4096,
        norm="rmsnorm",
        activation="silu",
        gated_mlp=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def _llama3(
    hidden: int,
    layers: int,
    heads: int,
    ffn: int,
    factor: float,
    tied: bool = False,
    kv_heads: int = 8,
) -> ModelConfig:
    # Llama 3.1 (factor 8) and 3.2 (factor 32, tied): 128k tiktoken vocabulary, 128k context by
    # llama3 scaling of an 8k pretraining context, 8 key/value heads.
    scaling = RopeScaling(
        "llama3",
        factor,
        original_max_position_embeddings=8192,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
    )
    return ModelConfig(
        family="llama",
        vocab_size=128256,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=131072,
        norm="rmsnorm",
        activation="silu",
        gated_mlp=True,
        rotary_base=500000.0,
        rope_scaling=scaling,
        attention_bias=False,
        mlp_bias=False,
        tie_embeddings=tied,
        bos_token_id=128000,
        eos_token_id=128001,
    )


def _qwen25(
    hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, tied: bool = False
) -> ModelConfig:
    # Qwen2.5: biased q/k/v, rope base 1e6; the sizes up to 3B tie their 151,936-row embedding, the
    # larger ones have 152,064 rows and a separate head.
    return ModelConfig(
        family="qwen2",
        vocab_size=151936 if tied else 152064,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=32768 if tied else 131072,
        norm="rmsnorm",
        norm_eps=1e-6,
        activation="silu",
        gated_mlp=True,
        rotary_base=1000000.0,
        qkv_bias=True,
        attention_bias=False,
        mlp_bias=False,
        tie_embeddings=tied,
        bos_token_id=151643,
        eos_token_id=151643,
    )


def _mistral(
    vocab: int,
    rotary_base: float,
    window: int | None,
    hidden: int = 4096,
    layers: int = 32,
    heads: int = 32,
    kv_heads: int = 8,
    ffn: int = 14336,
) -> ModelConfig:
    # Mistral 7B: v0.1 attends through a 4096-token sliding window; v0.3 has a 32768-token
    # vocabulary and none.
    return ModelConfig(
        family="mistral",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=32768,
        norm="rmsnorm",
        norm_eps=1e-5,
        activation="silu",
        gated_mlp=True,
        rotary_base=rotary_base,
        sliding_window=window,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def _qwen3(
    hidden: int, layers: int, heads: int, ffn: int, tied: bool = False, kv_heads: int = 8
) -> ModelConfig:
    # Qwen3 (dense): q/k RMSNorm per head, head_dim 128 at every width, rope base 1e6, 40,960
    # positions; the sizes up to 4B tie their embedding.
    return ModelConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=128,
        intermediate_size=ffn,
        max_position_embeddings=40960,
        norm="rmsnorm",
        norm_eps=1e-6,
        activation="silu",
        gated_mlp=True,
        qk_norm="head",
        rotary_base=1000000.0,
        attention_bias=False,
        mlp_bias=False,
        tie_embeddings=tied,
        bos_token_id=151643,
        eos_token_id=151645,
    )


def _mixtral(
    hidden: int,
    layers: int,
    heads: int,
    ffn: int,
    experts: int = 8,
    kv_heads: int = 8,
    vocab: int = 32000,
) -> ModelConfig:
    # Mixtral: Mistral's attention without a window, rope base 1e6, 8 SwiGLU experts per layer, 2
    # per token.
    return ModelConfig(
        family="mixtral",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=32768,
        norm="rmsnorm",
        norm_eps=1e-5,
        activation="silu",
        gated_mlp=True,
        rotary_base=1000000.0,
        attention_bias=False,
        mlp_bias=False,
        num_experts=experts,
        experts_per_token=2,
        moe_intermediate_size=ffn,
        router_aux_loss_coef=0.02,
        bos_token_id=1,
        eos_token_id=2,
    )


def _qwen3_moe(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    expert_ffn: int,
    experts: int = 128,
    per_token: int = 8,
    vocab: int = 151936,
) -> ModelConfig:
    # Qwen3-MoE: Qwen3's attention (q/k norms, head_dim 128), 128 narrow experts in every layer, 8
    # per token with their weights renormalised.
    return ModelConfig(
        family="qwen3_moe",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=128,
        intermediate_size=6144,
        max_position_embeddings=40960,
        norm="rmsnorm",
        norm_eps=1e-6,
        activation="silu",
        gated_mlp=True,
        qk_norm="head",
        rotary_base=1000000.0,
        attention_bias=False,
        mlp_bias=False,
        num_experts=experts,
        experts_per_token=per_token,
        moe_intermediate_size=expert_ffn,
        router_norm_topk=True,
        router_aux_loss_coef=0.001,
        bos_token_id=151643,
        eos_token_id=151645,
    )


def _olmo2(
    hidden: int, layers: int, heads: int, ffn: int, kv_heads: int | None = None
) -> ModelConfig:
    # OLMo 2: norms on the attention/MLP outputs, q/k norms over the whole projections, Dolma 2
    # tokenizer (100,352 rows), rope base 500,000, 4096 positions.
    return ModelConfig(
        family="olmo2",
        vocab_size=100352,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=4096,
        norm="rmsnorm",
        norm_eps=1e-6,
        norm_position="output",
        norm_scale_fp32=True,
        activation="silu",
        gated_mlp=True,
        qk_norm="full",
        rotary_base=500000.0,
        attention_bias=False,
        mlp_bias=False,
        eos_token_id=100257,
        pad_token_id=100277,
    )


def _phi3(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int) -> ModelConfig:
    # Phi-3 4k: Llama 2's tokenizer grown to 32,064 rows, a 2047-token sliding window on every
    # layer.
    return ModelConfig(
        family="phi3",
        vocab_size=32064,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=ffn,
        max_position_embeddings=4096,
        norm="rmsnorm",
        norm_eps=1e-5,
        activation="silu",
        gated_mlp=True,
        sliding_window=2047,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=32000,
        pad_token_id=32000,
    )


def _gemma(
    family: str,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    window: int,
    pattern: int,
    head_dim: int = 256,
    query_scalar: int = 256,
    vocab: int = 256000,
    **switches,
) -> ModelConfig:
    # Gemma 2/3: sandwich norms scaling by 1 + weight, GeGLU, embeddings x sqrt(hidden), tied; one
    # global (full-attention) layer per `pattern` layers, the others local (sliding window).
    types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    return ModelConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=ffn,
        norm="rmsnorm",
        norm_eps=1e-6,
        norm_position="sandwich",
        norm_scale_fp32=True,
        norm_unit_offset=True,
        activation="gelu_tanh",
        gated_mlp=True,
        sliding_window=window,
        layer_types=types,
        query_pre_attn_scalar=query_scalar,
        attention_bias=False,
        mlp_bias=False,
        tie_embeddings=True,
        scale_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        **switches,
    )


def _gemma2(hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, **kw) -> ModelConfig:
    # Gemma 2: local/global alternating, 4096-token window, scores capped at 50, logits at 30, 8k
    # context.
    return _gemma(
        "gemma2",
        hidden,
        layers,
        heads,
        kv_heads,
        ffn,
        window=4096,
        pattern=2,
        max_position_embeddings=8192,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        **kw,
    )


def _gemma3(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    window: int = 1024,
    vocab: int = 262208,
    scaling: float | None = 8.0,
    **kw,
) -> ModelConfig:
    # Gemma 3: five local layers per global one, per-head q/k norms, local rotary base 10k, global
    # 1M (linearly scaled by 8 from 4B up, for 128k positions), no soft-capping.
    return _gemma(
        "gemma3_text",
        hidden,
        layers,
        heads,
        kv_heads,
        ffn,
        window=window,
        pattern=6,
        vocab=vocab,
        max_position_embeddings=131072 if scaling else 32768,
        qk_norm="head",
        rotary_base=1000000.0,
        rotary_base_local=10000.0,
        rope_scaling=RopeScaling("linear", scaling) if scaling else None,
        **kw,
    )


def _gpt2(hidden: int, layers: int, heads: int) -> ModelConfig:
    return ModelConfig(
        family="gpt2",
        vocab_size=50257,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        max_position_embeddings=1024,
        activation="gelu_tanh",
        position_embedding="learned",
        tie_embeddings=True,
        bos_token_id=50256,
        eos_token_id=50256,
    )


def _gptj(hidden: int, layers: int, heads: int, rotary_dim: int, vocab: int = 50400) -> ModelConfig:
    return ModelConfig(
        family="gptj",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        activation="gelu_tanh",
        parallel_residual=True,
        shared_norm=True,
        rotary_pct=rotary_dim / (hidden // heads),
        rotary_interleaved=True,
        attention_bias=False,
        lm_head_bias=True,
        bos_token_id=50256,
        eos_token_id=50256,
    )


def _bert(hidden: int, layers: int, heads: int) -> ModelConfig:
    return ModelConfig(
        family="bert",
        vocab_size=30522,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        max_position_embeddings=512,
        norm_eps=1e-12,
        norm_position="post",
        position_embedding="learned",
        causal=False,
        type_vocab_size=2,
        tie_embeddings=True,
        pad_token_id=0,
    )


PRESETS: dict[str, ModelConfig] = {
    "pythia-14m": _neox(128, 6, 4),
    "pythia-70m": _neox(512, 6, 8),
    "pythia-160m": _neox(768, 12, 12),
    "pythia-410m": _neox(1024, 24, 16),
    "pythia-1b": _neox(2048, 16, 8),
    "pythia-1.4b": _neox(2048, 24, 16),
    "pythia-2.8b": _neox(2560, 32, 32),
    "pythia-6.9b": _neox(4096, 32, 32, vocab=50432),
    "pythia-12b": _neox(5120, 36, 40, vocab=50688),
    "gpt-neox-20b": _neox(6144, 44, 64, vocab=50432),
    "llama-2-7b": _llama(4096, 32, 32, 11008),
    "llama-2-13b": _llama(5120, 40, 40, 13824),
    "llama-2-70b": _llama(8192, 80, 64, 28672, kv_heads=8),
    "llama-3.1-8b": _llama3(4096, 32, 32, 14336, factor=8.0),
    "llama-3.1-70b": _llama3(8192, 80, 64, 28672, factor=8.0),
    "llama-3.2-1b": _llama3(2048, 16, 32, 8192, factor=32.0, tied=True),
    "llama-3.2-3b": _llama3(3072, 28, 24, 8192, factor=32.0, tied=True),
    "qwen2.5-0.5b": _qwen25(896, 24, 14, 2, 4864, tied=True),
    "qwen2.5-1.5b": _qwen25(1536, 28, 12, 2, 8960, tied=True),
    "qwen2.5-3b": _qwen25(2048, 36, 16, 2, 11008, tied=True),
    "qwen2.5-7b": _qwen25(3584, 28, 28, 4, 18944),
    "qwen2.5-14b": _qwen25(5120, 48, 40, 8, 13824),
    "qwen2.5-32b": _qwen25(5120, 64, 40, 8, 27648),
    "qwen2.5-72b": _qwen25(8192, 80, 64, 8, 29568),
    "mistral-7b": _mistral(32000, 10000.0, window=4096),
    "mistral-7b-v0.3": _mistral(32768, 1000000.0, window=None),
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, tied=True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, tied=True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, tied=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600),
    "mixtral-8x7b": _mixtral(4096, 32, 32, 14336),
    "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 4, 768),
    "olmo-2-1b": _olmo2(2048, 16, 16, 8192),
    "olmo-2-7b": _olmo2(4096, 32, 32, 11008),
    "olmo-2-13b": _olmo2(5120, 40, 40, 13824),
    "olmo-2-32b": _olmo2(5120, 64, 40, 27648, kv_heads=8),
    "phi-3-mini": _phi3(3072, 32, 32, 32, 8192),
    "phi-3-medium": _phi3(5120, 40, 40, 10, 17920),
    "gemma-2-2b": _gemma2(2304, 26, 8, 4, 9216),
    "gemma-2-9b": _gemma2(3584, 42, 16, 8, 14336),
    "gemma-2-27b": _gemma2(4608, 46, 32, 16, 36864, head_dim=128, query_scalar=144),
    "gemma-3-1b": _gemma3(1152, 26, 4, 1, 6912, window=512, vocab=262144, scaling=None),
    "gemma-3-4b": _gemma3(2560, 34, 8, 4, 10240),
    "gemma-3-12b": _gemma3(3840, 48, 16, 8, 15360),
    "gemma-3-27b": _gemma3(5376, 62, 32, 16, 21504, head_dim=128, query_scalar=168),
    "gpt2": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
    "gpt-j-6b": _gptj(4096, 28, 16, rotary_dim=64),
    "bert-base-uncased": _bert(768, 12, 12),
    "bert-large-uncased": _bert(1024, 24, 16),
    # Tiny shapes for tests and smoke runs: same switches as the family, minutes on a laptop CPU.
    "tiny-neox": replace(_neox(64, 2, 4, vocab=1000), max_position_embeddings=256),
    "tiny-llama": replace(
        _llama(64, 2, 4, 160, kv_heads=2), vocab_size=1000, max_position_embeddings=256
    ),
    "tiny-llama3": replace(
        _llama3(64, 2, 4, 160, factor=8.0, tied=True, kv_heads=2),
        vocab_size=1000,
        max_position_embeddings=256,
    ),
    "tiny-qwen2": replace(
        _qwen25(64, 2, 4, 2, 160, tied=True), vocab_size=1000, max_position_embeddings=256
    ),
    "tiny-mistral": replace(
        _mistral(1000, 10000.0, 8, hidden=64, layers=2, heads=4, kv_heads=2, ffn=160),
        max_position_embeddings=256,
    ),
    "tiny-qwen3": replace(
        _qwen3(64, 2, 4, 160, tied=True, kv_heads=2),
        head_dim=32,
        vocab_size=1000,
        max_position_embeddings=256,
    ),
    "tiny-mixtral": replace(
        _mixtral(64, 2, 4, 96, experts=4, kv_heads=2, vocab=1000), max_position_embeddings=256
    ),
    "tiny-qwen3-moe": replace(
        _qwen3_moe(64, 2, 4, 2, 48, experts=8, per_token=2, vocab=1000),
        head_dim=32,
        intermediate_size=96,
        max_position_embeddings=256,
    ),
    "tiny-olmo2": replace(
        _olmo2(64, 2, 4, 160, kv_heads=2),
        vocab_size=1000,
        max_position_embeddings=256,
        eos_token_id=0,
        pad_token_id=1,
    ),
    "tiny-phi3": replace(
        _phi3(64, 2, 4, 2, 160),
        vocab_size=1000,
        max_position_embeddings=256,
        sliding_window=8,
        eos_token_id=2,
        pad_token_id=0,
    ),
    "tiny-gemma2": replace(
        _gemma2(64, 2, 4, 2, 160, head_dim=32, query_scalar=32, vocab=1000),
        sliding_window=8,
        max_position_embeddings=256,
    ),
    "tiny-gemma3": replace(
        _gemma(
            "gemma3_text",
            64,
            6,
            4,
            2,
            160,
            window=8,
            pattern=3,
            head_dim=32,
            query_scalar=32,
            vocab=1000,
            qk_norm="head",
            rotary_base=1000000.0,
            rotary_base_local=10000.0,
            rope_scaling=RopeScaling("linear", 8.0),
        ),
        max_position_embeddings=256,
    ),
    "tiny-gpt2": replace(_gpt2(64, 2, 4), vocab_size=1000, max_position_embeddings=256),
    "tiny-gptj": replace(_gptj(64, 2, 4, rotary_dim=8, vocab=1000), max_position_embeddings=256),
    "tiny-bert": replace(_bert(64, 2, 4), vocab_size=1000, max_position_embeddings=256),
}


def preset(name: str) -> ModelConfig:
    """A fresh copy of the named preset's config (nested sections included)."""
    if name not in PRESETS:
        raise UserError(
            f"unknown model preset '{name}'{closest(name, PRESETS)}: see `lmforge.models.PRESETS`"
        )
    return copy.deepcopy(PRESETS[name])


# Fields a preset derives from others when it leaves them out, and what from: ModelConfig's
# defaults.
DERIVED = {
    "head_dim": ("hidden_size", "num_heads"),
    "num_kv_heads": ("num_heads",),
    "intermediate_size": ("hidden_size",),
    "qkv_bias": ("attention_bias",),
}


def preset_fields(base: ModelConfig, overrides: dict[str, Any]) -> dict[str, Any]:
    """The preset's fields under the recipe's overrides. A value the preset derived (head_dim =
    hidden_size / num_heads, num_kv_heads = num_heads, intermediate_size = 4 x hidden_size,
    qkv_bias = attention_bias) is derived again from the overridden fields, as writing the fields
    out would: model.hidden_size=128 on a preset of 4 heads of 16 is 4 heads of 32, not a
    head_dim 16 that no longer fits. Values the preset sets apart from that rule stay, and a
    shape they cannot fit fails in ModelConfig."""
    derived_from = {
        "head_dim": base.hidden_size % base.num_heads == 0
        and base.head_dim == base.hidden_size // base.num_heads,
        "num_kv_heads": base.num_kv_heads == base.num_heads,
        "intermediate_size": base.intermediate_size == 4 * base.hidden_size,
        "qkv_bias": base.qkv_bias == base.attention_bias,
    }
    fields = dataclasses.asdict(base)
    for name, basis in DERIVED.items():
        if derived_from[name] and name not in overrides and any(k in overrides for k in basis):
            fields[name] = None
    return {**fields, **overrides}
