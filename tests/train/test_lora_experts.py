"""LoRA runs on a mixture of experts (Mixtral, Qwen3-MoE): only the adapters train, on the
experts and the router too; the four ways to run the result (lmforge merged, lmforge base +
adapter, transformers' merged hf/, PEFT's base + hf-adapter/) and `serve --lora` give the same
logits; a resumed run and `export-hf` of its checkpoint give the uninterrupted run's curve and
exports; expert and tensor parallelism train and export like one process."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from lmforge.models import load_pretrained
from lmforge.models.peft_read import load_peft_adapter
from lmforge.train.trainer import Trainer
from tests.parallel.launch import torchrun
from tests.train.test_lora import TP_FINETUNE, _curve, _logits, lora_args, lora_config

tf = pytest.importorskip("transformers")
TOL = 1e-5


@pytest.fixture(scope="module")
def tiny_moe(shared_data, tmp_path_factory):
    """Small random Mixtral and Qwen3-MoE (Hugging Face folders, layer 1 of Qwen3-MoE a dense
    MLP) with the real GPT-2 tokenizer beside them."""
    common = dict(
        vocab_size=50257,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=50256,
        eos_token_id=50256,
        num_experts_per_tok=2,
    )
    configs = {
        "mixtral": (
            tf.MixtralForCausalLM,
            tf.MixtralConfig(
                **common, intermediate_size=32, num_local_experts=4, router_aux_loss_coef=0.02
            ),
        ),
        "qwen3_moe": (
            tf.Qwen3MoeForCausalLM,
            tf.Qwen3MoeConfig(
                **common,
                head_dim=8,
                intermediate_size=64,
                moe_intermediate_size=16,
                num_experts=4,
                mlp_only_layers=[1],
                router_aux_loss_coef=0.01,
            ),
        ),
    }
    out = {}
    for name, (cls, config) in configs.items():
        torch.manual_seed(0)  # the same weights in every session (they were drawn before the seed)
        model = cls(config)
        folder = tmp_path_factory.mktemp(name) / "hf"
        model.save_pretrained(folder)
        shutil.copyfile(
            shared_data / "tokenizers" / "gpt2" / "tokenizer.json", folder / "tokenizer.json"
        )
        out[name] = folder
    return out


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {a} times {b}?"},
                {"role": "assistant", "content": f"{a} times {b} is {a * b}."},
            ]
        }
        for a in range(8)
        for b in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ids():
    return torch.randint(0, 50257, (2, 23), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "targets"), [("mixtral", "experts"), ("qwen3_moe", "all-linear")]
)
def test_a_moe_lora_run_trains_adapters_only_and_exports_what_peft_loads(
    family, targets, tiny_moe, chats, tmp_path, capsys
):
    peft = pytest.importorskip("peft")
    base_dir, run = tiny_moe[family], tmp_path / "run"
    trainer = Trainer(
        lora_config(
            base_dir, chats, run, "checkpoint.convert_to_hf=true", f"lora.targets={targets}"
        )
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any(".experts.lora_" in n for n in trainable) and all(".lora_" in n for n in trainable)
    assert any(".router.lora_" in n for n in trainable) == (targets == "all-linear")
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in trainer.model.named_parameters() if n in trainable}
    trainer.fit()
    after = dict(trainer.model.named_parameters())
    # the base stays frozen
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    assert all(not torch.equal(before[n], after[n]) for n in trainable if ".experts.lora_B." in n)
    from torch.distributed.checkpoint import FileSystemReader

    step = sorted((run / "checkpoints").glob("step-*"))[-1]
    moments = {
        k
        for k in FileSystemReader(str(step)).read_metadata().state_dict_metadata
        if k.startswith("optim.state.")
    }
    # the optimizer state holds the adapters alone
    assert moments and all(".lora_" in k for k in moments)

    ids = _ids()
    trainer.model.eval()
    trained = _logits(trainer.model, ids)
    # the adapters changed it
    assert (trained - _logits(load_pretrained(base_dir), ids)).abs().max() > 1e-4
    base_plus = load_pretrained(base_dir)
    load_peft_adapter(base_plus, run / "hf-adapter")
    hf_peft = peft.PeftModel.from_pretrained(
        tf.AutoModelForCausalLM.from_pretrained(base_dir), run / "hf-adapter"
    )
    # `lmforge serve BASE --lora hf-adapter/` (and generate)
    from lmforge.cli.serve import load_served

    served, _ = load_served(base_dir, str(run / "hf-adapter"), "cpu", None)
    for name, model in [
        ("lmforge merged", load_pretrained(run / "model")),
        ("lmforge base + adapter", base_plus),
        ("transformers merged", tf.AutoModelForCausalLM.from_pretrained(run / "hf").eval()),
        ("PEFT", hf_peft.eval()),
        ("served", served),
    ]:
        assert (_logits(model, ids) - trained).abs().max().item() <= TOL, name
    config = json.loads((run / "hf-adapter" / "adapter_config.json").read_text())
    assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= set(config["target_parameters"])
    # `lmforge generate BASE --lora DIR` (greedy) writes what the merged model does
    from lmforge.cli import main

    texts = []
    for folder, extra in [(base_dir, ["--lora", str(run / "hf-adapter")]), (run / "model", [])]:
        capsys.readouterr()
        assert (
            main(
                [
                    "generate",
                    str(folder),
                    "--prompt",
                    "What is 3 times 5?",
                    "--max-new-tokens",
                    "8",
                    "--temperature",
                    "0",
                    *extra,
                ]
            )
            == 0
        )
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
    assert config["lora_dropout"] == 0.0 and config["base_model_name_or_path"] == str(
        base_dir.resolve()
    )


@pytest.mark.slow
def test_a_moe_lora_run_resumes_bit_exactly_and_its_checkpoint_exports_the_same(
    tiny_moe, chats, tmp_path
):
    """Cut after step 2 (its last checkpoint removed, as if killed before step 4's): the rerun
    continues the curve bit for bit; `export-hf` of step 4 writes the run's hf/ and hf-adapter/
    file for file."""
    from lmforge.cli import main

    extra = (
        "lora.targets=all-linear",
        "checkpoint.every_n_steps=2",
        "checkpoint.save_top_k=-1",
        "checkpoint.convert_to_hf=true",
    )
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    Trainer(lora_config(tiny_moe["mixtral"], chats, whole, *extra)).fit()
    Trainer(lora_config(tiny_moe["mixtral"], chats, cut, *extra)).fit()
    shutil.rmtree(cut / "checkpoints" / "step-00000004")
    Trainer(lora_config(tiny_moe["mixtral"], chats, cut, *extra)).fit()
    assert _curve(cut) == _curve(whole) and len(_curve(whole)) == 4
    out = tmp_path / "export" / "hf"
    assert main(["export-hf", str(whole / "checkpoints" / "step-00000004"), str(out)]) == 0
    for ours, theirs in [
        (out, whole / "hf"),
        (out.with_name("hf-adapter"), whole / "hf-adapter"),
        (cut / "hf-adapter", whole / "hf-adapter"),
    ]:
        written = sorted(p.name for p in theirs.iterdir())
        assert sorted(p.name for p in ours.iterdir()) == written
        for name in written:
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


@pytest.fixture(scope="module")
def one_process(tiny_moe, chats, tmp_path_factory):
    """The reference run, at one thread as each rank of the layouts runs: its sums then do not
    depend on how many threads a loaded machine lends the GEMMs, which moved the trained adapters
    past the comparison's tolerance (Adam turns noise-level gradient differences into whole steps
    on entries whose gradient is near zero)."""
    run = tmp_path_factory.mktemp("moe_lora") / "one"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(
            lora_config(
                tiny_moe["qwen3_moe"],
                chats,
                run,
                "checkpoint.convert_to_hf=true",
                "checkpoint.every_n_steps=2",
                "checkpoint.save_top_k=-1",
            )
        ).fit()
    finally:
        torch.set_num_threads(threads)
    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("parallel.expert=2", "trainer.data_parallel=fsdp"),
        pytest.param(
            ("parallel.tensor=2", "model.make_vocab_size_divisible_by=256"), marks=TP_FINETUNE
        ),
    ],
    ids=["ep2", "tp2"],
)
def test_expert_and_tensor_parallel_moe_lora_runs_train_and_export_like_one_process(
    layout, tiny_moe, chats, tmp_path, one_process
):
    """2 gloo ranks, all-linear on Qwen3-MoE (attention, router, experts, the dense layer's MLP):
    the experts' factors sharded with the experts (EP) or split on their intermediate rows (TP).
    The same losses and gradient norms as one process, the same hf/ and hf-adapter/; and the EP
    checkpoint of step 2 resumes on one process to the one-process curve."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    args = lora_args(
        tiny_moe["qwen3_moe"],
        chats,
        run,
        "checkpoint.convert_to_hf=true",
        "checkpoint.every_n_steps=2",
        "checkpoint.save_top_k=-1",
        *layout,
    )
    r = torchrun(2, ["-m", "lmforge.cli", "finetune", os.devnull, *args])
    assert r.returncode == 0, r.stderr[-3000:]

    def close(a, b):
        for (la, ga), (lb, gb) in zip(a, b, strict=True):
            assert la == pytest.approx(lb, rel=1e-5) and ga == pytest.approx(gb, rel=1e-4)

    close(_curve(run), _curve(one_process))
    for name in ("hf/config.json", "hf-adapter/adapter_config.json"):
        assert json.loads((run / name).read_text()) == json.loads((one_process / name).read_text())
    # The adapters after 4 AdamW steps: the layouts sum in another order, and Adam turns an entry's
    # noise-level gradient difference into a difference of its step (seen: 3e-6 on an entry of 5e-3
    # of a B at most 2.5e-2).
    for name, rel in (
        ("hf-adapter/adapter_model.safetensors", 5e-4),
        ("hf/model.safetensors", 1e-4),
    ):
        ours, theirs = load_file(run / name), load_file(one_process / name)
        assert ours.keys() == theirs.keys()
        for k, t in theirs.items():
            torch.testing.assert_close(
                ours[k], t, rtol=1e-4, atol=rel * t.abs().max().item(), msg=k
            )
    if layout[0] == "parallel.expert=2":
        shutil.rmtree(run / "checkpoints" / "step-00000004")
        Trainer(
            lora_config(
                tiny_moe["qwen3_moe"],
                chats,
                run,
                "checkpoint.convert_to_hf=true",
                "checkpoint.every_n_steps=2",
                "checkpoint.save_top_k=-1",
            )
        ).fit()
        close(_curve(run), _curve(one_process))


