"""Mixtral <-> Hugging Face MixtralForCausalLM: Mistral's attention (grouped-query, an optional
sliding window on every layer) with a mixture of SwiGLU experts in every layer: a router
(block_sparse_moe.gate) choosing num_experts_per_tok of num_local_experts experts (w1 gate, w3
up, w2 down), their softmax weights renormalised."""

from __future__ import annotations

from lmforge.errors import UserError
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


class MixtralAdapter(HFAdapter):
    model_type = "mixtral"
    # MixtralForCausalLM hard-wires these: no biases, every layer a MoE layer renormalising its
    # top-k weights.
    fixed = {
        **LLAMA_SWITCHES,
        "sliding_window": ...,
        "layer_types": None,
        "rotary_pct": 1.0,
        "qkv_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
        "num_experts": ...,
        "router_norm_topk": True,
        "moe_every": 1,
        "dense_layers": None,
    }

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        if hf.get("router_jitter_noise"):
            raise UserError(
                f"router_jitter_noise {hf['router_jitter_noise']} in config.json is not supported: "
                "lmforge routes without jitter (set it to 0.0)"
            )
        return llama_config(
            hf,
            keys,
            "mixtral",
            positions=131072,
            eps=1e-5,
            head_dim=hf_head_dim(hf),
            sliding_window=hf.get("sliding_window"),
            attention_bias=False,
            mlp_bias=False,
            num_experts=hf.get("num_local_experts", 8),
            experts_per_token=hf.get("num_experts_per_tok", 2),
            moe_intermediate_size=hf["intermediate_size"],
            router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(
            cfg, {**self.fixed, "moe_intermediate_size": cfg.intermediate_size}, self.model_type
        )
        return llama_config_json(
            cfg,
            "Mixtral",
            self.model_type,
            # transformers derives it (and writes null) when it is hidden_size / heads
            head_dim=None if cfg.head_dim * cfg.num_heads == cfg.hidden_size else cfg.head_dim,
            sliding_window=cfg.sliding_window,
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            router_jitter_noise=0.0,
            output_router_logits=False,
        )

    def mapping(self, cfg: ModelConfig) -> Mapping:
        return llama_layout(cfg, experts=("block_sparse_moe", "w1", "w3", "w2"))
