"""Qwen3-MoE <-> Hugging Face Qwen3MoeForCausalLM: Qwen3's attention (q/k RMSNorm per head,
explicit head_dim) with a mixture of SwiGLU experts of moe_intermediate_size on every
decoder_sparse_step-th layer not in mlp_only_layers (the others keep a dense MLP of
intermediate_size); the chosen experts' softmax weights are renormalised only with
norm_topk_prob."""

from __future__ import annotations

from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import (
    HFAdapter,
    Mapping,
    require,
)
from lmforge.models.hf.llama import (
    LLAMA_SWITCHES,
    hf_head_dim,
    llama_config,
    llama_config_json,
    llama_layout,
)


class Qwen3MoeAdapter(HFAdapter):
    model_type = "qwen3_moe"
    # One sliding window (use_sliding_window) applies to every layer.
    fixed = {
        **LLAMA_SWITCHES,
        "sliding_window": ...,
        "layer_types": None,
        "qk_norm": "head",
        "rotary_pct": 1.0,
        "mlp_bias": False,
        "num_experts": ...,
    }

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        bias = hf.get("attention_bias", False)
        return llama_config(
            hf,
            keys,
            "qwen3_moe",
            positions=32768,
            eps=1e-6,
            head_dim=hf_head_dim(hf),
            qk_norm="head",
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
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(cfg, {**self.fixed, "qkv_bias": cfg.attention_bias}, self.model_type)
        return llama_config_json(
            cfg,
            "Qwen3Moe",
            self.model_type,
            head_dim=cfg.head_dim,
            use_sliding_window=cfg.sliding_window is not None,
            sliding_window=cfg.sliding_window,
            attention_bias=cfg.attention_bias,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.router_norm_topk,
            decoder_sparse_step=cfg.moe_every,
            mlp_only_layers=cfg.dense_layers or [],
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            output_router_logits=False,
        )

    def mapping(self, cfg: ModelConfig) -> Mapping:
        return llama_layout(cfg, experts=("mlp", "gate_proj", "up_proj", "down_proj"))
