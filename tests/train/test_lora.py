"""LoRA runs: only the adapters train (gradients, optimizer state), and the four ways to run the
result (lmforge merged, lmforge base + adapter, transformers' merged hf/, PEFT's base +
hf-adapter/) give the same logits."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.models import load_pretrained
from lmforge.models.peft_read import load_peft_adapter
from lmforge.train.config import load_run_config
from lmforge.train.trainer import Trainer
from tests.conftest import needs_torch
from tests.parallel.launch import torchrun

TP_FINETUNE = needs_torch((2, 9), "LoRA under tensor parallelism")

tf = pytest.importorskip("transformers")
TOL = 1e-5


def lora_args(model, data, run_dir, *extra):
    return [
        f"model.init_from={model}",
        "data.task=sft",
        f"data.train_file={data}",
        "data.seq_length=48",
        "trainer.max_steps=4",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",
        "trainer.val_check_interval=0",
        "trainer.precision=fp32",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
        "optim.lr=1e-2",
        "optim.weight_decay=0.0",
        f"run_dir={run_dir}",
        "lora.rank=4",
        "lora.alpha=8",
        "lora.targets=all-linear",
        *extra,
    ]


def lora_config(model, data, run_dir, *extra):
    return load_run_config(None, lora_args(model, data, run_dir, *extra))


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.slow
def test_a_lora_run_trains_adapters_only_and_exports_what_peft_loads(tiny_llama, chats, tmp_path):
    peft = pytest.importorskip("peft")
    trainer = Trainer(
        lora_config(tiny_llama, chats, tmp_path / "run", "checkpoint.convert_to_hf=true")
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in trainer.model.named_parameters() if n in trainable}
    trainer.fit()
    after = dict(trainer.model.named_parameters())
    # the base stays frozen
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    assert any(not torch.equal(before[n], after[n]) for n in trainable if ".lora_B." in n)
    # The checkpoint's optimizer state holds the adapters alone.
    from torch.distributed.checkpoint import FileSystemReader

    step = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    keys = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    moments = {k for k in keys if k.startswith("optim.state.")}
    assert moments and all(".lora_" in k for k in moments)

    ids = torch.randint(0, 50257, (2, 23), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()
    trained = _logits(trainer.model, ids)  # lmforge base + adapter, as trained
    run = tmp_path / "run"
    merged = _logits(load_pretrained(run / "model"), ids)
    base_plus = load_pretrained(tiny_llama)
    load_peft_adapter(base_plus, run / "hf-adapter")
    hf_merged = tf.AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    hf_peft = peft.PeftModel.from_pretrained(
        tf.AutoModelForCausalLM.from_pretrained(tiny_llama), run / "hf-adapter"
    ).eval()
    # the adapters changed it
    assert (trained - _logits(load_pretrained(tiny_llama), ids)).abs().max() > 1e-4
    for name, logits in [
        ("lmforge merged", merged),
        ("lmforge base + adapter", _logits(base_plus, ids)),
        ("transformers merged", _logits(hf_merged, ids)),
        ("PEFT", _logits(hf_peft, ids)),
    ]:
        assert (logits - trained).abs().max().item() <= TOL, name
    from lmforge.cli.serve import load_served  # `lmforge serve BASE --lora hf-adapter/`

    served, chat_folder = load_served(tiny_llama, str(run / "hf-adapter"), "cpu", None)
    assert (
        _logits(served, ids) - trained
    ).abs().max().item() <= TOL and chat_folder == run / "hf-adapter"
    config = json.loads((run / "hf-adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_llama.resolve()) and config["r"] == 4
    assert (run / "hf-adapter" / "chat_template.jinja").is_file()
    # the base model's license files go with its derivatives
    for folder in ("model", "hf", "hf-adapter"):
        for name in ("LICENSE", "USE_POLICY.md"):
            assert (run / folder / name).read_text() == (tiny_llama / name).read_text(), folder


def test_bad_lora_settings_fail_before_anything_is_written(tiny_llama, chats, tmp_path):
    from lmforge.errors import UserError

    for extra, message in [
        ("lora.rank=0", "lora.rank must be >= 1, got 0"),
        ("lora.targets=q,qq", "lora.targets: unknown target 'qq'"),
    ]:
        with pytest.raises(UserError, match=message):
            Trainer(lora_config(tiny_llama, chats, tmp_path / "run", extra))
    assert not (tmp_path / "run").exists()


def _curve(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows]


@pytest.mark.slow
def test_a_bf16_base_under_fsdp2_trains_like_one_process(tiny_llama, chats, tmp_path):
    """lora.bf16_base with FSDP2 over 2 gloo ranks: the same losses and adapter updates as one
    process (FSDP2 gathers the bf16 base and the fp32 adapters of a block together, as bytes),
    and the PEFT export loads in peft."""
    import os

    from safetensors.torch import load_file

    peft = pytest.importorskip("peft")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["lora.bf16_base=true", "checkpoint.convert_to_hf=true"]
    one = tmp_path / "one"
    Trainer(lora_config(tiny_llama, chats, one, *common)).fit()
    two = tmp_path / "two"
    args = lora_args(tiny_llama, chats, two, *common, "trainer.data_parallel=fsdp")
    r = torchrun(2, ["-m", "lmforge.cli", "finetune", os.devnull, *args], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    # The same bf16 forward on the same rows: equal losses; the adapter gradients are summed over
    # ranks in another order, so their norm (and the Adam updates) agree to fp32 rounding, far
    # inside bf16's 2^-8.
    for (la, ga), (lb, gb) in zip(_curve(two), _curve(one), strict=True):
        assert la == pytest.approx(lb, rel=1e-6) and ga == pytest.approx(gb, rel=1e-5)
    # the sharded checkpoint holds the base in bf16
    from torch.distributed.checkpoint import FileSystemReader

    meta = (
        FileSystemReader(str(two / "checkpoints" / "step-00000004"))
        .read_metadata()
        .state_dict_metadata
    )
    dtypes = {
        k: m.properties.dtype
        for k, m in meta.items()
        if k.startswith("model.") and hasattr(m, "properties")
    }
    assert {d for k, d in dtypes.items() if ".lora_" not in k} == {torch.bfloat16}
    assert {d for k, d in dtypes.items() if ".lora_" in k} == {torch.float32}
    adapters_two, adapters_one = (
        load_file(run / "hf-adapter" / "adapter_model.safetensors") for run in (two, one)
    )
    assert adapters_two.keys() == adapters_one.keys()
    assert all(t.dtype == torch.float32 for t in adapters_two.values())
    for k, t in adapters_two.items():
        torch.testing.assert_close(t, adapters_one[k], rtol=1e-4, atol=1e-6)
    # the adapters trained
    assert any(t.abs().max() > 0 for k, t in adapters_two.items() if "lora_B" in k)
    # PEFT loads the 2-rank adapter and computes what lmforge's base + the same adapter does (fp32,
    # ≤ 1e-5).
    ids = torch.randint(0, 50257, (2, 23), generator=torch.Generator().manual_seed(0))
    base_plus = load_pretrained(tiny_llama)
    load_peft_adapter(base_plus, two / "hf-adapter")
    hf_peft = peft.PeftModel.from_pretrained(
        tf.AutoModelForCausalLM.from_pretrained(tiny_llama), two / "hf-adapter"
    ).eval()
    expected = _logits(base_plus.eval(), ids)
    assert (_logits(hf_peft, ids) - expected).abs().max().item() <= TOL
    # The merged export holds the bf16 base with the update folded in: its weights are rounded to
    # bf16 (2^-9 relative), which moves these logits (|logits| < 0.6) by about 2e-3 (measured
    # 1.9e-3); 1e-2 leaves 5x room.
    merged = tf.AutoModelForCausalLM.from_pretrained(two / "hf", torch_dtype=torch.float32).eval()
    assert (_logits(merged, ids) - expected).abs().max().item() <= 1e-2


@pytest.fixture(scope="module")
def one_process_export(tiny_llama, chats, tmp_path_factory):
    """A LoRA run on one process with its exports: what every layout's run must equal."""
    run = tmp_path_factory.mktemp("lora") / "one"
    Trainer(lora_config(tiny_llama, chats, run, "checkpoint.convert_to_hf=true")).fit()
    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            ("parallel.tensor=2", "model.make_vocab_size_divisible_by=256"), marks=TP_FINETUNE
        ),
        ("parallel.pipeline=2",),
    ],
    ids=["tp2", "pp2"],
)
def test_lora_under_tensor_and_pipeline_parallelism_trains_and_exports_like_one_process(
    tiny_llama, chats, tmp_path, one_process_export, layout
):
    """2 gloo ranks, the adapters split like their layers (TP) or held by their stage (PP): the
    same losses and gradient norms as one process, and the same hf/ (merged) and hf-adapter/
    (PEFT) folders."""
    import os

    from safetensors.torch import load_file

    run, one = tmp_path / "run", one_process_export
    args = lora_args(tiny_llama, chats, run, "checkpoint.convert_to_hf=true", *layout)
    r = torchrun(2, ["-m", "lmforge.cli", "finetune", os.devnull, *args])
    assert r.returncode == 0, r.stderr[-3000:]
    for (la, ga), (lb, gb) in zip(_curve(run), _curve(one), strict=True):
        assert la == pytest.approx(lb, rel=1e-6) and ga == pytest.approx(gb, rel=1e-5)
    for folder in ("hf", "hf-adapter"):
        assert sorted(p.name for p in (run / folder).iterdir()) == sorted(
            p.name for p in (one / folder).iterdir()
        )
    for name in ("hf/config.json", "hf-adapter/adapter_config.json"):
        assert json.loads((run / name).read_text()) == json.loads((one / name).read_text())
    # Gradients summed in another order move 4 Adam steps (lr 1e-2) by ~2e-5 of an adapter's largest
    # value.
    for name in ("hf-adapter/adapter_model.safetensors", "hf/model.safetensors"):
        ours, theirs = load_file(run / name), load_file(one / name)
        assert ours.keys() == theirs.keys()
        for k, t in theirs.items():
            torch.testing.assert_close(
                ours[k], t, rtol=1e-4, atol=1e-4 * t.abs().max().item(), msg=k
            )
    adapters = load_file(run / "hf-adapter" / "adapter_model.safetensors")
    # the adapters trained
    assert any(t.abs().max() > 0 for k, t in adapters.items() if "lora_B" in k)


