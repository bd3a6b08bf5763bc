"""OLMo 2 <-> Hugging Face Olmo2ForCausalLM: Llama's layout with the norms moved onto the branch outputs
(x + norm(attn(x)), x + norm(mlp(x)); no input norms) and an RMSNorm over the whole q and k projections."""

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


class Olmo2Adapter(HFAdapter):
    model_type = "olmo2"
    fixed = {**LLAMA_SWITCHES, "norm_position": "output", "qk_norm": "full", "norm_scale_fp32": True,
             "rotary_pct": 1.0, "mlp_bias": False}

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        theta, pct, scaling = rope_from_hf(hf)
        heads = hf["num_attention_heads"]
        bias = hf.get("attention_bias", False)
        return ModelConfig(
            family="olmo2",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-5),
            norm_position="output",
            norm_scale_fp32=True,
            activation=activation_from_hf(hf.get("hidden_act", "silu")),
            gated_mlp=True,
            qk_norm="full",
            rotary_pct=pct,
            rotary_base=theta,
            rope_scaling=scaling,
            qkv_bias=bias,
            attention_bias=bias,
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
        require(cfg, {**self.fixed, "qkv_bias": cfg.attention_bias}, self.model_type)
        return {
            **architecture(cfg, "Olmo2", "ForCausalLM"),
            "model_type": "olmo2",
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
            "attention_bias": cfg.attention_bias,
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
