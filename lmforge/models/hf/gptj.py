"""GPT-J <-> Hugging Face GPTJForCausalLM: one norm feeding attention and MLP in parallel,
interleaved (rotate-every-two) partial rotary, untied head with a bias."""

from __future__ import annotations

from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import (
    CLASSIC_SWITCHES,
    PLAIN,
    HFAdapter,
    Mapping,
    activation_from_hf,
    activation_to_hf,
    architecture,
    decoder_head,
    decoder_num_labels,
    module_rows,
    qkv_rows,
    require,
)


class GPTJAdapter(HFAdapter):
    model_type = "gptj"

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        head_dim = hf["n_embd"] // hf["n_head"]
        rotary_dim = hf.get("rotary_dim") or head_dim
        return ModelConfig(
            family="gptj",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["n_embd"],
            num_layers=hf["n_layer"],
            num_heads=hf["n_head"],
            intermediate_size=hf.get("n_inner") or 4 * hf["n_embd"],
            max_position_embeddings=hf.get("n_positions", 2048),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            activation=activation_from_hf(hf.get("activation_function", "gelu_new")),
            parallel_residual=True,
            shared_norm=True,
            rotary_pct=rotary_dim / head_dim,
            rotary_interleaved=True,
            attention_bias=False,
            lm_head_bias=True,
            tie_embeddings=hf.get("tie_word_embeddings", False),
            init_std=hf.get("initializer_range", 0.02),
            dropout=hf.get("resid_pdrop", 0.0),
            attention_dropout=hf.get("attn_pdrop", 0.0),
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
                "parallel_residual": True,
                "shared_norm": True,
                "position_embedding": "rotary",
                "rotary_interleaved": True,
                "causal": True,
                "attention_bias": False,
                "qkv_bias": False,
                "lm_head_bias": True,
                "type_vocab_size": 0,
                "num_kv_heads": cfg.num_heads,
            },
            self.model_type,
        )
        return {
            **architecture(cfg, "GPTJ", "ForCausalLM"),
            "model_type": "gptj",
            "vocab_size": cfg.vocab_size,
            "n_embd": cfg.hidden_size,
            "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads,
            "n_inner": None
            if cfg.intermediate_size == 4 * cfg.hidden_size
            else cfg.intermediate_size,
            "n_positions": cfg.max_position_embeddings,
            "rotary_dim": cfg.rotary_dim,
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

    def mapping(self, cfg: ModelConfig) -> Mapping:
        rows: Mapping = [("embed.weight", "transformer.wte.weight", PLAIN)]
        for i in range(cfg.num_layers):
            hf, ours = f"transformer.h.{i}", f"layers.{i}"
            att = f"{hf}.attn"
            rows += module_rows(f"{ours}.norm1", f"{hf}.ln_1", True)
            rows += qkv_rows(
                f"{ours}.attn.qkv", f"{att}.q_proj", f"{att}.k_proj", f"{att}.v_proj", False
            )
            rows += module_rows(f"{ours}.attn.proj", f"{att}.out_proj", False)
            rows += module_rows(f"{ours}.mlp.up", f"{hf}.mlp.fc_in", True)
            rows += module_rows(f"{ours}.mlp.down", f"{hf}.mlp.fc_out", True)
        rows += module_rows("norm", "transformer.ln_f", True)
        return rows + decoder_head(cfg, module_rows("lm_head", "lm_head", True))
