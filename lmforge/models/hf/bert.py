"""BERT <-> Hugging Face BertForMaskedLM / BertForSequenceClassification."""

from __future__ import annotations

from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import (
    CLASSIC_SWITCHES,
    PLAIN,
    HFAdapter,
    Mapping,
    activation_from_hf,
    activation_to_hf,
    module_rows,
    qkv_rows,
    require,
)


class BertAdapter(HFAdapter):
    model_type = "bert"
    # Pretraining checkpoints carry a next-sentence head and a pooler that a masked-LM model
    # does not use (BertForMaskedLM reports them as unexpected); we drop them on import.
    ignorable = (
        *HFAdapter.ignorable,
        "cls.seq_relationship.",
        "cls.predictions.decoder.",
        "pooler.",
    )

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        classifier = any(k.endswith("classifier.weight") for k in keys)
        num_labels = len(hf.get("id2label") or {}) or hf.get("num_labels", 2) if classifier else 0
        return ModelConfig(
            family="bert",
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=hf.get("max_position_embeddings", 512),
            norm_eps=hf.get("layer_norm_eps", 1e-12),
            norm_position="post",
            activation=activation_from_hf(hf.get("hidden_act", "gelu")),
            position_embedding="learned",
            causal=False,
            type_vocab_size=hf.get("type_vocab_size", 2),
            tie_embeddings=True,
            num_labels=num_labels,
            init_std=hf.get("initializer_range", 0.02),
            dropout=hf.get("hidden_dropout_prob", 0.1),
            attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id", 0),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(
            cfg,
            {
                **CLASSIC_SWITCHES,
                "norm_position": "post",
                "parallel_residual": False,
                "shared_norm": False,
                "position_embedding": "learned",
                "causal": False,
                "attention_bias": True,
                "qkv_bias": True,
                "tie_embeddings": True,
                "num_kv_heads": cfg.num_heads,
            },
            self.model_type,
        )
        hf = {
            "architectures": [
                "BertForSequenceClassification" if cfg.num_labels else "BertForMaskedLM"
            ],
            "model_type": "bert",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads,
            "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "layer_norm_eps": cfg.norm_eps,
            "hidden_act": activation_to_hf(cfg.activation),
            "type_vocab_size": cfg.type_vocab_size,
            "initializer_range": cfg.init_std,
            "hidden_dropout_prob": cfg.dropout,
            "attention_probs_dropout_prob": cfg.attention_dropout,
            "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id,
            "tie_word_embeddings": True,
        }
        if cfg.num_labels:
            hf["id2label"] = {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)}
            hf["label2id"] = {f"LABEL_{i}": i for i in range(cfg.num_labels)}
        return hf

    def aliases(self, name: str) -> list[str]:
        # Original Google-converted checkpoints: LayerNorm gamma/beta, and no "bert." prefix.
        old = name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        )
        return [
            n for n in {old, name.removeprefix("bert."), old.removeprefix("bert.")} if n != name
        ]

    def mapping(self, cfg: ModelConfig) -> Mapping:
        e = "bert.embeddings"
        rows: Mapping = [
            ("embeddings.word.weight", f"{e}.word_embeddings.weight", PLAIN),
            ("embeddings.position.weight", f"{e}.position_embeddings.weight", PLAIN),
        ]
        if cfg.type_vocab_size:
            rows.append(
                ("embeddings.token_type.weight", f"{e}.token_type_embeddings.weight", PLAIN)
            )
        rows += module_rows("embeddings.norm", f"{e}.LayerNorm", True)
        for i in range(cfg.num_layers):
            hf, ours = f"bert.encoder.layer.{i}", f"layers.{i}"
            att = f"{hf}.attention.self"
            rows += qkv_rows(f"{ours}.attn.qkv", f"{att}.query", f"{att}.key", f"{att}.value", True)
            rows += module_rows(f"{ours}.attn.proj", f"{hf}.attention.output.dense", True)
            rows += module_rows(f"{ours}.norm1", f"{hf}.attention.output.LayerNorm", True)
            rows += module_rows(f"{ours}.mlp.up", f"{hf}.intermediate.dense", True)
            rows += module_rows(f"{ours}.mlp.down", f"{hf}.output.dense", True)
            rows += module_rows(f"{ours}.norm2", f"{hf}.output.LayerNorm", True)
        if cfg.pooler:
            rows += module_rows("pooler", "bert.pooler.dense", True)
        if cfg.num_labels:
            rows += module_rows("classifier", "classifier", True)
        else:
            rows += module_rows("mlm_head.dense", "cls.predictions.transform.dense", True)
            rows += module_rows("mlm_head.norm", "cls.predictions.transform.LayerNorm", True)
            rows.append(("mlm_head.bias", "cls.predictions.bias", PLAIN))
        return rows
