"""OLMo 2 <-> Hugging Face Olmo2ForCausalLM: Llama's layout with the norms moved onto the branch
outputs (x + norm(attn(x)), x + norm(mlp(x)); no input norms) and an RMSNorm over the whole q and
k projections."""

from __future__ import annotations

from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import (
    HFAdapter,
    Mapping,
    require,
)
from lmforge.models.hf.llama import LLAMA_SWITCHES, llama_config, llama_config_json, llama_layout


class Olmo2Adapter(HFAdapter):
    model_type = "olmo2"
    fixed = {
        **LLAMA_SWITCHES,
        "norm_position": "output",
        "qk_norm": "full",
        "norm_scale_fp32": True,
        "rotary_pct": 1.0,
        "mlp_bias": False,
    }

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        bias = hf.get("attention_bias", False)
        return llama_config(
            hf,
            keys,
            "olmo2",
            positions=2048,
            eps=1e-5,
            norm_position="output",
            norm_scale_fp32=True,
            qk_norm="full",
            qkv_bias=bias,
            attention_bias=bias,
            mlp_bias=False,
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(cfg, {**self.fixed, "qkv_bias": cfg.attention_bias}, self.model_type)
        return llama_config_json(cfg, "Olmo2", self.model_type, attention_bias=cfg.attention_bias)

    def mapping(self, cfg: ModelConfig) -> Mapping:
        return llama_layout(cfg)
