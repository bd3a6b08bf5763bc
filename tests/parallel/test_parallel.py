"""Tensor, sequence, pipeline and fully-sharded data parallelism on CPU with gloo: 2 and 4
processes.

Each layout trains one step on a global batch; its loss, every gradient (gathered with
full_tensor) and the global gradient norm must equal the single-process model on the same batch
to fp32 tolerance. One launch per world size runs all its layouts (start-up is most of the cost).
"""

from __future__ import annotations

import json

import pytest

from lmforge.parallel.mesh import torch_version
from tests.parallel.launch import run_ranks

L4 = {"num_layers": 4}  # interleaved: 2 pipeline ranks x 2 virtual stages x 1 layer
# LoRA on every linear of the blocks (the base frozen; B drawn non-zero so that every adapter has a
# gradient).
LORA = {"rank": 4, "alpha": 8.0, "targets": "all-linear"}

TWO = {
    # Tensor parallel, every family; sequence parallel + vocabulary-parallel loss unless said
    # otherwise.
    "tp_neox_sp": {"model": "tiny-neox", "parallel": {"tensor": 2}},
    "tp_neox_plain": {
        "model": "tiny-neox",
        "parallel": {"tensor": 2, "sequence_parallel": False, "loss_parallel": False},
    },
    # 4 query heads over 2 kv heads
    "tp_llama_gqa_sp": {"model": "tiny-llama", "parallel": {"tensor": 2}},
    "tp_gpt2_sp": {"model": "tiny-gpt2", "parallel": {"tensor": 2}},  # tied head, learned positions
    "tp_gpt2_no_sp": {"model": "tiny-gpt2", "parallel": {"tensor": 2, "sequence_parallel": False}},
    "tp_gptj_sp": {"model": "tiny-gptj", "parallel": {"tensor": 2}},  # shared norm, lm_head bias
    # post-norm, token types, MLM head
    "tp_bert_sp": {"model": "tiny-bert", "parallel": {"tensor": 2}},
    # q/k/v bias without an o_proj bias
    "tp_qwen2_sp": {"model": "tiny-qwen2", "parallel": {"tensor": 2}},
    # An 8-token sliding window over 16-token sequences: the banded mask with sequence shards and
    # across stages.
    "tp_mistral_sp": {"model": "tiny-mistral", "parallel": {"tensor": 2}},
    "pp_mistral_1f1b": {"model": "tiny-mistral", "parallel": {"pipeline": 2, "microbatches": 2}},
    # per-head q/k norms on each rank's heads
    "tp_qwen3_sp": {"model": "tiny-qwen3", "parallel": {"tensor": 2}},
    "tp_qwen3_plain": {
        "model": "tiny-qwen3",
        "parallel": {"tensor": 2, "sequence_parallel": False},
    },
    # Norms on the branch outputs (sequence-sharded under SP) and q/k norms over the whole,
    # head-split projection.
    "tp_olmo2_sp": {"model": "tiny-olmo2", "parallel": {"tensor": 2}},
    "tp_olmo2_plain": {
        "model": "tiny-olmo2",
        "parallel": {"tensor": 2, "sequence_parallel": False},
    },
    # Gemma 2: sandwich norms (1 + weight), embeddings x sqrt(hidden), local/global layers, capped
    # scores and logits (caps low enough to bite at this init); Gemma 3: per-head q/k norms and the
    # local layers' own rotary.
    "tp_gemma2_sp": {
        "model": "tiny-gemma2",
        "parallel": {"tensor": 2},
        "model_overrides": {"attn_logit_softcapping": 0.05, "final_logit_softcapping": 0.05},
    },
    "tp_gemma2_plain": {
        "model": "tiny-gemma2",
        "parallel": {"tensor": 2, "sequence_parallel": False, "loss_parallel": False},
        "model_overrides": {"attn_logit_softcapping": 0.05, "final_logit_softcapping": 0.05},
    },
    # Its gradients are the largest here (embeddings x 8): their fp32 summation-order noise (~1e-6
    # relative, as everywhere) reaches Adam's first step amplified up to lr/eps = 10x near zero
    # gradients, 1-3e-4 of a step.
    "tp_gemma3_sp": {"model": "tiny-gemma3", "parallel": {"tensor": 2}, "adam_tol": 5e-4},
    "pp_gemma3_1f1b": {"model": "tiny-gemma3", "parallel": {"pipeline": 2, "microbatches": 2}},
    "tp_gpt2_classifier": {
        "model": "tiny-gpt2",
        "model_overrides": {"num_labels": 3},
        "parallel": {"tensor": 2, "sequence_parallel": False},
    },
    # Classification heads on the last stage: GPT-2's score read at each row's last real token (the
    # stage finds it by the attention mask, its input being hidden states), BERT's pooler and
    # classifier over [CLS].
    "pp_gpt2_classifier": {
        "model": "tiny-gpt2",
        "model_overrides": {"num_labels": 3},
        "parallel": {"pipeline": 2, "microbatches": 2},
    },
    "pp_bert_classifier": {
        "model": "tiny-bert",
        "model_overrides": {"num_labels": 2},
        "parallel": {"pipeline": 2, "pipeline_schedule": "gpipe"},
    },
    # Pipeline parallel, each schedule.
    "pp_gpt2_gpipe": {
        "model": "tiny-gpt2",
        "parallel": {"pipeline": 2, "pipeline_schedule": "gpipe"},
    },
    "pp_neox_1f1b": {"model": "tiny-neox", "parallel": {"pipeline": 2, "microbatches": 4}},
    "pp_gpt2_interleaved": {
        "model": "tiny-gpt2",
        "model_overrides": L4,
        "parallel": {
            "pipeline": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "virtual_stages": 2,
            "microbatches": 4,
        },
    },
    "pp_bert_1f1b": {"model": "tiny-bert", "parallel": {"pipeline": 2, "microbatches": 2}},
    # Mixtures of experts: every expert split on its intermediate rows, the router whole on every
    # rank; the load-balancing loss (and Qwen3-MoE's z-loss, on here) in the loss and gradients as
    # one process has them.
    "tp_mixtral_sp": {"model": "tiny-mixtral", "parallel": {"tensor": 2}},
    "tp_mixtral_plain": {
        "model": "tiny-mixtral",
        "parallel": {"tensor": 2, "sequence_parallel": False, "loss_parallel": False},
    },
    "tp_qwen3_moe_sp": {
        "model": "tiny-qwen3-moe",
        "parallel": {"tensor": 2},
        "model_overrides": {"router_z_loss_coef": 0.01, "router_aux_loss_coef": 0.1},
    },
    # LoRA: a column-parallel layer's A replicated and B split like its rows, a row-parallel layer's
    # A split like its columns and B replicated; q/k/v adapters of Llama's fused qkv follow the
    # key/value groups.
    "tp_llama_lora_sp": {"model": "tiny-llama", "parallel": {"tensor": 2}, "lora": LORA},
    "tp_neox_lora_plain": {
        "model": "tiny-neox",
        "parallel": {"tensor": 2, "sequence_parallel": False, "loss_parallel": False},
        "lora": LORA,
    },
    "pp_llama_lora_1f1b": {
        "model": "tiny-llama",
        "parallel": {"pipeline": 2, "microbatches": 2},
        "lora": LORA,
    },
    # A classifier's LoRA: the adapters and the whole score head train (PEFT's SEQ_CLS), the head on
    # the last stage.
    "pp_llama_lora_classifier": {
        "model": "tiny-llama",
        "model_overrides": {"num_labels": 2},
        "lora": LORA,
        "parallel": {"pipeline": 2, "microbatches": 2},
    },
    # Pipelined: each microbatch's load-balancing loss couples the stages' layers (one f and P over
    # all of them).
    "pp_mixtral_1f1b": {
        "model": "tiny-mixtral",
        "parallel": {"pipeline": 2, "microbatches": 2},
        "model_overrides": {"router_aux_loss_coef": 0.5},
    },
    "pp_qwen3_moe_gpipe": {
        "model": "tiny-qwen3-moe",
        "parallel": {"pipeline": 2, "pipeline_schedule": "gpipe"},
        "model_overrides": {"router_z_loss_coef": 0.01, "router_aux_loss_coef": 0.1},
    },
    # Two stages per rank: a rank's stages send their sums together, once both have run the
    # microbatch.
    "pp_mixtral_interleaved": {
        "model": "tiny-mixtral",
        "model_overrides": {**L4, "router_aux_loss_coef": 0.5},
        "parallel": {
            "pipeline": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "virtual_stages": 2,
            "microbatches": 4,
        },
    },
    # Expert parallelism: each rank holds half the experts, tokens exchanged with all-to-all; the
    # other weights under FSDP2, or DDP.
    "ep_mixtral_fsdp": {"model": "tiny-mixtral", "parallel": {"expert": 2}},
    # Two micro-batches per rank: the experts' gradients are kept from the first and reduced with
    # the last's.
    "ep_qwen3_moe_ddp": {
        "model": "tiny-qwen3-moe",
        "parallel": {"expert": 2, "data_replicate": 2, "data_shard": 1},
        "accumulate": 2,
    },
}

