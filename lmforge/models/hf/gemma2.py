"""Gemma 2 <-> Hugging Face Gemma2ForCausalLM: Llama's layout with sandwich norms (before and
after attention and MLP) scaling by 1 + weight, GeGLU, embeddings times sqrt(hidden), attention
scaled by query_pre_attn_scalar, soft-capped attention scores and logits, local (sliding-window)
and global layers alternating, tied embeddings."""

from __future__ import annotations

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import HFAdapter, Mapping, architecture, require
from lmforge.models.hf.llama import LLAMA_SWITCHES, llama_config, llama_layout
from lmforge.models.hf.rope import rope_to_hf

# What Gemma 2 and 3 hard-wire on top of Llama's block.
GEMMA_SWITCHES = {
    **LLAMA_SWITCHES,
    "sliding_window": ...,
    "norm_position": "sandwich",
    "norm_scale_fp32": True,
    "norm_unit_offset": True,
    "activation": "gelu_tanh",
    "scale_embeddings": True,
    "tie_embeddings": True,
    "rotary_pct": 1.0,
    "mlp_bias": False,
    "query_pre_attn_scalar": ...,
    "attn_logit_softcapping": ...,
    "final_logit_softcapping": ...,
}


def gemma_activation(hf: dict) -> str:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_new"):  # both are GELU's tanh approximation
        raise UserError(
            f"hidden_activation '{act}' in config.json is not supported for {hf['model_type']}: lmforge "
            "has gelu_pytorch_tanh"
        )
    return "gelu_tanh"


def gemma_layer_types(hf: dict, pattern: int) -> list[str]:
    """transformers 5's layer_types, else every `pattern`-th layer global (Gemma 2: 2, Gemma 3:
    6)."""
    n = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern") or pattern
    return hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]


def gemma_common(cfg: ModelConfig) -> dict:
    """config.json fields Gemma 2 and 3 share."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": cfg.query_pre_attn_scalar,
        "sliding_window": cfg.sliding_window,
        "layer_types": [
            ("sliding_attention" if cfg.window(i) else "full_attention")
            for i in range(cfg.num_layers)
        ],
        "final_logit_softcapping": cfg.final_logit_softcapping,
        "attn_logit_softcapping": cfg.attn_logit_softcapping,
        "attention_bias": cfg.attention_bias,
        "tie_word_embeddings": True,
        "initializer_range": cfg.init_std,
        "attention_dropout": cfg.attention_dropout,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "use_cache": True,
    }


def gemma_config(
    hf: dict, keys: list[str], family: str, pattern: int, positions: int, **switches
) -> ModelConfig:
    """Llama's fields (llama_config) with what Gemma 2 and 3 read their own way or hard-wire;
    `pattern`: every how many layers one is global where config.json gives no layer_types,
    `positions`: the family's default context."""
    bias = hf.get("attention_bias", False)
    return llama_config(
        hf,
        keys,
        family,
        positions=positions,
        eps=1e-6,
        head_dim=hf.get("head_dim") or 256,
        norm_position="sandwich",
        norm_scale_fp32=True,
        norm_unit_offset=True,
        activation=gemma_activation(hf),
        sliding_window=hf.get("sliding_window"),
        layer_types=gemma_layer_types(hf, pattern) if hf.get("sliding_window") else None,
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        qkv_bias=bias,
        attention_bias=bias,
        mlp_bias=False,
        tie_embeddings=True,
        scale_embeddings=True,
        **switches,
    )


class Gemma2Adapter(HFAdapter):
    model_type = "gemma2"

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        return gemma_config(
            hf,
            keys,
            "gemma2",
            pattern=2,
            positions=8192,
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(
            cfg,
            {**GEMMA_SWITCHES, "qkv_bias": cfg.attention_bias, "rotary_base_local": None},
            self.model_type,
        )
        return {
            **architecture(cfg, "Gemma2", "ForCausalLM"),
            "model_type": "gemma2",
            **gemma_common(cfg),
            **rope_to_hf(cfg),
        }

    def mapping(self, cfg: ModelConfig) -> Mapping:
        return llama_layout(cfg)
