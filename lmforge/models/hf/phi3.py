"""Phi-3 <-> Hugging Face Phi3ForCausalLM: Llama's block with q, k and v fused in one qkv_proj
([q; k; v] rows) and gate and up in one gate_up_proj ([gate; up] rows); Phi-3-mini/medium 4k
attend through a 2047-token window, the 128k releases and Phi-3.5 rotate by LongRoPE."""

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
    decoder_head,
    module_rows,
    require,
)
from lmforge.models.hf.llama import LLAMA_SWITCHES, llama_config, llama_config_json
from lmforge.models.hf.rope import rope_parameters


class Phi3Adapter(HFAdapter):
    model_type = "phi3"
    # One window for every layer; Phi3Config accepts default and longrope rotary only (checked in
    # config_to_hf).
    fixed = {
        **LLAMA_SWITCHES,
        "sliding_window": ...,
        "layer_types": None,
        "qkv_bias": False,
        "attention_bias": False,
        "mlp_bias": False,
    }

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        # One dropout rate in lmforge: Phi-3's residual one (its embedding dropout is the same in
        # every release).
        return llama_config(
            hf,
            keys,
            "phi3",
            positions=4096,
            eps=1e-5,
            sliding_window=hf.get("sliding_window"),
            attention_bias=False,
            mlp_bias=False,
            dropout=hf.get("resid_pdrop", 0.0),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(cfg, self.fixed, self.model_type)
        scaling = cfg.rope_scaling
        if scaling is not None and scaling.type != "longrope":
            raise UserError(
                f"a phi3 checkpoint has default or longrope rotary, this model has rope scaling "
                f"'{scaling.type}': it cannot be written as that family"
            )
        rope = rope_parameters(cfg)
        return llama_config_json(
            cfg,
            "Phi3",
            self.model_type,
            original_max_position_embeddings=(
                scaling.original_max_position_embeddings
                if scaling is not None
                else cfg.max_position_embeddings
            ),
            rope_theta=cfg.rotary_base,
            rope_scaling=rope if scaling is not None else None,  # what transformers 4.x reads
            rope_parameters=rope,
            sliding_window=cfg.sliding_window,
            resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout,
        )

    def mapping(self, cfg: ModelConfig) -> Mapping:
        rows: Mapping = [("embed.weight", "model.embed_tokens.weight", PLAIN)]
        for i in range(cfg.num_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            rows += module_rows(f"{ours}.norm1", f"{hf}.input_layernorm", False)
            rows += [(f"{ours}.attn.qkv.weight", f"{hf}.self_attn.qkv_proj.weight", QKV_ROWS)]
            rows += module_rows(f"{ours}.attn.proj", f"{hf}.self_attn.o_proj", False)
            rows += module_rows(f"{ours}.norm2", f"{hf}.post_attention_layernorm", False)
            rows += [
                (f"{ours}.mlp.gate.weight", f"{hf}.mlp.gate_up_proj.weight", FIRST_HALF),
                (f"{ours}.mlp.up.weight", f"{hf}.mlp.gate_up_proj.weight", SECOND_HALF),
            ]
            rows += module_rows(f"{ours}.mlp.down", f"{hf}.mlp.down_proj", False)
        rows += module_rows("norm", "model.norm", False)
        return rows + decoder_head(cfg, [("lm_head.weight", "lm_head.weight", PLAIN)])
