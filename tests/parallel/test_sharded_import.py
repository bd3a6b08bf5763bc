"""Hugging Face / lmforge folders imported straight into a sharded layout (gloo, CPU, 2 and 4
processes).

Every rank builds the model on the meta device, parallelizes it, and reads only its shards
(lmforge.parallel.load). Checked against the whole-model import that every rank used to do
(load_pretrained, then parallelize):

- every tensor a rank holds, gathered with full_tensor, equals the whole-model import bit for bit
  (buffers included), and together the ranks hold every parameter;
- one training step on the same layout gives the same loss and the same gradients, bit for bit, and
  the loss of one process with the whole model to fp32 tolerance;
- memory: an AllocationMeter (a TorchDispatchMode weighing every tensor storage that torch ops hand
  out, safetensors' mapped tensors included) shows each rank's peak during the load at most its own
  shards plus two full tensors (the one read and its converted copy), a bound set below the whole
  model's bytes, while the same meter over load_pretrained shows at least the whole model: the check
  fails if a rank materialises the model. A pipeline rank never allocates the other stage's layers,
  and slices read from an lmforge folder amount to no more than the rank's own shards.
- the Trainer (4 processes, tp=2 x pp=2, from an HF folder, load_pretrained forbidden) trains like
  the same run forced onto the whole-model path (bit for bit) and like one process (fp32 tolerance).
- LoRA: the meta model wrapped with adapters, laid out, its base read and its adapters drawn per
  rank (init_adapters) equals apply_lora on the whole model bit for bit, in every layout that
  shards, fp32 and bf16 base; a LoRA Trainer run sets up without load_pretrained, under the whole
  model's bytes, and trains like the whole path bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import hf_tiny_configs
from tests.parallel.launch import free_port

WORKER = Path(__file__).with_name("sharded_import_worker.py")
# vocabulary 300 padded to a multiple of 128 x TP: the loader re-pads the source's 384 rows
MULTIPLE = 256


def _hf_model(name: str, layers: int):
    cls, cfg = hf_tiny_configs()[name]
    cfg.num_hidden_layers = layers  # GPT-2's n_layer too (transformers' attribute map)
    # local/global layers (Gemma 3): the pattern over the new depth
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = (cfg.layer_types * layers)[:layers]
    # No dropout: the steps compared draw no random masks.
    if name == "gpt2":
        cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    if name == "bert":
        cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = 0.0
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # every parameter non-trivial (biases and norms too)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """HF folders (safetensors) of GPT-NeoX and Llama with GQA (4 layers: 2 per pipeline stage),
    GPT-2 (tied embeddings) and BERT, lmforge folders of the first two, a word-level tokenizer
    and a corpus for the trainer."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from lmforge.data.indexed import IndexedDatasetWriter
    from lmforge.models.hf import import_hf

    root = tmp_path_factory.mktemp("sharded")
    for name, layers in (
        ("gpt_neox", 4),
        ("llama_gqa", 4),
        ("gpt2", 2),
        ("bert", 4),
        ("phi3", 4),
        ("olmo2", 4),
        ("gemma3", 4),
        ("mixtral", 4),
        ("qwen3_moe", 4),
    ):
        _hf_model(name, layers).save_pretrained(root / name)
    for name in ("gpt_neox", "llama_gqa"):
        import_hf(root / name, root / f"{name}_lmforge")
    Tokenizer(WordLevel({f"t{i}": i for i in range(300)}, unk_token="t0")).save(
        str(root / "llama_gqa" / "tokenizer.json")
    )
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(root / "corpus_text_document", np.uint16) as writer:
        for _ in range(200):
            n, start, step = rng.integers(5, 100), rng.integers(0, 300), rng.integers(1, 5)
            writer.add_document((start + step * np.arange(n)) % 300)
    return root


def _launch(world: int, spec: dict, tmp: Path) -> list[dict]:
    (tmp / "spec.json").write_text(json.dumps(spec))
    port, procs = free_port(), []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(tmp / "spec.json"), str(tmp / "out.json")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        errors = [p.communicate(timeout=400)[1] for p in procs]
    finally:
        for p in procs:  # a hang is a failure; never leave ranks behind
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for e in errors)
    return json.loads((tmp / "out.json").read_text())


