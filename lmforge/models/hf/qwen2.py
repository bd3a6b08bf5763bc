"""Qwen2 / Qwen2.5 <-> Hugging Face Qwen2ForCausalLM: Llama's layout with biased q/k/v (o_proj
without), tied embeddings in the small sizes."""

from __future__ import annotations

from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import (
    HFAdapter,
    Mapping,
    require,
)
from lmforge.models.hf.llama import LLAMA_SWITCHES, llama_config, llama_config_json, llama_layout


class Qwen2Adapter(HFAdapter):
    model_type = "qwen2"
    # What Qwen2's modeling code hard-wires: a config with other values cannot be written as a qwen2
    # folder.
    fixed = {
        **LLAMA_SWITCHES,
        "sliding_window": ...,
        "rotary_pct": 1.0,
        "qkv_bias": True,
        "attention_bias": False,
        "mlp_bias": False,
    }

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        window, layer_types = window_from_hf(hf)
        return llama_config(
            hf,
            keys,
            "qwen2",
            positions=32768,
            eps=1e-6,
            sliding_window=window,
            layer_types=layer_types,
            qkv_bias=True,
            attention_bias=False,
            mlp_bias=False,
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(cfg, self.fixed, self.model_type)
        return llama_config_json(cfg, "Qwen2", self.model_type, **window_to_hf(cfg))

    def mapping(self, cfg: ModelConfig) -> Mapping:
        return llama_layout(cfg)


def window_from_hf(hf: dict) -> tuple[int | None, list[str] | None]:
    """Qwen2/Qwen3's (sliding_window, layer_types): a window only with use_sliding_window, on the
    layers from max_window_layers on (transformers 4.x), or on those layer_types names (5.x)."""
    if not hf.get("use_sliding_window"):
        return None, None
    window, n = hf.get("sliding_window"), hf["num_hidden_layers"]
    first = hf.get("max_window_layers", n)
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n)
    ]
    return window, layer_types


def window_to_hf(cfg: ModelConfig) -> dict:
    types = [
        ("sliding_attention" if cfg.window(i) else "full_attention") for i in range(cfg.num_layers)
    ]
    first = types.index("sliding_attention") if "sliding_attention" in types else cfg.num_layers
    return {
        "use_sliding_window": cfg.sliding_window is not None,
        "sliding_window": cfg.sliding_window,
        "max_window_layers": first,
        "layer_types": types,
    }
