"""Mixtral <-> Hugging Face MixtralForCausalLM: Mistral's attention (grouped-query, an optional sliding window on
every layer) with a mixture of SwiGLU experts in every layer: a router (block_sparse_moe.gate) choosing
num_experts_per_tok of num_local_experts experts (w1 gate, w3 up, w2 down), their softmax weights renormalised."""

from __future__ import annotations

from lmforge.errors import UserError
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


class MixtralAdapter(HFAdapter):
    model_type = "mixtral"
    # MixtralForCausalLM hard-wires these: no biases, every layer a MoE layer renormalising its top-k weights.
    fixed = {**LLAMA_SWITCHES, "sliding_window": ..., "layer_types": None, "rotary_pct": 1.0, "qkv_bias": False,
             "attention_bias": False, "mlp_bias": False, "num_experts": ..., "router_norm_topk": True, "moe_every": 1,
             "dense_layers": None}

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        if hf.get("router_jitter_noise"):
            raise UserError(f"router_jitter_noise {hf['router_jitter_noise']} in config.json is not supported: "
                            "lmforge routes without jitter (set it to 0.0)")
        theta, pct, scaling = rope_from_hf(hf)
        heads = hf["num_attention_heads"]
        return ModelConfig(
            family="mixtral",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 131072),
            norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-5),
            activation=activation_from_hf(hf.get("hidden_act", "silu")),
            gated_mlp=True,
            rotary_pct=pct,
            rotary_base=theta,
            rope_scaling=scaling,
            sliding_window=hf.get("sliding_window"),
            attention_bias=False,
            mlp_bias=False,
            num_experts=hf.get("num_local_experts", 8),
            experts_per_token=hf.get("num_experts_per_tok", 2),
            moe_intermediate_size=hf["intermediate_size"],
            router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
            tie_embeddings=hf.get("tie_word_embeddings", False),
            init_std=hf.get("initializer_range", 0.02),
            attention_dropout=hf.get("attention_dropout", 0.0),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            num_labels=decoder_num_labels(hf, keys),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(cfg, {**self.fixed, "moe_intermediate_size": cfg.intermediate_size}, self.model_type)
        return {
            **architecture(cfg, "Mixtral", "ForCausalLM"),
            "model_type": "mixtral",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            # transformers derives it (and writes null) when it is hidden_size / heads
            "head_dim": None if cfg.head_dim * cfg.num_heads == cfg.hidden_size else cfg.head_dim,
            "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_eps,
            "hidden_act": activation_to_hf(cfg.activation),
            **rope_to_hf(cfg),
            "sliding_window": cfg.sliding_window,
            "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std,
            "attention_dropout": cfg.attention_dropout,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
            "use_cache": True,
        }

    def mapping(self, cfg: ModelConfig) -> Mapping:
        return llama_layout(cfg, experts=("block_sparse_moe", "w1", "w3", "w2"))
