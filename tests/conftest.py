"""Shared fixtures: the real-asset folder and tiny random transformers models per family."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from lmforge.parallel.mesh import torch_version

TORCH_VERSION = torch_version()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest -n N each worker computes on one core (and so do the processes its tests start,
    # unless a test says otherwise): N workers of torch's default N threads each oversubscribe N
    # cores, and their idle threads spin. Measured on 2 cores: the fast lane 1:48 in one process,
    # 2:25 on two workers of 2 threads, 1:09 of 1.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def needs_torch(version: tuple[int, int], what: str):
    """Skip on a torch older than `version` (the declared minimum is 2.6), where lmforge refuses
    `what` in one line."""
    return pytest.mark.skipif(
        TORCH_VERSION < version,
        reason=f"{what} needs torch {version[0]}.{version[1]}+, this is {torch.__version__}",
    )


# lmforge's one-line refusals of what an older torch cannot do, or computes wrongly ("... needs
# torch 2.8 or later ...", "... needs a newer torch than 2.6.0 ..."): the version each names, and
# the line.
_REFUSAL = re.compile(
    r"needs (?:torch (\d+)\.(\d+) or later|a newer torch than (\d+)\.(\d+)\.\d+)"
    r"(?:[^\n'\"\\]|'(?=[a-z]))*"
)  # to the end of the line or of a quoted string


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that fails (or whose fixture fails) with lmforge's refusal of this torch is
    reported as skipped, with the refusal as its reason: on the declared floor (2.6) the layouts
    an old torch cannot run are refused, as the README lists, not broken. Only a refusal naming a
    release newer than this one (or exactly this one, for "a newer torch than") counts: on a
    torch that should run the test, the failure stays a failure."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or report.when == "teardown" or item.get_closest_marker("no_refusal_skip"):
        return
    for found in _REFUSAL.finditer(str(report.longrepr)):
        later, newer_than = found.group(1, 2), found.group(3, 4)
        if (later[0] and TORCH_VERSION < (int(later[0]), int(later[1]))) or (
            newer_than[0] and TORCH_VERSION == (int(newer_than[0]), int(newer_than[1]))
        ):
            report.outcome = "skipped"
            report.longrepr = (
                str(item.path),
                item.location[1] or 0,
                f"refused on torch {torch.__version__}: {found.group(0).strip()}",
            )
            return


def expert_placements(placements: str) -> str:
    """Expert weights' placements on the expert mesh written for torch 2.12+ ("ep_replicate",
    "ep"[, "tp"], "ep_shard"; "RS(0)S(2)R"), as this torch lays them: before 2.12 FSDP2 cannot
    shard them and "ep_shard" (one rank) comes second, in rank order
    (lmforge.parallel.mesh.expert_mesh)."""
    from lmforge.parallel.mesh import fsdp_shards_experts

    if fsdp_shards_experts():
        return placements
    parts = re.findall(r"R|S\(\d+\)", placements)
    return "".join([parts[0], "R", *parts[1:-1]])


SHARED_DATA = Path(
    os.environ.get("LMFORGE_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real test assets not found at {SHARED_DATA} (set LMFORGE_SHARED_DATA)")
    return SHARED_DATA


def hf_tiny_configs() -> dict:
    """Small transformers configs, one per family, with the switches that make each family."""
    import transformers as tf

    return {
        # rotary_pct 0.25 with head_dim 16: 4 rotary dims, 12 pass-through (the partial-rotary
        # trap).
        "gpt_neox": (
            tf.GPTNeoXForCausalLM,
            tf.GPTNeoXConfig(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                rotary_pct=0.25,
                max_position_embeddings=128,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
        "gpt_neox_serial": (
            tf.GPTNeoXForCausalLM,
            tf.GPTNeoXConfig(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                rotary_pct=0.5,
                use_parallel_residual=False,
                max_position_embeddings=128,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
        "llama": (
            tf.LlamaForCausalLM,
            tf.LlamaConfig(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=96,
                max_position_embeddings=128,
                rms_norm_eps=1e-5,
            ),
        ),
        # Grouped-query attention as in Llama-2-70B (64 query, 8 key/value heads): here 8 over 2.
        "llama_gqa": (
            tf.LlamaForCausalLM,
            tf.LlamaConfig(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_key_value_heads=2,
                intermediate_size=160,
                max_position_embeddings=128,
                rms_norm_eps=1e-5,
            ),
        ),
        # Llama 3.x: llama3 rope scaling of a 16-position "pretraining" context (all three frequency
        # bands are hit at head_dim 16), tied embeddings as in 3.2-1B/3B.
        "llama3": (
            tf.LlamaForCausalLM,
            tf.LlamaConfig(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=96,
                max_position_embeddings=128,
                rms_norm_eps=1e-5,
                tie_word_embeddings=True,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            ),
        ),
        # Qwen2.5: biased q/k/v (o_proj without), tied embeddings as in the 0.5B-3B sizes.
        "qwen2": (
            tf.Qwen2ForCausalLM,
            tf.Qwen2Config(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=96,
                max_position_embeddings=128,
                tie_word_embeddings=True,
                max_window_layers=2,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            ),
        ),
        # Mistral: an 8-token sliding window, so the parity (37 tokens) and generation (up to 25)
        # sequences pass it.
        "mistral": (
            tf.MistralForCausalLM,
            tf.MistralConfig(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=96,
                max_position_embeddings=128,
                sliding_window=8,
            ),
        ),
        # Qwen3: q/k RMSNorm per head; head_dim 32 with hidden 64 over 4 heads (q is twice as wide
        # as the model).
        "qwen3": (
            tf.Qwen3ForCausalLM,
            tf.Qwen3Config(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                intermediate_size=96,
                max_position_embeddings=128,
                tie_word_embeddings=True,
                max_window_layers=2,
            ),
        ),
        # OLMo 2: norms on the branch outputs, q/k norms over the whole (grouped) projections.
        "olmo2": (
            tf.Olmo2ForCausalLM,
            tf.Olmo2Config(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=96,
                max_position_embeddings=128,
                pad_token_id=1,
                eos_token_id=2,
            ),
        ),
        # Phi-3: fused qkv_proj (grouped: 4 query heads over 2 key/value heads) and gate_up_proj; an
        # 8-token window.
        "phi3": (
            tf.Phi3ForCausalLM,
            tf.Phi3Config(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=96,
                max_position_embeddings=128,
                original_max_position_embeddings=128,
                sliding_window=8,
                bos_token_id=1,
                eos_token_id=2,
                pad_token_id=0,
            ),
        ),
        # Gemma 2: layer 0 local (8-token window), layer 1 global; caps low enough to bite on these
        # scores/logits.
        "gemma2": (
            tf.Gemma2ForCausalLM,
            tf.Gemma2Config(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                intermediate_size=96,
                max_position_embeddings=128,
                query_pre_attn_scalar=24,
                sliding_window=8,
                attn_logit_softcapping=2.0,
                final_logit_softcapping=1.5,
            ),
        ),
        # Gemma 3: per-head q/k norms; the local layer rotates with base 1e4, the global one with
        # 1e6 scaled by 8.
        "gemma3": (
            tf.Gemma3ForCausalLM,
            tf.Gemma3TextConfig(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                intermediate_size=96,
                max_position_embeddings=128,
                query_pre_attn_scalar=24,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={
                    "full_attention": {
                        "rope_type": "linear",
                        "factor": 8.0,
                        "rope_theta": 1000000.0,
                    },
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
            ),
        ),
        # Mixtral: 4 experts, 2 per token, softmax weights renormalised; an 8-token window as
        # Mistral's.
        "mixtral": (
            tf.MixtralForCausalLM,
            tf.MixtralConfig(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                intermediate_size=96,
                max_position_embeddings=128,
                sliding_window=8,
                num_local_experts=4,
                num_experts_per_tok=2,
                router_aux_loss_coef=0.02,
            ),
        ),
        # Qwen3-MoE: 8 experts of width 48, 3 per token, weights not renormalised (norm_topk_prob
        # false); layer 1 a dense MLP of width 96 (mlp_only_layers).
        "qwen3_moe": (
            tf.Qwen3MoeForCausalLM,
            tf.Qwen3MoeConfig(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                intermediate_size=96,
                moe_intermediate_size=48,
                num_experts=8,
                num_experts_per_tok=3,
                mlp_only_layers=[1],
                max_position_embeddings=128,
            ),
        ),
        "gpt2": (
            tf.GPT2LMHeadModel,
            tf.GPT2Config(
                vocab_size=300,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=128,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
        # Decoder sequence classification (GPT-2 on SST-2): a score head read at the last real
        # token.
        "gpt2_cls": (
            tf.GPT2ForSequenceClassification,
            tf.GPT2Config(
                vocab_size=300,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=128,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
                num_labels=2,
            ),
        ),
        "gptj": (
            tf.GPTJForCausalLM,
            tf.GPTJConfig(
                vocab_size=300,
                n_embd=64,
                n_layer=2,
                n_head=4,
                rotary_dim=8,
                n_positions=128,
                bos_token_id=0,
                eos_token_id=0,
            ),
        ),
        "bert": (
            tf.BertForMaskedLM,
            tf.BertConfig(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                max_position_embeddings=128,
            ),
        ),
        "bert_cls": (
            tf.BertForSequenceClassification,
            tf.BertConfig(
                vocab_size=300,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                max_position_embeddings=128,
                num_labels=3,
            ),
        ),
    }


def make_hf_model(name: str, seed: int = 0):
    """A random transformers model whose every parameter (biases, norms too) is non-trivial."""
    cls, cfg = hf_tiny_configs()[name]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """Each tiny family saved once as a Hugging Face folder (safetensors)."""
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for name in hf_tiny_configs():
        make_hf_model(name).save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def edited_copy(src: Path, dst: Path, edit_config=None, edit_weights=None) -> Path:
    """A copy of HF folder `src` at `dst` with config.json and/or the weights edited.

    `edit_weights` may change the dict in place or return a new one.
    """
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    weights = load_file(src / "model.safetensors")
    if edit_weights:
        result = edit_weights(weights)
        weights = result if isinstance(result, dict) else weights
    save_file(weights, str(dst / "model.safetensors"))
    return dst