def _case(source: Path, parallel: dict, **extra) -> dict:
    return {"source": str(source), "parallel": parallel, "multiple": MULTIPLE, **extra}


def _check(name: str, r: dict, pp: int, from_slices: bool, widening: int = 1) -> None:
    """One rank's result of one case (`widening`: the source's bytes per byte held, 2 for fp32
    read into bf16)."""
    assert r["mismatched"] == [], (name, r["mismatched"])
    assert r["all_held"] == r["expected_names"], name  # the ranks together hold the whole model
    # other stages' layers stay meta
    assert r["allocated_elsewhere"] == [], (name, r["allocated_elsewhere"])
    assert r["loss"] == r["ref_loss"] and r["grads_differ"] == [], (
        name,
        r["loss"],
        r["ref_loss"],
        r["grads_differ"],
    )
    assert r["loss"] == pytest.approx(r["single_loss"], rel=1e-5), name
    # Memory. The bound must be below the whole model for the check to mean anything; the meter must
    # see the whole model when load_pretrained builds it.
    bound = r["local_bytes"] + 2 * r["largest_bytes"]
    assert bound < r["whole_bytes"] <= r["whole_load_peak"], (
        name,
        bound,
        r["whole_bytes"],
        r["whole_load_peak"],
    )
    assert r["peak_bytes"] <= bound, (name, r["peak_bytes"], bound)
    # About 1/TP of a stage's tensors, plus the replicated norms (and a tied embedding's second
    # copy).
    assert (
        r["local_bytes"] == r["local_bytes_measured"] < r["whole_bytes"] * (0.6 if pp == 1 else 0.4)
    ), name
    # get_slice: only this rank's rows/columns (fewer where vocabulary padding is zeroed)
    if from_slices:
        assert r["read_bytes"] <= widening * r["local_bytes"], (
            name,
            r["read_bytes"],
            r["local_bytes"],
        )
    # the HF tensors read (recorded in HFWeights.get) belong to this rank's layers only
    elif "_hf_" in name:

        def layers(names, pattern=r"^layers\.(\d+)\."):
            return {int(m) for n in names for m in re.findall(pattern, n)}

        read = layers(r["hf_read"], r"\.(?:layers|h|layer)\.(\d+)\.")
        held, every = layers(r["held"]), layers(r["expected_names"])
        assert read == held and (held == every) == (pp == 1), (name, read, held)


@pytest.mark.slow
def test_import_into_tensor_parallel(sources, tmp_path):
    cases = {
        "neox_hf_tp2": _case(sources / "gpt_neox", {"tensor": 2}),
        "llama_gqa_hf_tp2": _case(sources / "llama_gqa", {"tensor": 2}),
        "neox_lmforge_tp2": _case(sources / "gpt_neox_lmforge", {"tensor": 2}),
        # MLM head bias, position and token-type tables
        "bert_hf_tp2": _case(sources / "bert", {"tensor": 2}),
        # Phi-3: each rank's rows of the fused qkv_proj / gate_up_proj; OLMo 2: whole-projection q/k
        # norms split like the heads; Gemma 3: per-head q/k norms, sandwich norms, the local layers'
        # own rotary.
        "phi3_hf_tp2": _case(sources / "phi3", {"tensor": 2}),
        "olmo2_hf_tp2": _case(sources / "olmo2", {"tensor": 2}),
        "gemma3_hf_tp2": _case(sources / "gemma3", {"tensor": 2}),
        # Mixtures of experts: each rank's intermediate rows of every expert, stacked from the
        # per-expert tensors (Qwen3-MoE: one dense layer among them).
        "mixtral_hf_tp2": _case(sources / "mixtral", {"tensor": 2}),
        "qwen3_moe_hf_tp2": _case(sources / "qwen3_moe", {"tensor": 2}),
    }
    ranks = _launch(2, {"cases": cases}, tmp_path)
    for results in ranks:
        for name, r in results.items():
            _check(name, r, pp=1, from_slices="lmforge" in name)