FOUR = {
    "tp_pp_llama": {
        "model": "tiny-llama",
        "parallel": {"tensor": 2, "pipeline": 2, "microbatches": 2},
        "reshard": {"parallel": {"data_shard": 4}},
    },
    "tp_pp_gpt2_interleaved": {
        "model": "tiny-gpt2",
        "model_overrides": L4,
        "parallel": {
            "tensor": 2,
            "pipeline": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "virtual_stages": 2,
            "microbatches": 2,
        },
    },
    "tp_pp_bert": {
        "model": "tiny-bert",
        "parallel": {"tensor": 2, "pipeline": 2, "microbatches": 2},
    },
    "tp_pp_llama_classifier": {
        "model": "tiny-llama",
        "model_overrides": {"num_labels": 2},
        "parallel": {"tensor": 2, "pipeline": 2, "microbatches": 2, "sequence_parallel": False},
    },
    # Four stages, one layer each: middle stages, and the tied embedding's first/last-stage group.
    "pp4_gpt2_gpipe": {
        "model": "tiny-gpt2",
        "model_overrides": L4,
        "parallel": {"pipeline": 4, "pipeline_schedule": "gpipe"},
    },
    "fsdp_tp_gpt2": {"model": "tiny-gpt2", "parallel": {"tensor": 2, "data_shard": 2}},
    "fsdp_tp_llama": {"model": "tiny-llama", "parallel": {"tensor": 2, "data_shard": 2}},
    # The SageMaker BERT layout, scaled down: 2 partitions, interleaved, data parallel on top.
    "bert_pp_interleaved_dp": {
        "model": "tiny-bert",
        "model_overrides": L4,
        "parallel": {
            "pipeline": 2,
            "data_replicate": 2,
            "pipeline_schedule": "interleaved_1f1b",
            "virtual_stages": 2,
            "microbatches": 2,
        },
    },
    "bert_pp_fsdp": {
        "model": "tiny-bert",
        "parallel": {"pipeline": 2, "data_shard": 2, "microbatches": 2},
    },
    "fsdp_tp_llama_lora": {
        "model": "tiny-llama",
        "parallel": {"tensor": 2, "data_shard": 2},
        "lora": LORA,
    },
    "tp_pp_qwen3_lora": {
        "model": "tiny-qwen3",
        "parallel": {"tensor": 2, "pipeline": 2, "microbatches": 2},
        "lora": LORA,
    },
    # Mixtures of experts: both plans on one model; a pipeline per data-parallel rank, each its own
    # router sums.
    "fsdp_tp_qwen3_moe": {
        "model": "tiny-qwen3-moe",
        "parallel": {"tensor": 2, "data_shard": 2},
        "model_overrides": {"router_z_loss_coef": 0.01, "router_aux_loss_coef": 0.1},
    },
    "tp_pp_mixtral": {
        "model": "tiny-mixtral",
        "model_overrides": {"router_aux_loss_coef": 0.5},
        "parallel": {"tensor": 2, "pipeline": 2, "microbatches": 2},
    },
    # Four stages: the middle ones exchange sums with both ends; Qwen3-MoE's dense layer 1 is a
    # stage without experts, which still sends (zeros) and receives.
    "pp4_qwen3_moe_1f1b": {
        "model": "tiny-qwen3-moe",
        "model_overrides": {**L4, "dense_layers": [1], "router_aux_loss_coef": 0.5},
        "parallel": {"pipeline": 4, "microbatches": 4},
    },
    "pp_fsdp_qwen3_moe": {
        "model": "tiny-qwen3-moe",
        "model_overrides": {"router_z_loss_coef": 0.01, "router_aux_loss_coef": 0.1},
        "parallel": {"pipeline": 2, "data_shard": 2, "microbatches": 2},
    },
    # Expert parallelism on 4 processes: tests/parallel/test_expert_layouts.py.
}

