"""Qwen2 / Qwen2.5 <-> Hugging Face Qwen2ForCausalLM: Llama's layout with biased q/k/v (o_proj without),
tied embeddings in the small sizes."""

from __future__ import annotations

from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import (
    HFAdapter,
    Mapping,
    activation_from_hf,
    activation_to_hf,
    architecture,
    decoder_num_labels,
    require,
)
from lmforge.models.hf.llama import LLAMA_SWITCHES, llama_layout
from lmforge.models.hf.rope import rope_from_hf, rope_to_hf


class Qwen2Adapter(HFAdapter):
    model_type = "qwen2"
    # What Qwen2's modeling code hard-wires: a config with other values cannot be written as a qwen2 folder.
    fixed = {**LLAMA_SWITCHES, "sliding_window": ..., "rotary_pct": 1.0, "qkv_bias": True, "attention_bias": False,
             "mlp_bias": False}

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        theta, pct, scaling = rope_from_hf(hf)
        heads = hf["num_attention_heads"]
        window, layer_types = window_from_hf(hf)
        return ModelConfig(
            family="qwen2",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            activation=activation_from_hf(hf.get("hidden_act", "silu")),
            gated_mlp=True,
            rotary_pct=pct,
            rotary_base=theta,
            rope_scaling=scaling,
            sliding_window=window,
            layer_types=layer_types,
            qkv_bias=True,
            attention_bias=False,
            mlp_bias=False,
            tie_embeddings=hf.get("tie_word_embeddings", False),
            init_std=hf.get("initializer_range", 0.02),
            attention_dropout=hf.get("attention_dropout", 0.0),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            num_labels=decoder_num_labels(hf, keys),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(cfg, self.fixed, self.model_type)
        return {
            **architecture(cfg, "Qwen2", "ForCausalLM"),
            "model_type": "qwen2",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_eps,
            "hidden_act": activation_to_hf(cfg.activation),
            **rope_to_hf(cfg),
            **window_to_hf(cfg),
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std,
            "attention_dropout": cfg.attention_dropout,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
            "use_cache": True,
        }

    def mapping(self, cfg: ModelConfig) -> Mapping:
        return llama_layout(cfg)


def window_from_hf(hf: dict) -> tuple[int | None, list[str] | None]:
    """Qwen2/Qwen3's (sliding_window, layer_types): a window only with use_sliding_window, on the layers from
    max_window_layers on (transformers 4.x), or on those layer_types names (5.x)."""
    if not hf.get("use_sliding_window"):
        return None, None
    window, n = hf.get("sliding_window"), hf["num_hidden_layers"]
    first = hf.get("max_window_layers", n)
    layer_types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return window, layer_types


def window_to_hf(cfg: ModelConfig) -> dict:
    types = [("sliding_attention" if cfg.window(i) else "full_attention") for i in range(cfg.num_layers)]
    first = types.index("sliding_attention") if "sliding_attention" in types else cfg.num_layers
    return {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "max_window_layers": first, "layer_types": types}
