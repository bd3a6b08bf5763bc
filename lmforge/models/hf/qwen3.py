"""Qwen3 <-> Hugging Face Qwen3ForCausalLM: Llama's layout with an RMSNorm over each query and
key head before the rotation (q_norm/k_norm), an explicit head_dim (128 whatever the width) and
no q/k/v bias."""

from __future__ import annotations

from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import (
    HFAdapter,
    Mapping,
    require,
)
from lmforge.models.hf.llama import LLAMA_SWITCHES, llama_config, llama_config_json, llama_layout
from lmforge.models.hf.qwen2 import window_from_hf, window_to_hf


class Qwen3Adapter(HFAdapter):
    model_type = "qwen3"
    fixed = {
        **LLAMA_SWITCHES,
        "sliding_window": ...,
        "qk_norm": "head",
        "rotary_pct": 1.0,
        "mlp_bias": False,
    }

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        window, layer_types = window_from_hf(hf)
        bias = hf.get("attention_bias", False)
        return llama_config(
            hf,
            keys,
            "qwen3",
            positions=32768,
            eps=1e-6,
            head_dim=hf.get("head_dim") or 128,
            qk_norm="head",
            sliding_window=window,
            layer_types=layer_types,
            qkv_bias=bias,
            attention_bias=bias,
            mlp_bias=False,
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(cfg, {**self.fixed, "qkv_bias": cfg.attention_bias}, self.model_type)
        return llama_config_json(
            cfg,
            "Qwen3",
            self.model_type,
            head_dim=cfg.head_dim,
            **window_to_hf(cfg),
            attention_bias=cfg.attention_bias,
        )

    def mapping(self, cfg: ModelConfig) -> Mapping:
        return llama_layout(cfg)
