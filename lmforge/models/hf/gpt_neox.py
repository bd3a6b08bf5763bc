"""GPT-NeoX / Pythia <-> Hugging Face GPTNeoXForCausalLM."""

from __future__ import annotations

from lmforge.errors import UserError
from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import (
    CLASSIC_SWITCHES,
    PLAIN,
    QKV_GROUPED,
    HFAdapter,
    Mapping,
    activation_from_hf,
    activation_to_hf,
    architecture,
    decoder_head,
    decoder_num_labels,
    module_rows,
    require,
    rope_scaling_check,
)


class GPTNeoXAdapter(HFAdapter):
    model_type = "gpt_neox"

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        rope = hf.get("rope_parameters") or {}
        rope_scaling_check(hf)
        return ModelConfig(
            family="gpt_neox",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            norm_eps=hf.get("layer_norm_eps", 1e-5),
            activation=activation_from_hf(hf.get("hidden_act", "gelu")),
            parallel_residual=hf.get("use_parallel_residual", True),
            # transformers 4.x wrote rotary_pct/rotary_emb_base; 5.x writes rope_parameters.
            rotary_pct=rope.get("partial_rotary_factor", hf.get("rotary_pct", 0.25)),
            rotary_base=rope.get("rope_theta", hf.get("rotary_emb_base", 10000.0)),
            attention_bias=hf.get("attention_bias", True),
            tie_embeddings=hf.get("tie_word_embeddings", False),
            init_std=hf.get("initializer_range", 0.02),
            dropout=hf.get("hidden_dropout", 0.0),
            attention_dropout=hf.get("attention_dropout", 0.0),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            num_labels=decoder_num_labels(hf, keys),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        if not cfg.parallel_residual and cfg.shared_norm:
            raise UserError("GPT-NeoX has no shared-norm variant: export this model as gptj")
        require(
            cfg,
            {
                **CLASSIC_SWITCHES,
                "norm_position": "pre",
                "shared_norm": False,
                "position_embedding": "rotary",
                "rotary_interleaved": False,
                "causal": True,
                "lm_head_bias": False,
                "type_vocab_size": 0,
                "qkv_bias": cfg.attention_bias,
                "num_kv_heads": cfg.num_heads,
            },
            self.model_type,
        )
        return {
            **architecture(cfg, "GPTNeoX", "ForCausalLM"),
            "model_type": "gpt_neox",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "layer_norm_eps": cfg.norm_eps,
            "hidden_act": activation_to_hf(cfg.activation),
            "use_parallel_residual": cfg.parallel_residual,
            "rotary_pct": cfg.rotary_pct,  # read by transformers 4.x
            "rotary_emb_base": cfg.rotary_base,
            "rope_parameters": {  # read by transformers 5.x
                "rope_type": "default",
                "rope_theta": cfg.rotary_base,
                "partial_rotary_factor": cfg.rotary_pct,
            },
            "attention_bias": cfg.attention_bias,
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std,
            "hidden_dropout": cfg.dropout,
            "attention_dropout": cfg.attention_dropout,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
            "use_cache": True,
        }

    def mapping(self, cfg: ModelConfig) -> Mapping:
        rows: Mapping = [("embed.weight", "gpt_neox.embed_in.weight", PLAIN)]
        bias = cfg.attention_bias
        for i in range(cfg.num_layers):
            hf, ours = f"gpt_neox.layers.{i}", f"layers.{i}"
            rows += module_rows(f"{ours}.norm1", f"{hf}.input_layernorm", True)
            rows += module_rows(
                f"{ours}.attn.qkv", f"{hf}.attention.query_key_value", bias, QKV_GROUPED
            )
            rows += module_rows(f"{ours}.attn.proj", f"{hf}.attention.dense", bias)
            rows += module_rows(f"{ours}.norm2", f"{hf}.post_attention_layernorm", True)
            rows += module_rows(f"{ours}.mlp.up", f"{hf}.mlp.dense_h_to_4h", True)
            rows += module_rows(f"{ours}.mlp.down", f"{hf}.mlp.dense_4h_to_h", True)
        rows += module_rows("norm", "gpt_neox.final_layer_norm", True)
        return rows + decoder_head(cfg, [("lm_head.weight", "embed_out.weight", PLAIN)])
