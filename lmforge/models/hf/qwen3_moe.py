"""Qwen3-MoE <-> Hugging Face Qwen3MoeForCausalLM: Qwen3's attention (q/k RMSNorm per head, explicit head_dim)
with a mixture of SwiGLU experts of moe_intermediate_size on every decoder_sparse_step-th layer not in
mlp_only_layers (the others keep a dense MLP of intermediate_size); the chosen experts' softmax weights are
renormalised only with norm_topk_prob."""

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


class Qwen3MoeAdapter(HFAdapter):
    model_type = "qwen3_moe"
    # One sliding window (use_sliding_window) applies to every layer.
    fixed = {**LLAMA_SWITCHES, "sliding_window": ..., "layer_types": None, "qk_norm": "head", "rotary_pct": 1.0,
             "mlp_bias": False, "num_experts": ...}

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        theta, pct, scaling = rope_from_hf(hf)
        heads = hf["num_attention_heads"]
        bias = hf.get("attention_bias", False)
        return ModelConfig(
            family="qwen3_moe",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            activation=activation_from_hf(hf.get("hidden_act", "silu")),
            gated_mlp=True,
            qk_norm="head",
            rotary_pct=pct,
            rotary_base=theta,
            rope_scaling=scaling,
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window") else None,
            qkv_bias=bias,
            attention_bias=bias,
            mlp_bias=False,
            num_experts=hf.get("num_experts", hf.get("num_local_experts", 128)),
            experts_per_token=hf.get("num_experts_per_tok", 8),
            moe_intermediate_size=hf.get("moe_intermediate_size", 768),
            router_norm_topk=hf.get("norm_topk_prob", False),
            moe_every=hf.get("decoder_sparse_step", 1),
            dense_layers=hf.get("mlp_only_layers") or None,
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
        require(cfg, {**self.fixed, "qkv_bias": cfg.attention_bias}, self.model_type)
        return {
            **architecture(cfg, "Qwen3Moe", "ForCausalLM"),
            "model_type": "qwen3_moe",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.norm_eps,
            "hidden_act": activation_to_hf(cfg.activation),
            **rope_to_hf(cfg),
            "use_sliding_window": cfg.sliding_window is not None,
            "sliding_window": cfg.sliding_window,
            "attention_bias": cfg.attention_bias,
            "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": cfg.router_norm_topk,
            "decoder_sparse_step": cfg.moe_every,
            "mlp_only_layers": cfg.dense_layers or [],
            "router_aux_loss_coef": cfg.router_aux_loss_coef,
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
        return llama_layout(cfg, experts=("mlp", "gate_proj", "up_proj", "down_proj"))
