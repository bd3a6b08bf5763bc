"""Mistral <-> Hugging Face MistralForCausalLM: Llama's layout, grouped-query attention and,
where config.json sets sliding_window (Mistral 7B v0.1: 4096), sliding-window attention on every
layer."""

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


class MistralAdapter(HFAdapter):
    model_type = "mistral"
    # MistralForCausalLM hard-wires these; its one sliding_window applies to every layer
    # (layer_types None).
    fixed = {
        **LLAMA_SWITCHES,
        "sliding_window": ...,
        "layer_types": None,
        "rotary_pct": 1.0,
        "qkv_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
    }

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        return llama_config(
            hf,
            keys,
            "mistral",
            positions=131072,
            eps=1e-6,
            head_dim=hf_head_dim(hf),
            sliding_window=hf.get("sliding_window"),
            attention_bias=False,
            mlp_bias=False,
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(cfg, self.fixed, self.model_type)
        return llama_config_json(
            cfg,
            "Mistral",
            self.model_type,
            head_dim=cfg.head_dim,
            sliding_window=cfg.sliding_window,
        )

    def mapping(self, cfg: ModelConfig) -> Mapping:
        return llama_layout(cfg)
