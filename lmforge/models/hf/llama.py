"""Llama 2 and 3.x <-> Hugging Face LlamaForCausalLM (grouped-query attention, rope scaling:
llama3 for 3.1+, linear, dynamic and yarn as transformers has them)."""

from __future__ import annotations

from lmforge.models.config import ModelConfig
from lmforge.models.hf.base import (
    EXPERTS,
    EXPERTS_GATE_UP,
    PLAIN,
    QK_NORM,
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
from lmforge.models.hf.rope import rope_from_hf, rope_to_hf

# The switches of LlamaForCausalLM's block, which the families sharing its layout (llama_layout)
# start from: their adapters refuse to export a config that differs where their modeling code
# hard-wires a value.
LLAMA_SWITCHES = {
    "norm": "rmsnorm",
    "norm_position": "pre",
    "gated_mlp": True,
    "parallel_residual": False,
    "shared_norm": False,
    "position_embedding": "rotary",
    "rotary_interleaved": False,
    "causal": True,
    "lm_head_bias": False,
    "qk_norm": "none",
    "sliding_window": None,
    "norm_scale_fp32": False,
    "norm_unit_offset": False,
    "scale_embeddings": False,
    "query_pre_attn_scalar": None,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "rotary_base_local": None,
    "num_experts": 0,
}


class LlamaAdapter(HFAdapter):
    model_type = "llama"

    def config_from_hf(self, hf: dict, keys: list[str]) -> ModelConfig:
        return llama_config(
            hf,
            keys,
            "llama",
            positions=4096,
            eps=1e-6,
            head_dim=hf_head_dim(hf),
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
        )

    def config_to_hf(self, cfg: ModelConfig) -> dict:
        require(cfg, {**LLAMA_SWITCHES, "qkv_bias": cfg.attention_bias}, self.model_type)
        return llama_config_json(
            cfg,
            "Llama",
            self.model_type,
            head_dim=cfg.head_dim,
            attention_bias=cfg.attention_bias,
            mlp_bias=cfg.mlp_bias,
            pretraining_tp=1,
        )

    def mapping(self, cfg: ModelConfig) -> Mapping:
        return llama_layout(cfg)


def hf_head_dim(hf: dict) -> int:
    """config.json's head_dim, which transformers leaves out (or null) where it is hidden_size /
    heads."""
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def llama_config(
    hf: dict, keys: list[str], family: str, *, positions: int, eps: float, **fields
) -> ModelConfig:
    """A ModelConfig from the config.json fields that every family with Llama's names reads alike
    (sizes, RMSNorm, gated MLP, rotary, ids); `positions` and `eps` are the family's defaults for
    a field its config may leave out, and `fields` its own switches, which win over these (a
    family giving its own activation or rotary settings has config.json's read by its adapter,
    not here)."""
    heads = hf["num_attention_heads"]
    if "activation" not in fields:
        fields["activation"] = activation_from_hf(hf.get("hidden_act", "silu"))
    if "rotary_base" not in fields:
        theta, pct, scaling = rope_from_hf(hf)
        fields = {"rotary_pct": pct, "rotary_base": theta, "rope_scaling": scaling, **fields}
    common = dict(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", positions),
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", eps),
        gated_mlp=True,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        init_std=hf.get("initializer_range", 0.02),
        attention_dropout=hf.get("attention_dropout") or 0.0,  # null in some config.json files
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"),
        num_labels=decoder_num_labels(hf, keys),
    )
    return ModelConfig(**{**common, **fields})


def llama_config_json(cfg: ModelConfig, name: str, model_type: str, **fields) -> dict:
    """config.json for a family with Llama's names: the fields they all write alike, then the
    family's own (`fields`, which win); `name` is the transformers class prefix (Mistral ->
    MistralForCausalLM)."""
    return {
        **architecture(cfg, name, "ForCausalLM"),
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": activation_to_hf(cfg.activation),
        **rope_to_hf(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "attention_dropout": cfg.attention_dropout,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "use_cache": True,
        **fields,
    }


def llama_layout(
    cfg: ModelConfig,
    experts: tuple[str, str, str, str] = ("mlp", "gate_proj", "up_proj", "down_proj"),
) -> Mapping:
    """The tensor names of LlamaForCausalLM, which Mistral, Qwen2/3, OLMo 2 and Gemma 2/3 share:
    q/k/v/o and gate/up/down projections under model.layers.N, plus whichever norms the config's
    switches give a block (q_norm/k_norm: Qwen3, OLMo 2, Gemma 3; norms on the branch outputs:
    OLMo 2, Gemma 2/3).

    A MoE layer (Mixtral, Qwen3-MoE) has, in place of the MLP, `<block>.gate` (the router) and
    one MLP per expert under `<block>.experts.E`, named by `experts`: (block, gate, up, down)."""
    # HF's names for the block's norms by norm_position (lmforge's name -> theirs).
    norms = {
        "pre": {"norm1": "input_layernorm", "norm2": "post_attention_layernorm"},
        "output": {
            "post_attn_norm": "post_attention_layernorm",
            "post_mlp_norm": "post_feedforward_layernorm",
        },
        "sandwich": {
            "norm1": "input_layernorm",
            "post_attn_norm": "post_attention_layernorm",
            "norm2": "pre_feedforward_layernorm",
            "post_mlp_norm": "post_feedforward_layernorm",
        },
    }
    norms = norms[cfg.norm_position]
    rows: Mapping = [("embed.weight", "model.embed_tokens.weight", PLAIN)]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        att = f"{hf}.self_attn"
        if "norm1" in norms:
            rows += module_rows(f"{ours}.norm1", f"{hf}.{norms['norm1']}", False)
        rows += qkv_rows(
            f"{ours}.attn.qkv", f"{att}.q_proj", f"{att}.k_proj", f"{att}.v_proj", cfg.qkv_bias
        )
        if cfg.qk_norm != "none":
            rows += [
                (f"{ours}.attn.q_norm.weight", f"{att}.q_norm.weight", QK_NORM),
                (f"{ours}.attn.k_norm.weight", f"{att}.k_norm.weight", QK_NORM),
            ]
        rows += module_rows(f"{ours}.attn.proj", f"{att}.o_proj", cfg.attention_bias)
        for name in ("post_attn_norm", "norm2"):
            if name in norms:
                rows += module_rows(f"{ours}.{name}", f"{hf}.{norms[name]}", False)
        if cfg.is_moe_layer(i):
            rows += moe_rows(cfg, f"{ours}.mlp", f"{hf}.{experts[0]}", *experts[1:])
        else:
            rows += module_rows(f"{ours}.mlp.gate", f"{hf}.mlp.gate_proj", cfg.mlp_bias)
            rows += module_rows(f"{ours}.mlp.up", f"{hf}.mlp.up_proj", cfg.mlp_bias)
            rows += module_rows(f"{ours}.mlp.down", f"{hf}.mlp.down_proj", cfg.mlp_bias)
        if "post_mlp_norm" in norms:
            rows += module_rows(f"{ours}.post_mlp_norm", f"{hf}.{norms['post_mlp_norm']}", False)
    rows += module_rows("norm", "model.norm", False)
    return rows + decoder_head(cfg, [("lm_head.weight", "lm_head.weight", PLAIN)])


def moe_rows(cfg: ModelConfig, ours: str, block: str, gate: str, up: str, down: str) -> Mapping:
    """One MoE layer: the router, and the experts' per-expert tensors stacked into lmforge's
    gate_up and down."""
    each = [f"{block}.experts.{e}" for e in range(cfg.num_experts)]
    return [
        (f"{ours}.router.weight", f"{block}.gate.weight", PLAIN),
        (
            f"{ours}.experts.gate_up",
            tuple(f"{x}.{gate}.weight" for x in each) + tuple(f"{x}.{up}.weight" for x in each),
            EXPERTS_GATE_UP,
        ),
        (f"{ours}.experts.down", tuple(f"{x}.{down}.weight" for x in each), EXPERTS),
    ]
