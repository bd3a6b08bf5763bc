"""QLoRA runs (lora.base_dtype=nf4, torchao's NF4 base): the refusals, resume and export on one
process, and the layouts that hold the NF4 base (FSDP2, DDP, HSDP) against one process. The model
and data: tests/train/conftest.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lmforge.models import load_pretrained
from lmforge.train.trainer import Trainer
from tests.parallel.launch import torchrun
from tests.train.test_lora import TOL, _curve, _logits, lora_args, lora_config

tf = pytest.importorskip("transformers")


def test_qlora_is_refused_in_one_line_where_it_cannot_run(tiny_llama, chats, tmp_path, monkeypatch):
    """lora.base_dtype=nf4 needs torchao, a CUDA GPU or the CPU, and one process, DDP, or
    FSDP2/HSDP over a base read from a folder: each missing piece is one line naming the fix,
    before the run writes anything."""
    import importlib.util

    from lmforge.errors import UserError
    from lmforge.models.lora import LoRAConfig
    from lmforge.parallel.mesh import ParallelConfig
    from lmforge.train.lora import check_qlora

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torchao" else find_spec(name, *a),
    )
    with pytest.raises(
        UserError,
        match=r"^lora.base_dtype=nf4 \(QLoRA\) needs torchao, which is not installed: pip "
        r"install torchao$",
    ):
        Trainer(lora_config(tiny_llama, chats, tmp_path / "run", "lora.base_dtype=nf4"))
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    with pytest.raises(
        UserError, match=r"^lora.base_dtype must be one of fp32, bf16, nf4, got 'int4'$"
    ):
        lora_config(tiny_llama, chats, tmp_path / "run", "lora.base_dtype=int4")
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "torchao" else find_spec(name, *a),
    )
    nf4, cpu, cuda = LoRAConfig(base_dtype="nf4"), torch.device("cpu"), torch.device("cuda", 0)
    one, fsdp = ParallelConfig().resolved(1), ParallelConfig().resolved(4)
    for device in (cpu, cuda):
        check_qlora(nf4, device, one)  # one process or DDP, fresh or from anything
        check_qlora(nf4, device, ParallelConfig(data_replicate=4).resolved(4))
        check_qlora(nf4, device, fsdp, tiny_llama)  # FSDP2 over a folder's base
    with pytest.raises(
        UserError, match=r"^lora.base_dtype=nf4 \(QLoRA\) runs on a CUDA GPU or the CPU, not mps: "
    ):
        check_qlora(nf4, torch.device("mps"), one)
    check_qlora(nf4, cuda, ParallelConfig(data_replicate=2).resolved(4), tiny_llama)  # HSDP 2 x 2
    for layout in (ParallelConfig(tensor=2), ParallelConfig(pipeline=2), ParallelConfig(expert=2)):
        with pytest.raises(
            UserError,
            match=r"runs on one process, DDP replicas, FSDP2 or HSDP \(trainer.data_"
            r"parallel, parallel.data_replicate/data_shard\), not with tensor, "
            r"pipeline or expert parallelism: set those to 1, or lora.base_dtype="
            r"bf16$",
        ):
            check_qlora(nf4, cuda, layout.resolved(4), tiny_llama)
    with pytest.raises(
        UserError,
        match=r"under FSDP2 reads its base from model.init_from, an lmforge or Hugging Face "
        r"folder: set model.init_from$",
    ):
        check_qlora(nf4, cuda, fsdp)
    step = tmp_path / "step-00000004"
    step.mkdir()
    (step / "trainer.json").write_text("{}")
    with pytest.raises(
        UserError,
        match=r"Hugging Face folder, not the training checkpoint '.*step-00000004': export "
        r"it first \(lmforge export-hf CHECKPOINT OUT\)$",
    ):
        check_qlora(nf4, cuda, fsdp, step)
    check_qlora(LoRAConfig(base_dtype="bf16"), torch.device("mps"), fsdp)  # only nf4 is checked
    # torchao splits an NF4 weight along whole scale groups: one FSDP2 cannot split is named before
    # anything is read.
    from lmforge.models.nf4 import check_shardable

    # 2 groups
    odd = {
        "layers.0.mlp.down.weight": (torch.nn.Linear(192, 2, bias=False, device="meta"), "weight")
    }
    check_shardable(odd, 2)
    with pytest.raises(
        UserError,
        match=r"^lora.base_dtype=nf4 \(QLoRA\) under FSDP2 over 4 ranks: 'layers.0.mlp.down."
        r"weight' \(2 x 192, 2 NF4 scale groups\) cannot be split 4 ways: use fewer "
        r"ranks \(parallel.data_shard\), or lora.base_dtype=bf16$",
    ):
        check_shardable(odd, 4)
    # bf16_base=true is the older spelling of base_dtype=bf16, and nf4 keeps the rest of the base in
    # bf16.
    assert LoRAConfig(bf16_base=True).base_dtype == "bf16" and nf4.bf16_base


@pytest.mark.slow
def test_a_qlora_run_resumes_bit_exactly_and_exports(tiny_llama, chats, tmp_path):
    """A QLoRA run on the CPU (torchao's NF4 is plain tensor code there): it trains, its
    checkpoint (without the NF4 weights, read again from model.init_from) resumes to the
    uninterrupted curve bit for bit, and its exports hold plain bf16 weights that transformers
    and PEFT load. On a GPU this has not been tried yet."""
    pytest.importorskip("torchao")
    peft = pytest.importorskip("peft")
    extra = (
        "lora.base_dtype=nf4",
        "checkpoint.every_n_steps=2",
        "checkpoint.save_top_k=-1",
        "checkpoint.convert_to_hf=true",
    )
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    Trainer(lora_config(tiny_llama, chats, whole, *extra)).fit()
    Trainer(lora_config(tiny_llama, chats, cut, *extra)).fit()
    shutil.rmtree(cut / "checkpoints" / "step-00000004")  # as if killed after step 3
    Trainer(lora_config(tiny_llama, chats, cut, *extra)).fit()
    assert _curve(cut) == _curve(whole) and len(_curve(whole)) == 4
    ids = torch.randint(0, 50257, (2, 23), generator=torch.Generator().manual_seed(0))
    ours = _logits(load_pretrained(cut / "model", dtype=torch.float32), ids)
    hf = tf.AutoModelForCausalLM.from_pretrained(cut / "hf", torch_dtype=torch.float32).eval()
    assert (_logits(hf, ids) - ours).abs().max().item() <= TOL
    peft.PeftModel.from_pretrained(
        tf.AutoModelForCausalLM.from_pretrained(tiny_llama), cut / "hf-adapter"
    )
    # A checkpoint of a QLoRA run over a fresh base (no model.init_from) cannot be read whole: one
    # line says why.
    from lmforge.errors import UserError

    fresh = tmp_path / "fresh" / "step-00000004"
    shutil.copytree(whole / "checkpoints" / "step-00000004", fresh)
    state = json.loads((fresh / "trainer.json").read_text())
    state["run_config"]["model"]["init_from"] = None
    (fresh / "trainer.json").write_text(json.dumps(state))
    with pytest.raises(
        UserError,
        match=r"is a QLoRA run's over a fresh base \(no model.init_from\): its NF4 weights "
        r"are not in it, so it cannot be read whole; the run's own export",
    ):
        load_pretrained(fresh)


@pytest.mark.slow
def test_qlora_under_fsdp2_trains_like_one_process_and_resumes_under_any_layout(
    tiny_llama, chats, tmp_path
):
    """QLoRA over 2 gloo ranks of FSDP2: each rank reads the base's linear weights block by
    block, quantizes them and keeps its half of every NF4 weight (torchao's NF4 tensor gathers
    itself for FSDP2). The losses and adapters equal one process's; the checkpoint holds no NF4
    weights (DCP would pickle torchao's class) and one process resumes it onto the same curve;
    export-hf of it writes the run's own merged and PEFT folders."""
    import os

    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from lmforge.cli import main
    from lmforge.errors import UserError

    pytest.importorskip("torchao")
    peft = pytest.importorskip("peft")
    common = [
        "lora.base_dtype=nf4",
        "checkpoint.convert_to_hf=true",
        "checkpoint.every_n_steps=2",
        "checkpoint.save_top_k=-1",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    Trainer(lora_config(tiny_llama, chats, one, *common)).fit()
    r = torchrun(
        2,
        [
            "-m",
            "lmforge.cli",
            "finetune",
            os.devnull,
            *lora_args(tiny_llama, chats, two, *common, "trainer.data_parallel=fsdp"),
        ],
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "lora.base_dtype=nf4: 10 linear weights in NF4" in r.stderr
    for (la, ga), (lb, gb) in zip(_curve(two), _curve(one), strict=True):
        assert la == pytest.approx(lb, rel=1e-6) and ga == pytest.approx(gb, rel=1e-5)
    adapters_two, adapters_one = (
        load_file(run / "hf-adapter" / "adapter_model.safetensors") for run in (two, one)
    )
    assert adapters_two.keys() == adapters_one.keys()
    for k, t in adapters_two.items():
        torch.testing.assert_close(t, adapters_one[k], rtol=1e-4, atol=1e-6)
    merged_two, merged_one = (load_file(run / "hf" / "model.safetensors") for run in (two, one))
    # the same NF4 base, dequantized, plus the same adapters (bf16 rounding)
    for k, t in merged_two.items():
        torch.testing.assert_close(t.float(), merged_one[k].float(), rtol=1e-2, atol=1e-2)
    step = two / "checkpoints" / "step-00000004"
    saved = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    assert (
        "model.layers.0.attn.qkv.lora_A.q" in saved
        and "model.layers.0.attn.qkv.weight" not in saved
    )
    assert "model.layers.0.norm1.weight" in saved and "model.embed.weight" in saved
    assert not any(b"NF4Tensor" in f.read_bytes() for f in step.glob("*.distcp"))
    # One process resumes the 2-rank checkpoint of step 2 (its own NF4 base, read from
    # model.init_from).
    three = tmp_path / "three"
    shutil.copytree(two, three)
    shutil.rmtree(three / "checkpoints" / "step-00000004")
    Trainer(lora_config(tiny_llama, chats, three, *common)).fit()
    for (la, ga), (lb, gb) in zip(_curve(three), _curve(two), strict=True):
        assert la == pytest.approx(lb, rel=1e-6) and ga == pytest.approx(gb, rel=1e-5)
    # export-hf of the 2-rank checkpoint: the run's own folders, byte for byte.
    out = tmp_path / "export" / "hf"
    assert main(["export-hf", str(step), str(out)]) == 0
    for ours, theirs in [(out, two / "hf"), (out.with_name("hf-adapter"), two / "hf-adapter")]:
        for name in sorted(p.name for p in theirs.iterdir()):
            assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    peft.PeftModel.from_pretrained(
        tf.AutoModelForCausalLM.from_pretrained(tiny_llama), two / "hf-adapter"
    )
    # Without the base folder, the checkpoint cannot be read whole: one line naming it.
    moved = tmp_path / "moved"
    shutil.copytree(tiny_llama, moved)
    shutil.rmtree(tiny_llama)
    try:
        with pytest.raises(
            UserError,
            match=r"is a QLoRA run's: its NF4 base weights are not in it but read from the "
            r"run's model.init_from, '.*', which is not there: put that folder back",
        ):
            load_pretrained(step)
    finally:
        shutil.copytree(moved, tiny_llama)


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "world"), [("ddp", 2), ("hsdp", 4)])
def test_qlora_on_replicas_trains_like_one_process(layout, world, tiny_llama, chats, tmp_path):
    """QLoRA over DDP replicas (each reads and quantizes the whole base, the same bits: DDP
    leaves the NF4 weights out of its start-up broadcast, which would meet torchao's class) and
    over HSDP (2 replicas of FSDP2 x 2): the losses and gradient norms of one process at the same
    micro-batch, the merged export the same (DDP: byte for byte)."""
    import os

    from safetensors.torch import load_file

    pytest.importorskip("torchao")
    one, many = tmp_path / "one", tmp_path / layout
    common = [
        "lora.base_dtype=nf4",
        "checkpoint.convert_to_hf=true",
        f"trainer.micro_batch_size={8 // world}",
    ]
    Trainer(lora_config(tiny_llama, chats, one, *common)).fit()
    parallel = (
        ["trainer.data_parallel=ddp"]
        if layout == "ddp"
        else ["parallel.data_replicate=2", "parallel.data_shard=2"]
    )
    r = torchrun(
        world,
        [
            "-m",
            "lmforge.cli",
            "finetune",
            os.devnull,
            *lora_args(tiny_llama, chats, many, *common, *parallel),
        ],
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("parallelized: DDP over 2 replicas" if layout == "ddp" else "dp=2x2") in r.stderr
    for (la, ga), (lb, gb) in zip(_curve(many), _curve(one), strict=True):
        assert la == pytest.approx(lb, rel=1e-6) and ga == pytest.approx(gb, rel=1e-5)
    if layout == "ddp":
        assert (many / "hf" / "model.safetensors").read_bytes() == (
            one / "hf" / "model.safetensors"
        ).read_bytes()
    theirs = load_file(one / "hf" / "model.safetensors")
    for k, t in load_file(many / "hf" / "model.safetensors").items():
        torch.testing.assert_close(t.float(), theirs[k].float(), rtol=1e-2, atol=1e-2)