@pytest.mark.slow
@pytest.mark.parametrize("base", ["fp32", "bf16"])
def test_export_hf_of_a_lora_checkpoint_equals_the_runs_own_export(
    base, tiny_llama, chats, tmp_path, caplog
):
    """`lmforge export-hf RUN/checkpoints/step-N` of a LoRA run said "does not fit this model":
    the checkpoint holds the adapters beside the base. It writes what the run's
    checkpoint.convert_to_hf writes from the same weights: the merged Hugging Face folder and,
    beside it, the PEFT adapter folder (OUT-adapter), file for file."""
    from lmforge.cli import main

    run = tmp_path / "run"
    Trainer(
        lora_config(
            tiny_llama,
            chats,
            run,
            f"lora.base_dtype={base}",
            "checkpoint.convert_to_hf=true",
            "checkpoint.every_n_steps=2",
            "checkpoint.save_top_k=-1",
        )
    ).fit()
    out = tmp_path / "export" / "hf"
    assert main(["export-hf", str(run / "checkpoints" / "step-00000004"), str(out)]) == 0
    for ours, theirs in [(out, run / "hf"), (out.with_name("hf-adapter"), run / "hf-adapter")]:
        written = sorted(p.name for p in theirs.iterdir())
        assert sorted(p.name for p in ours.iterdir()) == written
        for name in written:
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    (out.with_name("hf-adapter") / "adapter_config.json").unlink()
    # a second export into the same place is refused before either folder is touched
    (out / "config.json").unlink()
    assert main(["export-hf", str(run / "checkpoints" / "step-00000004"), str(out)]) == 1
    assert (
        not (out / "config.json").exists()
        and not (out.with_name("hf-adapter") / "adapter_config.json").exists()
    )
    # An earlier checkpoint exports its own adapters; serve, generate and eval read the checkpoint
    # merged.
    assert (
        main(["export-hf", str(run / "checkpoints" / "step-00000002"), str(tmp_path / "hf2")]) == 0
    )
    ids = torch.randint(0, 50257, (2, 23), generator=torch.Generator().manual_seed(0))
    early = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf2", torch_dtype=torch.float32
    ).eval()
    with caplog.at_level("INFO", logger="lmforge.models.lora"):
        caplog.clear()
        served = load_pretrained(run / "checkpoints" / "step-00000002", dtype=torch.float32)
    # "LoRA rank 4 ... trainable parameters" is the training run's line, not a reader's
    assert not caplog.records
    assert (_logits(early, ids) - _logits(served, ids)).abs().max().item() <= TOL
    final = tf.AutoModelForCausalLM.from_pretrained(run / "hf", torch_dtype=torch.float32).eval()
    assert (_logits(early, ids) - _logits(final, ids)).abs().max().item() > 1e-4
    # model.init_from=CHECKPOINT starts from the merged weights, also where a sharded layout reads
    # the source itself.
    from lmforge.train.setup import init_model

    model, fill = init_model(
        load_run_config(
            None,
            [
                f"model.init_from={run / 'checkpoints' / 'step-00000002'}",
                f"run_dir={tmp_path / 'next'}",
            ],
        ),
        meta=True,
    )
    assert (
        fill is None
        and (_logits(model.eval().float(), ids) - _logits(served, ids)).abs().max().item() <= TOL
    )


