"""Phi-3 <-> Hugging Face Phi3ForCausalLM: Llama's block with q, k and v fused in one qkv_proj ([q; k; v] rows)
and gate and up in one gate_up_proj ([gate; up] rows); Phi-3-mini/medium 4k attend through a 2047-token window,
the 128k releases and Phi-3.5 rotate by LongRoPE."""

from __future__ import annotations

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import (
    FIRST_HALF,
    PLAIN,
    QKV_ROWS,
    SECOND_HALF,
    HFAdapter,
    Mapping,
    activation_from_hf,
    activation_to_hf,
    architecture,
    decoder_head,
    decoder_num_labels,
    module_rows,
    require,
)
from lmforge.models.hf.llama import LLAMA_SWITCHES
from lmforge.models.hf.rope import rope_from_hf, rope_parameters


class Phi3Adapter(HFAdapter):
    model_type = "phi3"
    # One window for every layer; Phi3Config accepts default and longrope rotary only (checked in config_to_hf).
    fixed = {**LLAMA_SWITCHES, "sliding_window": ..., "layer_types": None, "qkv_bias": False, "attention_bias": False,
             "mlp_bias": False}

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        theta, pct, scaling = rope_from_hf(hf)
        heads = hf["num_attention_heads"]
        return ModelConfig(
            family="phi3",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
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
            tie_embeddings=hf.get("tie_word_embeddings", False),
            init_std=hf.get("initializer_range", 0.02),
            # One dropout rate in lmforge: Phi-3's residual one (its embedding dropout is the same in every release).
            dropout=hf.get("resid_pdrop", 0.0),
            attention_dropout=hf.get("attention_dropout", 0.0),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            num_labels=decoder_num_labels(hf, keys),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(cfg, self.fixed, self.model_type)
        scaling = cfg.rope_scaling
        if scaling is not None and scaling.type != "longrope":
            raise UserError(f"a phi3 checkpoint has default or longrope rotary, this model has rope scaling "
                            f"'{scaling.type}': it cannot be written as that family")
        rope = rope_parameters(cfg)
        return {
            **architecture(cfg, "Phi3", "ForCausalLM"),
            "model_type": "phi3",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads,
            "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "original_max_position_embeddings": (scaling.original_max_position_embeddings if scaling is not None
                                                 else cfg.max_position_embeddings),
            "rms_norm_eps": cfg.norm_eps,
            "hidden_act": activation_to_hf(cfg.activation),
            "rope_theta": cfg.rotary_base,
            "rope_scaling": rope if scaling is not None else None,  # what transformers 4.x reads
            "rope_parameters": rope,
            "sliding_window": cfg.sliding_window,
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attention_dropout": cfg.attention_dropout,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
            "use_cache": True,
        }

    def mapping(self, cfg: ModelConfig) -> Mapping:
        rows: Mapping = [("embed.weight", "model.embed_tokens.weight", PLAIN)]
        for i in range(cfg.num_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            rows += module_rows(f"{ours}.norm1", f"{hf}.input_layernorm", False)
            rows += [(f"{ours}.attn.qkv.weight", f"{hf}.self_attn.qkv_proj.weight", QKV_ROWS)]
            rows += module_rows(f"{ours}.attn.proj", f"{hf}.self_attn.o_proj", False)
            rows += module_rows(f"{ours}.norm2", f"{hf}.post_attention_layernorm", False)
            rows += [(f"{ours}.mlp.gate.weight", f"{hf}.mlp.gate_up_proj.weight", FIRST_HALF),
                     (f"{ours}.mlp.up.weight", f"{hf}.mlp.gate_up_proj.weight", SECOND_HALF)]
            rows += module_rows(f"{ours}.mlp.down", f"{hf}.mlp.down_proj", False)
        rows += module_rows("norm", "model.norm", False)
        return rows + decoder_head(cfg, [("lm_head.weight", "lm_head.weight", PLAIN)])