@pytest.mark.slow
def test_import_into_tensor_x_pipeline_and_train(sources, tmp_path):
    """tp=2 x pp=2 from HF and lmforge folders (GPT-2: the tied embedding on both end stages),
    MoE models under expert parallelism (with FSDP2 over 4, pp=2, and tp=2); a training
    checkpoint of the imported weights loaded into FSDP x TP; then the Trainer on tp=2 x pp=2."""
    tp_pp = {"tensor": 2, "pipeline": 2}
    ckpt = tmp_path / "ckpt"
    cases = {
        "neox_hf_tp2pp2": _case(sources / "gpt_neox", tp_pp, save_checkpoint=str(ckpt)),
        "llama_gqa_hf_tp2pp2": _case(sources / "llama_gqa", tp_pp),
        "llama_gqa_lmforge_tp2pp2": _case(sources / "llama_gqa_lmforge", tp_pp),
        "gpt2_tied_hf_tp2pp2": _case(sources / "gpt2", tp_pp),
        "mixtral_hf_tp2pp2": _case(sources / "mixtral", tp_pp),
        # Expert parallelism: each rank holds its ep rank's experts, and of those its FSDP2 shard
        # (one of the two experts); under a pipeline, its stage's layers only.
        "mixtral_hf_ep2": _case(sources / "mixtral", {"expert": 2}),
        "qwen3_moe_hf_ep2pp2": _case(sources / "qwen3_moe", {"expert": 2, "pipeline": 2}),
        # Beside tensor parallelism: its ep rank's experts, of each its tensor rank's intermediate
        # rows.
        "mixtral_hf_ep2tp2": _case(sources / "mixtral", {"expert": 2, "tensor": 2}),
        "qwen3_moe_hf_ep2tp2_nosp": _case(
            sources / "qwen3_moe", {"expert": 2, "tensor": 2, "sequence_parallel": False}
        ),
        "neox_checkpoint_fsdp2_tp2": _case(
            ckpt, {"tensor": 2, "data_shard": 2}, reference=str(sources / "gpt_neox")
        ),
    }
    args = [
        f"model.init_from={sources / 'llama_gqa'}",
        f"model.make_vocab_size_divisible_by={MULTIPLE}",
        f"data.paths=[{sources / 'corpus_text_document'}]",
        "data.seq_length=32",
        "trainer.max_steps=2",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        "trainer.val_check_interval=0",
        "trainer.precision=fp32",
        "optim.lr=3e-3",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
    ]
    spec = {
        "cases": cases,
        "trainer": {
            "args": [*args, "parallel.tensor=2", "parallel.pipeline=2"],
            "dir": str(tmp_path / "runs"),
        },
    }
    ranks = _launch(4, spec, tmp_path)
    for results in ranks:
        results.pop("trainer")
        for name, r in results.items():
            _check(name, r, pp=2 if "pp2" in name else 1, from_slices="lmforge" in name)
    held = [set(results["gpt2_tied_hf_tp2pp2"]["held"]) for results in ranks]
    # first stage's and last stage's copy, both checked
    assert all("embed.weight" in names for names in held)

    sharded, whole = _curve(tmp_path / "runs" / "sharded"), _curve(tmp_path / "runs" / "whole")
    assert sharded == whole  # the same layout from the same weights: bit for bit
    _like_one_process(sharded, args, tmp_path / "one")


def _curve(run_dir: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows]


LORA = {"rank": 4, "alpha": 8.0, "targets": "all-linear"}


