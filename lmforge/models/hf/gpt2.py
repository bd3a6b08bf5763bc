"""GPT-2 <-> Hugging Face GPT2LMHeadModel (Conv1D weights are stored transposed)."""

from __future__ import annotations

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import (
    CLASSIC_SWITCHES,
    CONV1D,
    PLAIN,
    QKV_STACKED,
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


class GPT2Adapter(HFAdapter):
    model_type = "gpt2"

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        if hf.get("scale_attn_by_inverse_layer_idx") or not hf.get("scale_attn_weights", True):
            raise UserError(
                "GPT-2 attention scaling variants (scale_attn_by_inverse_layer_idx, "
                "scale_attn_weights=false) are not supported"
            )
        return ModelConfig(
            family="gpt2",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["n_embd"],
            num_layers=hf["n_layer"],
            num_heads=hf["n_head"],
            intermediate_size=hf.get("n_inner") or 4 * hf["n_embd"],
            max_position_embeddings=hf.get("n_positions", 1024),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            activation=activation_from_hf(hf.get("activation_function", "gelu_new")),
            position_embedding="learned",
            tie_embeddings=hf.get("tie_word_embeddings", True),
            init_std=hf.get("initializer_range", 0.02),
            dropout=hf.get("resid_pdrop", 0.1),
            attention_dropout=hf.get("attn_pdrop", 0.1),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            num_labels=decoder_num_labels(hf, keys),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(
            cfg,
            {
                **CLASSIC_SWITCHES,
                "norm_position": "pre",
                "parallel_residual": False,
                "shared_norm": False,
                "position_embedding": "learned",
                "causal": True,
                "attention_bias": True,
                "qkv_bias": True,
                "lm_head_bias": False,
                "type_vocab_size": 0,
                "num_kv_heads": cfg.num_heads,
            },
            self.model_type,
        )
        return {
            **architecture(cfg, "GPT2", "LMHeadModel"),
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "n_inner": None
            if cfg.intermediate_size == 4 * cfg.hidden_size
            else cfg.intermediate_size,
            "n_positions": cfg.max_position_embeddings,
            "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": activation_to_hf(cfg.activation),
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.attention_dropout,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
            "use_cache": True,
        }

    def aliases(self, name: str) -> list[str]:
        # The original OpenAI-converted checkpoints have no "transformer." prefix.
        return [name.removeprefix("transformer.")]

    def mapping(self, cfg: ModelConfig) -> Mapping:
        rows: Mapping = [
            ("embed.weight", "transformer.wte.weight", PLAIN),
            ("pos_embed.weight", "transformer.wpe.weight", PLAIN),
        ]
        for i in range(cfg.num_layers):
            hf, ours = f"transformer.h.{i}", f"layers.{i}"
            rows += module_rows(f"{ours}.norm1", f"{hf}.ln_1", True)
            rows += module_rows(f"{ours}.attn.qkv", f"{hf}.attn.c_attn", True, QKV_STACKED)
            rows += module_rows(f"{ours}.attn.proj", f"{hf}.attn.c_proj", True, CONV1D)
            rows += module_rows(f"{ours}.norm2", f"{hf}.ln_2", True)
            rows += module_rows(f"{ours}.mlp.up", f"{hf}.mlp.c_fc", True, CONV1D)
            rows += module_rows(f"{ours}.mlp.down", f"{hf}.mlp.c_proj", True, CONV1D)
        rows += module_rows("norm", "transformer.ln_f", True)
        return rows + decoder_head(cfg, [("lm_head.weight", "lm_head.weight", PLAIN)])