@pytest.mark.slow
def test_a_moe_qlora_run_holds_its_experts_in_nf4_and_trains_like_one_process_under_fsdp2(
    tiny_moe, chats, tmp_path
):
    """QLoRA on Mixtral (lora.base_dtype=nf4): the stacked experts are NF4 too (torchao's 2-D
    tensor), read a block at a time and sharded by FSDP2. Over 2 gloo ranks the losses and
    adapters equal one process's; the checkpoint holds no base weights, and export-hf of it
    writes the run's own folders; the merged hf/ holds the experts in bf16 and computes what
    lmforge's merged model does, and PEFT loads hf-adapter/ onto the base."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    pytest.importorskip("torchao")
    peft = pytest.importorskip("peft")
    common = ["lora.base_dtype=nf4", "lora.targets=all-linear", "checkpoint.convert_to_hf=true"]
    one, two = tmp_path / "one", tmp_path / "two"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (the one_process fixture says why)
    try:
        Trainer(lora_config(tiny_moe["mixtral"], chats, one, *common)).fit()
    finally:
        torch.set_num_threads(threads)
    r = torchrun(
        2,
        [
            "-m",
            "lmforge.cli",
            "finetune",
            os.devnull,
            *lora_args(tiny_moe["mixtral"], chats, two, *common, "trainer.data_parallel=fsdp"),
        ],
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        "lora.base_dtype=nf4: 6 linear weights in NF4 (a fused q/k/v or gate/up one counted once) and 4 stacked "
        "expert weights"
    ) in r.stderr, r.stderr[-3000:]
    for (la, ga), (lb, gb) in zip(_curve(two), _curve(one), strict=True):
        assert la == pytest.approx(lb, rel=1e-5) and ga == pytest.approx(gb, rel=1e-4)
    adapters = [load_file(run / "hf-adapter" / "adapter_model.safetensors") for run in (two, one)]
    assert adapters[0].keys() == adapters[1].keys() and any("experts" in k for k in adapters[0])
    for k, t in adapters[1].items():
        torch.testing.assert_close(
            adapters[0][k], t, rtol=1e-4, atol=5e-4 * t.abs().max().item(), msg=k
        )
    step = sorted((two / "checkpoints").glob("step-*"))[-1]
    saved = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    assert "model.layers.0.mlp.experts.lora_A.gate_up" in saved
    assert not any(k.endswith((".experts.gate_up", ".experts.down", "qkv.weight")) for k in saved)
    # export-hf of the 2-rank checkpoint (its base read again): the run's own folders
    from lmforge.cli import main

    out = tmp_path / "export" / "hf"
    assert main(["export-hf", str(step), str(out)]) == 0
    for ours, theirs in [(out, two / "hf"), (out.with_name("hf-adapter"), two / "hf-adapter")]:
        for name in sorted(p.name for p in theirs.iterdir()):
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    merged = load_file(one / "hf" / "model.safetensors")
    experts = [t for k, t in merged.items() if "experts" in k]
    # Mixtral's w1, w2, w3
    assert len(experts) == 2 * 4 * 3 and all(t.dtype == torch.bfloat16 for t in experts)
    ids = _ids()
    ours = _logits(load_pretrained(one / "model", dtype=torch.float32), ids)
    hf = tf.AutoModelForCausalLM.from_pretrained(one / "hf", torch_dtype=torch.float32).eval()
    assert (_logits(hf, ids) - ours).abs().max().item() <= TOL
    peft.PeftModel.from_pretrained(
        tf.AutoModelForCausalLM.from_pretrained(tiny_moe["mixtral"]), one / "hf-adapter"
    )