@pytest.mark.slow
def test_lora_runs_take_the_sharded_path(sources, tmp_path):
    """A LoRA run under a layout that shards the model wraps the meta model with adapters, lays
    it out, reads each rank's base shards and draws its pieces of the adapters: the base and the
    adapters (A from the seed, B zeros) equal apply_lora on the whole model bit for bit, as do
    one step's loss and adapter gradients (B set non-zero alike first, so that A trains too), in
    FSDP2, FSDP2 x TP (with SP), TP x PP (without SP), PP alone (one layer a stage: the other
    stages' draws advance the generator), from HF and lmforge folders, a training checkpoint and
    a fresh init, with the base in fp32 and bf16. Memory: each rank's peak while filling stays
    under the whole model's bytes (_check). Then the Trainer, LoRA on FSDP2 x TP from an HF
    folder: set up with load_pretrained forbidden and a peak under the whole model's bytes (the
    whole path's is above them), it trains like the whole path bit for bit, and like one process
    to fp32 tolerance."""
    ckpt = tmp_path / "ckpt"
    # two of the three parts of the fused qkv
    bf16 = {**LORA, "base_dtype": "bf16", "targets": "q,v"}
    cases = {
        "llama_gqa_hf_fsdp2tp2_lora": _case(
            sources / "llama_gqa",
            {"tensor": 2, "data_shard": 2},
            lora=LORA,
            save_checkpoint=str(ckpt),
        ),
        "neox_hf_tp2pp2_lora_nosp": _case(
            sources / "gpt_neox",
            {"tensor": 2, "pipeline": 2, "sequence_parallel": False, "loss_parallel": False},
            lora=LORA,
        ),
        "llama_gqa_lmforge_fsdp4_lora_bf16": _case(
            sources / "llama_gqa_lmforge", {"data_shard": 4}, lora=bf16
        ),
        "llama_gqa_checkpoint_pp2fsdp2_lora": _case(
            ckpt, {"pipeline": 2, "data_shard": 2}, lora=LORA, reference=str(sources / "llama_gqa")
        ),
        "llama_gqa_fresh_pp4_lora": _case(
            sources / "llama_gqa", {"pipeline": 4}, lora=LORA, fresh=True
        ),
        # Adapters on the experts too (all-linear), under expert x tensor parallelism.
        "qwen3_moe_hf_ep2tp2_lora": _case(
            sources / "qwen3_moe", {"expert": 2, "tensor": 2}, lora=LORA
        ),
    }
    args = [
        f"model.init_from={sources / 'llama_gqa'}",
        f"model.make_vocab_size_divisible_by={MULTIPLE}",
        f"data.paths=[{sources / 'corpus_text_document'}]",
        "data.seq_length=32",
        "trainer.max_steps=2",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        "trainer.val_check_interval=0",
        "trainer.precision=fp32",
        "optim.lr=3e-2",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
        "lora.rank=4",
        "lora.targets=all-linear",
    ]
    spec = {
        "cases": cases,
        "trainer": {
            "args": [*args, "parallel.tensor=2", "trainer.data_parallel=fsdp"],
            "dir": str(tmp_path / "runs"),
        },
    }
    ranks = _launch(4, spec, tmp_path)
    for results in ranks:
        trainer = results.pop("trainer")
        # The whole path builds the whole model on every rank; the sharded set-up never holds as
        # much: its shards, one source tensor and its conversion, and what else a run's set-up
        # allocates.
        assert trainer["sharded_peak"] < trainer["whole_bytes"] <= trainer["whole_peak"], trainer
        for name, r in results.items():
            _check(
                name,
                r,
                pp=2 if "pp" in name else 1,
                from_slices="lmforge" in name,
                widening=2 if "bf16" in name else 1,
            )
            assert (
                r["trained"] and all(".lora_" in n for n in r["trained"]) and r["zero_grads"] == []
            ), name
    sharded, whole = _curve(tmp_path / "runs" / "sharded"), _curve(tmp_path / "runs" / "whole")
    assert sharded == whole  # the same layout from the same weights and seed: bit for bit
    _like_one_process(sharded, args, tmp_path / "one")


def _like_one_process(curve: list[tuple[float, float]], args: list[str], run_dir: Path) -> None:
    """`curve` (a run of `args` on some layout) equals the same run in this process, to fp32
    tolerance."""
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(load_run_config(None, [*args, f"run_dir={run_dir}"])).fit()
    finally:
        torch.set_num_threads(threads)
    one = _curve(run_dir)
    assert len(one) == len(curve) == 2
    for (loss, norm), (loss1, norm1) in zip(curve, one, strict=True):
        assert loss == pytest.approx(loss1, rel=2e-5) and norm == pytest.approx(norm1, rel=2e-4), (
            curve,
            one,
        )