def test_a_bf16_base_is_read_in_bf16_never_as_a_whole_fp32_copy(tiny_llama, chats, tmp_path):
    """lora.base_dtype=bf16 on one process from an fp32 folder: the Trainer's set-up reads the
    base in bf16. The meter counts the safetensors file it maps (the whole fp32 model) and what
    the run holds (a bf16 base, fp32 adapters), nothing more: before, it built the fp32 model
    whole from the file, then cast it (measured: 25.8 MB against 19.4 MB, file 13.0, held 6.5)."""
    from tests.parallel.meter import AllocationMeter

    whole_fp32 = sum(t.numel() * 4 for t in load_pretrained(tiny_llama).state_dict().values())
    with AllocationMeter() as meter:
        trainer = Trainer(lora_config(tiny_llama, chats, tmp_path / "run", "lora.base_dtype=bf16"))
    base = [p for n, p in trainer.model.named_parameters() if "lora_" not in n]
    assert {p.dtype for p in base} == {torch.bfloat16}
    held = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert meter.peak <= whole_fp32 + held + 0.05 * whole_fp32, (held, meter.peak, whole_fp32)
    trainer.close()


def test_an_adapters_base_is_a_folder_transformers_loads(tmp_path, caplog):
    """A LoRA run from a run's lmforge model/ (DPO after SFT) named that folder as the adapter's
    base_model_name_or_path, which peft.AutoPeftModelForCausalLM cannot read: the run's hf/
    beside it holds the same weights."""
    from lmforge.models.peft import peft_base

    run = tmp_path / "sft"
    for name, config in (("model", "lmforge.json"), ("hf", "config.json")):
        (run / name).mkdir(parents=True)
        (run / name / config).write_text("{}")
    assert peft_base(run / "hf") == str((run / "hf").resolve())
    assert peft_base(run / "model") == str((run / "hf").resolve())
    assert peft_base(None) is None
    (run / "hf" / "config.json").unlink()  # no Hugging Face folder beside it: kept, and said
    assert peft_base(run / "model") == str((run / "model").resolve())
    assert "is not a Hugging Face folder" in caplog.text


