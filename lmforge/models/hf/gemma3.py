"""Gemma 3 (text) <-> Hugging Face Gemma3ForCausalLM (model_type gemma3_text): Gemma 2's block
without the soft-capping, with an RMSNorm over each query and key head, five local layers
(sliding window, their own rotary base, unscaled) to every global one, and the global layers'
rotary linearly scaled in 4B and up."""

from __future__ import annotations

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import HFAdapter, Mapping, architecture, require
from lmforge.models.hf.gemma2 import GEMMA_SWITCHES, gemma_common, gemma_config
from lmforge.models.hf.llama import llama_layout
from lmforge.models.hf.rope import rope_from_hf, rope_parameters


class Gemma3TextAdapter(HFAdapter):
    model_type = "gemma3_text"

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        nested = hf.get("rope_parameters") or {}
        # transformers 5: one dict per layer type
        if "full_attention" in nested or "sliding_attention" in nested:
            theta, pct, scaling = rope_from_hf(
                hf, nested.get("full_attention") or {}, default_theta=1e6
            )
            local, _, local_scaling = rope_from_hf(
                hf, nested.get("sliding_attention") or {}, default_theta=1e4
            )
            if local_scaling is not None:
                raise UserError(
                    f"rope scaling '{local_scaling.type}' on the sliding-window layers in config.json is "
                    "not supported: lmforge scales the global layers' rotary only"
                )
        # 4.x: rope_theta and rope_scaling for the global layers, rope_local_base_freq for
        # the local ones
        else:
            theta, pct, scaling = rope_from_hf(
                hf, {**(hf.get("rope_scaling") or {})}, default_theta=1e6
            )
            local = hf.get("rope_local_base_freq", 10000.0)
        return gemma_config(
            hf,
            keys,
            "gemma3_text",
            pattern=6,
            positions=131072,
            rotary_pct=pct,
            rotary_base=theta,
            rope_scaling=scaling,
            rotary_base_local=local,
            qk_norm="head",
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(
            cfg,
            {
                **GEMMA_SWITCHES,
                "qkv_bias": cfg.attention_bias,
                "qk_norm": "head",
                "rotary_base_local": ...,
            },
            self.model_type,
        )
        local = cfg.rotary_base_local if cfg.rotary_base_local is not None else cfg.rotary_base
        rope = {
            "full_attention": rope_parameters(cfg),
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }
        legacy = {  # what transformers 4.x reads instead
            "rope_theta": cfg.rotary_base,
            "rope_local_base_freq": local,
            "rope_scaling": {k: v for k, v in rope["full_attention"].items() if k != "rope_theta"}
            if cfg.rope_scaling is not None
            else None,
        }
        return {
            **architecture(cfg, "Gemma3", "ForCausalLM"),
            "model_type": "gemma3_text",
            **gemma_common(cfg),
            **legacy,
            "rope_parameters": rope,
        }

    def mapping(self, cfg: ModelConfig) -> Mapping:
        return llama_layout(cfg)


# Gemma3TextConfig's defaults: a multimodal config.json's text_config lists only the fields that
# differ from them (gemma-3-4b: width, MLP, depth, window, rope scaling).
_TEXT_DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


class Gemma3Adapter(Gemma3TextAdapter):
    """Gemma 3 4B/12B/27B as published (Gemma3ForConditionalGeneration, model_type gemma3): its
    language model, read from text_config and the language_model.* tensors; the vision tower and
    projector are left out. Import only: the export is the text model (gemma3_text,
    Gemma3ForCausalLM)."""

    model_type = "gemma3"
    ignorable = (*HFAdapter.ignorable, "vision_tower.", "multi_modal_projector.")

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        text = {
            **_TEXT_DEFAULTS,
            **{k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf},
            **(hf.get("text_config") or {}),
            "model_type": "gemma3",
        }
        return super().config_from_hf(text, [k.removeprefix("language_model.") for k in keys])

    def aliases(self, name: str) -> list[str]:
        # transformers saves the language model as language_model.model.* (+
        # language_model.lm_head); in memory, and in some conversions, it is model.language_model.*
        inner = name.removeprefix("model.")
        return [f"language_model.{name}", f"model.language_model.{inner}"]
