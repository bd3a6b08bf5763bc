"""`lmforge plan` of LoRA and DPO runs: it sizes what the run holds, which the real run's trainer
says.

- a LoRA run (one process; FSDP2 x 2 with a bf16 base; QLoRA's NF4 base where torchao is importable,
  built whole in one process and read from a folder under FSDP2 x 2 with DPO), a DPO run against a
  frozen copy of the model (one process, FSDP2 x 2) and a LoRA DPO run: the plan's per-rank
  parameter, gradient and optimizer bytes equal those a real Trainer holds after one step
  (held_bytes_worker.py), counted from its parameters, gradients and optimizer state;
- the plan says what it sized (LoRA's rank, targets and trainable count; DPO's reference), in --json
  too;
- an 8B model that does not fit one 80 GiB device at full training fits as a LoRA run;
- QLoRA without torchao is sized in bf16 and says so, on one process and under FSDP2 (a preset
  without the folder the run will read its base from).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.launch import torchrun
from tests.train.test_plan import CONFIGS, _run

WORKER = Path(__file__).with_name("held_bytes_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = [
    "model.preset=tiny-neox",
    "model.vocab_size=1024",
    "data.seq_length=32",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2",
    "trainer.precision=fp32",
    "trainer.progress_bar=false",
    "trainer.val_check_interval=0",
    "cost.peak_flops=1e11",
]
LORA = ["lora.rank=4", "lora.alpha=8", "lora.targets=all-linear"]
FSDP = ["trainer.data_parallel=fsdp"]
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
LLAMA_8B = [
    "model.preset=llama-3.1-8b",
    "lora.base_dtype=bf16",
    "trainer.micro_batch_size=1",
    *FSDP,
]
WORDS = ["apples", "rivers", "stars", "music", "trains", "clouds", "cities", "forests"]


@pytest.fixture(scope="module")
def preferences(shared_data, tmp_path_factory) -> Path:
    """A small GPT-2-shaped lmforge model with the real GPT-2 tokenizer, and preference pairs."""
    from lmforge.models import build
    from lmforge.models.io import save_model

    root = tmp_path_factory.mktemp("pairs")
    model = build(
        {
            **build("tiny-gpt2", device="meta").config.__dict__,
            "vocab_size": 50257,
            "max_position_embeddings": 64,
        },
        seed=0,
    )
    save_model(
        model, root / "model", tokenizer_from=shared_data / "tokenizers" / "gpt2" / "tokenizer.json"
    )
    rows = [
        {"prompt": f"Tell me about {w}.", "chosen": f" Sure, {w} are lovely.", "rejected": " No."}
        for w in WORDS
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _cases(corpus: Path, pairs: Path, runs: Path) -> dict[str, tuple[int, list[str]]]:
    """name -> (processes, overrides) of each run sized and run."""
    pretrain = [*TINY, f"data.paths=[{corpus}]"]
    dpo = [
        f"model.init_from={pairs / 'model'}",
        "data.task=dpo",
        f"data.train_file={pairs / 'train.jsonl'}",
        "data.seq_length=32",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2",
        "trainer.precision=fp32",
        "trainer.progress_bar=false",
        "trainer.val_check_interval=0",
        "cost.peak_flops=1e11",
    ]
    cases = {
        "lora": (1, [*pretrain, *LORA]),
        "lora_fsdp_bf16": (2, [*pretrain, *LORA, *FSDP, "lora.base_dtype=bf16"]),
        "dpo": (1, dpo),
        "dpo_lora": (1, [*dpo, *LORA]),
        "dpo_fsdp": (2, [*dpo, *FSDP]),
        # adapters on a mixture of experts' stacked experts, split over two ranks by expert
        # parallelism
        "moe_lora_ep": (
            2,
            [
                *pretrain,
                "model.preset=tiny-qwen3-moe",
                *LORA,
                "lora.dropout=0",
                *FSDP,
                "parallel.expert=2",
            ],
        ),
    }
    # a fresh base built whole, then quantized; a folder's read and quantized, then
    # FSDP2-sharded
    if HAS_TORCHAO:
        cases["qlora"] = (1, [*pretrain, *LORA, "lora.base_dtype=nf4"])
        cases["qlora_dpo_fsdp"] = (2, [*dpo, *LORA, *FSDP, "lora.base_dtype=nf4"])
        # the stacked experts in NF4 too
        cases["moe_qlora"] = (
            1,
            [
                *pretrain,
                "model.preset=tiny-qwen3-moe",
                *LORA,
                "lora.dropout=0",
                "lora.base_dtype=nf4",
            ],
        )
    return {
        name: (world, [*overrides, f"run_dir={runs / name}"])
        for name, (world, overrides) in cases.items()
    }


def _held(world: int, overrides: list[str], out: Path, monkeypatch) -> dict[str, int]:
    """What a real run's rank 0 holds after one step: in this process, or rank 0 of `world` gloo
    processes."""
    if world == 1:
        import lmforge.train.trainer as trainer_module
        from lmforge.train.config import load_run_config
        from tests.train.held_bytes_worker import held_bytes

        trainer = trainer_module.Trainer(load_run_config(None, overrides))
        try:
            return held_bytes(trainer)
        finally:
            trainer.close()
    r = torchrun(world, [str(WORKER), str(out), *overrides], env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def sized_and_held(tiny_corpus, preferences, tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """name -> (the plan's JSON, the bytes the real run's rank 0 holds)."""
    tmp = tmp_path_factory.mktemp("plan_lora")
    cases = _cases(tiny_corpus, preferences, tmp / "runs")
    # the same model trained in full
    extra = {
        "full": {"config": None, "overrides": [*TINY], "world": 1},
        "lora_bf16": {
            "config": None,
            "overrides": [*TINY, *LORA, "lora.base_dtype=bf16"],
            "world": 1,
        },
        "qlora_without_torchao": {
            "config": None,
            "overrides": [*TINY, *LORA, "lora.base_dtype=nf4"],
            "world": 1,
            "patch": "no_torchao",
        },
        "qlora_fsdp": {
            "config": None,
            "overrides": [*TINY, *LORA, *FSDP, "lora.base_dtype=nf4"],
            "world": 2,
            "patch": "no_torchao",
        },
        **(
            {
                "qlora_fsdp_nf4": {
                    "config": None,
                    "overrides": [*TINY, *LORA, *FSDP, "lora.base_dtype=nf4"],
                    "world": 2,
                }
            }
            if HAS_TORCHAO
            else {}
        ),
        **{
            name: {
                "config": str(CONFIGS / "lora-pythia-410m.yaml"),
                "overrides": LLAMA_8B,
                "world": 2,
                **shallow,
            }
            for name, shallow in (("8b", {}), ("8b_whole", {"shallow": 16}))
        },
    }
    planned = _run(
        {
            **{
                name: {"config": None, "overrides": overrides, "world": world}
                for name, (world, overrides) in cases.items()
            },
            **extra,
        },
        tmp,
    )
    monkeypatch = pytest.MonkeyPatch()
    try:
        held = {
            name: _held(world, overrides, tmp / f"{name}.json", monkeypatch)
            for name, (world, overrides) in cases.items()
        }
    finally:
        monkeypatch.undo()
    return {name: (planned[name].get("plan", planned[name]), held.get(name)) for name in planned}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "lora",
        "lora_fsdp_bf16",
        "dpo",
        "dpo_lora",
        "dpo_fsdp",
        "moe_lora_ep",
        *(
            pytest.param(
                name, marks=pytest.mark.skipif(not HAS_TORCHAO, reason="torchao not installed")
            )
            for name in ("qlora", "qlora_dpo_fsdp", "moe_qlora")
        ),
    ],
)
def test_the_plan_holds_what_the_real_run_holds(sized_and_held, name):
    plan, held = sized_and_held[name]
    assert "ranks" in plan, plan
    rank = plan["ranks"][0]
    assert {k: rank[k] for k in ("params", "grads", "optimizer")} == {
        k: held[k] for k in ("params", "grads", "optimizer")
    }
    assert rank["reference_bytes"] == held["reference"]
    assert plan["sized"]["trainable_parameters"] == held["trainable"]
    # a frozen copy laid out like the policy: half the params
    if name.startswith("dpo") and "lora" not in name:
        assert rank["reference_bytes"] * 2 == rank["params"] and rank["grads"] < rank["params"]
        assert (
            plan["sized"]["reference"] == "frozen copy"
            and "a frozen copy of the model" in plan["notes"][-1]
        )
    # gate,up,down of all-linear adapt the stacked experts (gate_up at twice the rank)
    if name == "moe_lora_ep":
        assert plan["sized"]["lora"]["adapted"][-2:] == ["experts.gate_up", "experts.down"]
    if name == "dpo_lora":  # the reference is the base with its adapters off: no second model
        assert (
            rank["reference_bytes"] == 0 and plan["sized"]["reference"] == "base without adapters"
        )
    # NF4 weights hold a quarter of bf16's bytes, and the step keeps no dequantized copy of
    # them
    if name == "qlora":
        bf16 = sized_and_held["lora_bf16"][0]["ranks"][0]
        assert rank["params"] < bf16["params"] and rank["activations"] <= bf16["activations"] * 1.05
    if name == "moe_qlora":  # the experts hold NF4's ~0.53 bytes a weight, not bf16's 2
        experts = sum(
            m.experts.gate_up.numel() + m.experts.down.numel() for m in _tiny_moe_layers()
        )
        trainable = plan["sized"]["trainable_parameters"]
        # the base in bf16, adapters fp32
        in_bf16 = 2 * (plan["sized"]["parameters"] - trainable) + 4 * trainable
        assert rank["params"] <= in_bf16 - 1.4 * experts
    # each rank holds half of every NF4 weight, and DPO's reference is the base
    if name == "qlora_dpo_fsdp":
        assert rank["reference_bytes"] == 0 and plan["sized"]["lora"]["base_dtype"] == "nf4"


@pytest.mark.slow
def test_a_lora_plan_sizes_adapters_not_the_base(sized_and_held):
    """The frozen base holds no gradients and no optimizer state: next to full training of the
    same model the LoRA plan's gradients and AdamW moments are the adapters' alone, and it says
    what it sized."""
    full, lora, bf16 = (sized_and_held[n][0] for n in ("full", "lora", "lora_bf16"))
    f, r, b = (p["ranks"][0] for p in (full, lora, bf16))
    trainable = lora["sized"]["trainable_parameters"]
    assert r["grads"] == 4 * trainable < f["grads"] / 10  # fp32 adapters' gradients only
    assert 8 * trainable <= r["optimizer"] < f["optimizer"] / 10
    # a bf16 base: the adapters stay fp32
    assert b["params"] < r["params"] and b["grads"] == r["grads"]
    assert lora["sized"]["lora"] == {
        "rank": 4,
        "alpha": 8.0,
        "targets": "all-linear",
        "adapted": ["qkv", "o", "up", "down"],
        "base_dtype": "fp32",
        "adapter_dtype": "fp32",
    }
    assert lora["sized"]["parameters"] == full["sized"]["parameters"] + trainable
    assert lora["notes"][0] == (
        "LoRA rank 4 on all-linear (qkv,o,up,down): 8.2K trainable of 239.4K parameters; the "
        "frozen base in fp32 has no gradients or optimizer state, the adapters train in fp32"
    )
    assert full["notes"][0].startswith("full training: ") and full["sized"]["lora"] is None


@pytest.mark.slow
def test_qlora_without_torchao_is_sized_in_bf16_and_refused_where_the_run_is(sized_and_held):
    plan, bf16 = sized_and_held["qlora_without_torchao"][0], sized_and_held["lora_bf16"][0]
    assert plan["ranks"][0]["params"] == bf16["ranks"][0]["params"]
    assert any(
        n.startswith(
            "lora.base_dtype=nf4: torchao is not importable here, so the frozen base is sized in bf16"
        )
        for n in plan["notes"]
    )
    # A preset without its folder is sized (the plan reads no weights), and says what the run will
    # need.
    fsdp, one = sized_and_held["qlora_fsdp"][0], sized_and_held["qlora_without_torchao"][0]
    assert fsdp["ranks"][0]["params"] < one["ranks"][0]["params"]
    assert any(
        n.startswith("lora.base_dtype=nf4: torchao is not importable here") for n in fsdp["notes"]
    )
    if HAS_TORCHAO:
        nf4 = sized_and_held["qlora_fsdp_nf4"][0]
        assert nf4["ranks"][0]["params"] < fsdp["ranks"][0]["params"]
        assert (
            "lora.base_dtype=nf4 under FSDP2: the run reads and quantizes its base from model.init_from (an "
            "lmforge or Hugging Face folder), which this config does not set yet" in nf4["notes"]
        )


def _plan_cli(*args: str, memory: str = "80GiB") -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "lmforge.cli",
            "plan",
            str(CONFIGS / "lora-pythia-410m.yaml"),
            "model.preset=llama-3.1-8b",
            "trainer.micro_batch_size=2",
            *args,
            "--world-size",
            "1",
            "--device-memory",
            memory,
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_an_8b_lora_run_fits_one_80gib_device_where_full_training_does_not():
    """Llama-3.1-8B, one device of 80 GiB: trained in full (fp32 weights, gradients, AdamW) it
    needs ~120 GiB; as a LoRA run with a bf16 base (rank 16, all-linear) it fits, and the plan
    prints what it sized."""
    full = _plan_cli("lora=null")
    assert (
        full.returncode == 1
        and "needs " in full.stderr
        and "more than --device-memory 80.0 GiB" in full.stderr
    )
    lora = _plan_cli("lora.base_dtype=bf16")
    assert lora.returncode == 0, lora.stderr[-2000:]
    # Where a LoRA run does not fit, the advice names the smaller base: bf16 for an fp32 one, NF4
    # for a bf16 one.
    for base, advice in (
        ("fp32", "hold the frozen base in lora.base_dtype=bf16 (or nf4, QLoRA)"),
        ("bf16", "hold the frozen base in NF4 (lora.base_dtype=nf4, QLoRA)"),
    ):
        tight = _plan_cli(f"lora.base_dtype={base}", memory="20GiB")
        assert (
            tight.returncode == 1
            and "more than --device-memory 20.0 GiB: shard the model (trainer.data_parallel"
            f"=fsdp, parallel.tensor or parallel.pipeline), {advice}, lower trainer.micro_batch_size"
            in tight.stderr
        )
    assert (
        "LoRA rank 16 on all-linear (q,k,v,o,gate,up,down): 41.9M trainable of 8.1B parameters; the frozen base "
        "in bf16 has no gradients or optimizer state"
    ) in lora.stdout
    assert "fits --device-memory 80.0 GiB" in lora.stdout


@pytest.mark.slow
def test_a_deep_lora_plan_extrapolates_its_peak_to_the_whole_trace(sized_and_held):
    """Llama-3.1-8B LoRA (bf16 base) under FSDP2 x 2, traced at 3 and 6 blocks and extrapolated
    to 32, against all 32 traced: the same bytes, peak included. The peak's phase moves with the
    depth (the forward at 3 blocks, the backward at 32): the straight line through the two
    traces' peaks said 16.4 GiB, the whole trace 19.6."""
    deep, whole = sized_and_held["8b"][0], sized_and_held["8b_whole"][0]
    assert deep["traced_layers_per_chunk"] == [3, 6] and whole["traced_layers_per_chunk"] == [32]
    assert deep["ranks"] == whole["ranks"]


def test_a_wrapper_tensor_weighs_what_it_wraps():
    """A tensor subclass that wraps others (torchao's NF4 weight) has a fake storage the size of
    the dense tensor it stands for, which no device allocates: the trace counts the tensors
    inside, once."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.two_tensor import TwoTensor

    from lmforge.parallel.fake import TraceMode
    from lmforge.parallel.load import tensor_bytes

    cpu = torch.device("cpu")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, TraceMode(cpu, fake) as trace:
        a, b = torch.empty(256, 64), torch.empty(256, 64)
        pair = TwoTensor(a, b)
        # a wrapper made by an op (on a fake tensor: the trace's CPU shortcut is for real
        # ones)
        both = pair + a
        trace.reset_peak()
        assert (
            trace.live == 4 * a.numel() * 4
            and tensor_bytes(both) == tensor_bytes(pair) == 2 * a.numel() * 4
        )


def _tiny_moe_layers():
    from lmforge.models import build
    from lmforge.models.moe import moe_layers

    return moe_layers(build("tiny-qwen3-moe", device="meta"))