@pytest.mark.slow
def test_lora_on_a_classifier_trains_the_new_head_and_exports_pefts_seq_cls_folder(
    tiny_llama, shared_data, tmp_path
):
    """`lmforge finetune data.task=classification` with a lora section (this was refused: the new
    head would have stayed frozen): the adapters and the score head train, nothing else;
    hf-adapter/ is PEFT's SEQ_CLS folder (the head saved whole) and PEFT over the base,
    transformers' merged hf/ and the trained model give the same logits."""
    peft = pytest.importorskip("peft")
    lines = (shared_data / "classification" / "sst-2" / "train.tsv").read_text().splitlines()[:65]
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n")
    args = lora_args(
        tiny_llama,
        tmp_path / "train.tsv",
        tmp_path / "run",
        "data.task=classification",
        "checkpoint.convert_to_hf=true",
    )
    trainer = Trainer(load_run_config(None, args))
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert {n for n in trainable if ".lora_" not in n} == {"score.weight"}
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in trainer.model.named_parameters() if n in trainable}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    assert not torch.equal(before["score.weight"], after["score.weight"])

    run = tmp_path / "run"
    config = json.loads((run / "hf-adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["score"]
    # 50256 pads on PEFT's side
    ids = torch.randint(0, 50000, (2, 23), generator=torch.Generator().manual_seed(0))
    trained = _logits(trainer.model.eval(), ids)
    base = tf.AutoModelForSequenceClassification.from_pretrained(
        tiny_llama, num_labels=2, pad_token_id=50256
    )
    hf_peft = peft.PeftModel.from_pretrained(base.eval(), run / "hf-adapter").eval()
    hf_merged = tf.AutoModelForSequenceClassification.from_pretrained(
        run / "hf", pad_token_id=50256
    ).eval()
    for name, logits in [
        ("PEFT", _logits(hf_peft, ids)),
        ("transformers merged", _logits(hf_merged, ids)),
        ("lmforge merged", _logits(load_pretrained(run / "model"), ids)),
    ]:
        assert (logits - trained).abs().max().item() <= TOL, name