# BERT under tensor parallelism is refused before torch 2.11 (lmforge.parallel.mesh.check_model;
# test_layout.py).
if torch_version() < (2, 11):
    for cases in (TWO, FOUR):
        for name in [
            n
            for n, c in cases.items()
            if c["model"] == "tiny-bert" and c["parallel"].get("tensor", 1) > 1
        ]:
            del cases[name]


def _launch(world: int, cases: dict, tmp) -> dict:
    spec, out = tmp / "cases.json", tmp / "out.json"
    for case in cases.values():
        if "reshard" in case:
            case["reshard"]["dir"] = str(tmp / "ckpt")
    spec.write_text(json.dumps(cases))
    ranks = run_ranks(world, ["cases", str(spec), str(out)])
    for i, r in enumerate(ranks):
        assert r.returncode == 0, f"rank {i} failed:\n{r.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _launch(2, TWO, tmp_path_factory.mktemp("two"))


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _launch(4, FOUR, tmp_path_factory.mktemp("four"))


def _check(r: dict, adam_tol: float = 1e-4) -> None:
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
    # forward-only (validation) path
    assert r["eval_loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
    assert r["grad_err"] < 1e-5, r  # max |g - g_ref| / max |g_ref|, over every parameter
    assert r["grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)
    # one AdamW (foreach) step on the sharded parameters moves them like one process
    assert r["adam_err"] < adam_tol, r
    # And so does lmforge's AdamWSR, shard by shard. It steps after AdamW, from weights already that
    # far apart: its difference is both steps' (twice AdamW's in every case measured), against one
    # step's size.
    assert r["adamwsr_err"] < 2 * adam_tol, r
    assert r["missing"] == []  # every parameter of the model is held (and compared) by some rank
    # what one process trains is trained, what it freezes (a LoRA base) stays frozen
    assert r["flipped"] == []
    if "router_losses" in r:  # a pipelined MoE: the aux and z-loss it reports are one process's
        assert r["router_losses"] == pytest.approx(r["ref_router_losses"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(TWO))
def test_two_processes_equal_one(two, layout):
    _check(two[layout], TWO[layout].get("adam_tol", 1e-4))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(FOUR))
def test_four_processes_equal_one(four, layout):
    _check(four[layout], FOUR[layout].get("adam_tol", 1e-4))


@pytest.mark.slow
def test_checkpoint_reshards_between_layouts(four):
    """Saved at (tp=2, pp=2), loaded at (dp=4) and on one process; saved at dp=4, loaded at
    (tp=2, pp=2)."""
    check_reshard(four["tp_pp_llama"])


def check_reshard(r: dict) -> None:
    """After an update, saved under one layout, loaded under another and on one process, and
    back: the losses equal one process's, and every rank's pieces are the checkpoint's bit for
    bit."""
    assert r["reshard_differs"] == []
    assert r["reshard_loaded"] == pytest.approx(r["reshard_expected"], rel=1e-5)
    assert r["reshard_single"] == pytest.approx(r["reshard_expected"], rel=1e-6)
    assert r["reshard_back_loaded"] == pytest.approx(r["reshard_back_expected"], rel=1e-5)
    # the update did something
    assert r["reshard_back_expected"] != pytest.approx(r["reshard_expected"], rel=1e-3)


@pytest.mark.slow
def test_lora_adapters_are_split_like_their_layers(two, four):
    """A column-parallel layer's A replicated and B split by rows (its output), a row-parallel
    layer's A split by columns (its input) and B replicated: each rank computes its share with
    the base layer's own collectives."""
    col, row = {"lora_A": "R", "lora_B": "S(0)"}, {"lora_A": "S(1)", "lora_B": "R"}
    for layout in (
        two["tp_llama_lora_sp"]["lora_layout"],
        four["fsdp_tp_llama_lora"]["lora_layout"],
    ):
        layer0 = {n: v for n, v in layout.items() if n.startswith("layers.0.")}
        assert len(layer0) == 2 * 7  # q, k, v, o, gate, up, down
        for name, placement in layer0.items():
            module, kind, part = name.rsplit(".", 2)
            expected = row[kind] if part in ("o", "down") else col[kind]
            # FSDP's Shard(0) on the data dim first
            assert placement.endswith(expected), (name, placement)
    assert set(two["pp_llama_lora_1f1b"]["lora_layout"].values()) == {"local"}
