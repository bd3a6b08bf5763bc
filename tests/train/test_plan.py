"""`lmforge plan`: one training step traced for N ranks on fake CUDA tensors with a fake process
group.

The plans run in a process of their own (tests/train/plan_worker.py): on a CPU-only torch the
stand-in device must be registered before the process's first backward, and stays registered.

- every layout's step (DDP, FSDP2, HSDP, TP, TP + sequence parallel, bf16 with stochastic rounding,
  a classification head) runs through the real code on the fake device, and reports each category's
  bytes; parameters, gradients and optimizer state equal what the layout holds (counted from the
  config);
- the defect class it exists for fails here, as it would on a GPU at step 1: a CPU tensor in a
  collective (CollectiveDeviceError naming the lmforge line), a CPU tensor mixed into a device op
  (FakeTensorDeviceMismatchError);
- deep models are traced at two depths and extrapolated: the bytes equal the full-depth trace;
- bad input (world size the layout does not divide, an unknown device, a size that is no size, a
  peak above --device-memory) is one line;
- a fresh model under a sharded layout is initialised shard by shard: every rank's pieces equal the
  one-process model's, and the peak memory of the initialisation is the rank's shards plus one
  weight.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models import build
from lmforge.parallel.mesh import fsdp_shards_experts
from lmforge.train.config import load_run_config
from lmforge.train.plan import GiB, parse_memory
from tests.conftest import needs_torch

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WORKER = Path(__file__).with_name("plan_worker.py")
TINY = [
    "data.seq_length=64",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2",
    "model.vocab_size=512",
    # tiny-neox (2 layers): every rank gets one or two micro-batches of 64 tokens
    "trainer.precision=fp32",
]


def _case(world: int, *overrides: str, config: str = "tiny-neox.yaml", **extra) -> dict:
    tiny = TINY if config == "tiny-neox.yaml" else []
    return {
        "config": str(CONFIGS / config),
        "overrides": [*tiny, *overrides],
        "world": world,
        **extra,
    }


def _run(cases: dict, tmp: Path) -> dict:
    """The cases in one process of their own (see plan_worker.py)."""
    (tmp / "spec.json").write_text(json.dumps({"cases": cases}))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp / "spec.json"), str(tmp / "out.json")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


LAYOUTS = {
    "ddp": _case(2, "trainer.data_parallel=ddp"),
    "fsdp": _case(4, "trainer.data_parallel=fsdp"),
    "hsdp": _case(4, "parallel.data_replicate=2", "parallel.data_shard=2"),
    "tp": _case(
        2,
        "parallel.tensor=2",
        "parallel.sequence_parallel=false",
        "model.make_vocab_size_divisible_by=256",
    ),
    "tp_sp_fsdp": _case(
        4,
        "parallel.tensor=2",
        "parallel.sequence_parallel=true",
        "trainer.data_parallel=fsdp",
        "model.make_vocab_size_divisible_by=256",
    ),
    "bf16_sr": _case(2, "trainer.precision=bf16-sr", "trainer.data_parallel=fsdp"),
    "bf16_mixed": _case(2, "trainer.precision=bf16-mixed", "trainer.data_parallel=fsdp"),
    "auto_precision": _case(2, "trainer.precision=auto", "trainer.data_parallel=fsdp"),
    "classification": _case(2, "data.task=classification", "trainer.data_parallel=fsdp"),
    # A mixture of experts: the routing of fake tensors cannot be counted, the trace takes it
    # balanced.
    "moe_fsdp": _case(2, "model.preset=tiny-qwen3-moe", "trainer.data_parallel=fsdp"),
    # Expert parallelism over all 4 ranks: each holds 2 of the 8 experts whole, FSDP a quarter of
    # the rest.
    "moe_ep": _case(
        4, "model.preset=tiny-qwen3-moe", "trainer.data_parallel=fsdp", "parallel.expert=4"
    ),
    # Expert parallelism 2 over 4 FSDP ranks: the 2 ranks holding each expert shard it, so a rank
    # holds a quarter of the experts (replicated, half), like everything else.
    "moe_ep_sharded": _case(
        4, "model.preset=tiny-qwen3-moe", "trainer.data_parallel=fsdp", "parallel.expert=2"
    ),
    # Expert x tensor parallelism: half the experts per ep rank, half of each one's rows per tensor
    # rank; on 8 ranks FSDP2 also shards them over the 2 data ranks holding the same experts.
    "moe_ep_tp": _case(
        4,
        "model.preset=tiny-qwen3-moe",
        "trainer.data_parallel=fsdp",
        "parallel.expert=2",
        "parallel.tensor=2",
        "model.make_vocab_size_divisible_by=256",
    ),
    "moe_ep_tp_sharded": _case(
        8,
        "model.preset=tiny-qwen3-moe",
        "trainer.data_parallel=fsdp",
        "parallel.expert=2",
        "parallel.tensor=2",
        "model.make_vocab_size_divisible_by=256",
    ),
}
CASES = {
    **LAYOUTS,
    # The defect class it exists for: a CPU tensor in a collective, a CPU tensor mixed into a device
    # op.
    "cpu_counts": _case(2, "trainer.data_parallel=fsdp", patch="cpu_counts"),
    "cpu_term": _case(2, "trainer.data_parallel=fsdp", patch="cpu_term"),
    # 8 blocks traced at 3 and 6 and extrapolated, and traced whole.
    "deep": _case(2, "model.num_layers=8", "trainer.data_parallel=fsdp"),
    "deep_whole": _case(2, "model.num_layers=8", "trainer.data_parallel=fsdp", shallow=4),
    "world_3_tp_2": _case(3, "parallel.tensor=2", "model.make_vocab_size_divisible_by=256"),
    "unknown_device": _case(2, device="nope"),
    # 2 layers: the run refuses it, the plan traced 3 stages
    "layers_3_stages": _case(3, "parallel.pipeline=3"),
    # FSDP2's mixed precision: bf16 all-gathers, reduce-scatters in parallel.fsdp_reduce_dtype (fp32
    # by default).
    "fsdp_fp32": _case(2, "trainer.data_parallel=fsdp"),
    "bf16_mixed_reduce_bf16": _case(
        2,
        "trainer.precision=bf16-mixed",
        "trainer.data_parallel=fsdp",
        "parallel.fsdp_reduce_dtype=bf16",
    ),
    "no_room": _case(2, device_memory=1024),
}
PIPELINES = {  # each stage traced in a forked process; the stages built with static shapes
    "pp_1f1b": _case(4, "parallel.pipeline=2", "model.num_layers=4"),
    "pp_gpipe": _case(
        4,
        "parallel.pipeline=2",
        "model.num_layers=4",
        "parallel.pipeline_schedule=gpipe",
        "trainer.global_batch_size=16",
    ),
    "pp_interleaved": _case(
        2,
        "parallel.pipeline=2",
        "model.num_layers=8",
        "parallel.pipeline_schedule=interleaved_1f1b",
        "parallel.virtual_stages=2",
    ),
    "pp_tp_sp_fsdp": _case(
        8,
        "parallel.pipeline=2",
        "parallel.tensor=2",
        "parallel.sequence_parallel=true",
        "trainer.data_parallel=fsdp",
        "model.num_layers=4",
        "model.make_vocab_size_divisible_by=256",
        "trainer.global_batch_size=16",
    ),
    "pp_bf16_sr": _case(
        4, "parallel.pipeline=2", "model.num_layers=4", "trainer.precision=bf16-sr"
    ),
    # bf16-mixed under FSDP2: the stages compute with bf16 weights and exchange bf16 hidden states
    # (planned as fp32, every such plan failed at the first microbatch's dtype check).
    "pp_bf16_mixed_fsdp": _case(
        4,
        "parallel.pipeline=2",
        "model.num_layers=4",
        "trainer.precision=bf16-mixed",
        "trainer.data_parallel=fsdp",
    ),
    # A classification head on the last stage: it sends (rows, num_labels) scores to the loss, not
    # logits.
    "pp_classification": _case(
        4, "parallel.pipeline=2", "model.num_layers=4", "data.task=classification"
    ),
    "pp_cpu_counts": _case(4, "parallel.pipeline=2", "model.num_layers=4", patch="cpu_counts"),
    # Expert parallelism 2 within each stage's 4 FSDP ranks, the experts sharded over the 2 holding
    # each.
    "pp_moe_ep": _case(
        8,
        "parallel.pipeline=2",
        "model.num_layers=4",
        "model.preset=tiny-qwen3-moe",
        "trainer.data_parallel=fsdp",
        "parallel.expert=2",
        "trainer.global_batch_size=16",
    ),
    # Expert x tensor x pipeline: each stage's experts split over its 2 data ranks and their rows
    # over 2 tensor ranks.
    "pp_moe_ep_tp": _case(
        8,
        "parallel.pipeline=2",
        "parallel.tensor=2",
        "model.num_layers=4",
        "model.preset=tiny-qwen3-moe",
        "trainer.data_parallel=fsdp",
        "parallel.expert=2",
        "model.make_vocab_size_divisible_by=256",
        "trainer.global_batch_size=16",
    ),
}


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> dict:
    return _run(CASES, tmp_path_factory.mktemp("plan"))


def _param_bytes(case: dict, within: str = "") -> int:
    cfg = load_run_config(case["config"], case["overrides"])
    from lmforge.train.plan_tasks import task_plan

    model_cfg = dataclasses.replace(cfg.model.resolve(), num_labels=task_plan(cfg.data.task).labels)
    return (
        sum(p.numel() for n, p in build(model_cfg, device="meta").named_parameters() if within in n)
        * 4
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_steps_on_fake_cuda(planned, name):
    assert "plan" in planned[name], planned[name]
    plan = planned[name]["plan"]
    world = LAYOUTS[name]["world"]
    assert plan["device"] == "cuda" and plan["world_size"] == world
    [rank] = plan["ranks"]
    # what divides the parameters: FSDP shards x TP
    shards = world // plan["layout"]["data_replicate"]
    dtype_bytes = 2 if name == "bf16_sr" else 4
    # Parameters are the whole model's divided by the shards (replicated norms and biases under TP,
    # FSDP's padding of uneven dims: a few percent), plus buffers (rotary frequencies).
    expected = _param_bytes(LAYOUTS[name]) * dtype_bytes // 4 / shards
    # before torch 2.12: experts whole on their ranks
    if plan["layout"]["expert"] > 1 and not fsdp_shards_experts():
        lo = plan["layout"]
        experts = _param_bytes(LAYOUTS[name], ".experts.")
        expected += experts / (lo["expert"] * lo["tensor"] * lo["pipeline"]) - experts / shards
    assert expected * 0.97 <= rank["params"] <= expected * 1.15, (rank["params"], expected)
    # One gradient per parameter (under TP the vocabulary-parallel embedding's gradient is whole on
    # every rank)
    assert rank["params"] * 0.95 <= rank["grads"] <= rank["params"] * 1.25, (
        rank["grads"],
        rank["params"],
    )
    assert rank["optimizer"] >= 2 * rank["params"] * 0.9  # AdamW's two moments per parameter
    assert rank["activations"] > 0
    assert rank["peak"] >= rank["params"] + rank["grads"] + rank["optimizer"]
    assert set(plan["per_rank_bytes"]) == {"params", "grads", "optimizer", "activations", "peak"}


@pytest.mark.slow
def test_precision_auto_plans_what_a_gpu_runs(planned):
    """trainer.precision=auto (the default) is bf16-mixed on a device with bf16 matrix units: a
    CUDA plan made on this CPU (which has none) traces bf16 autocast, not the host's fp32."""
    assert planned["auto_precision"]["plan"]["ranks"] == planned["bf16_mixed"]["plan"]["ranks"]


@pytest.mark.slow
def test_fsdp_under_bf16_mixed_gathers_half_the_bytes(planned):
    """bf16-mixed under FSDP2 all-gathers bf16 parameters: half the bytes of fp32 (the sharded
    weights stay fp32); gradients are reduce-scattered in fp32 unless
    parallel.fsdp_reduce_dtype=bf16 halves them too."""
    fp32, mixed, reduce_bf16 = (
        [planned[n]["plan"]["ranks"][0][k] for k in ("collective_bytes", "params")]
        for n in ("fsdp_fp32", "bf16_mixed", "bf16_mixed_reduce_bf16")
    )
    assert fp32[0]["all_gather"] > 0 and fp32[0]["reduce_scatter"] > 0
    assert mixed[0]["all_gather"] * 2 == fp32[0]["all_gather"] == reduce_bf16[0]["all_gather"] * 2
    assert (
        mixed[0]["reduce_scatter"]
        == fp32[0]["reduce_scatter"]
        == reduce_bf16[0]["reduce_scatter"] * 2
    )
    assert mixed[1] == fp32[1] == reduce_bf16[1]  # the sharded parameters: fp32 in all three


@pytest.mark.slow
def test_the_device_defects_fail_as_on_a_gpu(planned):
    assert planned["cpu_counts"]["error"] == "CollectiveDeviceError"
    assert (
        "cpu tensor" in planned["cpu_counts"]["message"]
        and "lmforge/parallel/mesh.py" in planned["cpu_counts"]["message"]
    )
    # torch 2.13: "Expected all tensors to be on the same device, but found at least two devices,
    # fakegpu:0 and cpu!" (a GPU's own words); before, fake tensors' "Unhandled FakeTensor Device
    # Propagation ... found two different devices fakegpu:0, cpu" as a RuntimeError
    term = planned["cpu_term"]
    assert (
        term["error"] in ("FakeTensorDeviceMismatchError", "RuntimeError")
        and "devices" in term["message"]
        and "cpu" in term["message"]
    ), term


@pytest.mark.slow
def test_deep_models_extrapolate_to_the_full_trace(planned):
    deep, whole = planned["deep"]["plan"], planned["deep_whole"]["plan"]
    assert deep["traced_layers_per_chunk"] == [3, 6] and whole["traced_layers_per_chunk"] == [8]
    assert deep["ranks"] == whole["ranks"]


@pytest.mark.slow
def test_bad_input_is_one_line(planned):
    assert planned["world_3_tp_2"] == {
        "error": "UserError",
        "message": planned["world_3_tp_2"]["message"],
    }
    assert "does not divide the world size 3" in planned["world_3_tp_2"]["message"]
    assert (
        planned["unknown_device"]["error"] == "UserError"
        and "--device 'nope'" in planned["unknown_device"]["message"]
    )
    assert planned["no_room"]["error"] == "UserError"
    assert (
        "model.num_layers=2 is not divisible by parallel.pipeline=3"
        in planned["layers_3_stages"]["message"]
    )
    assert (
        "GiB at its peak" in planned["no_room"]["message"]
        and "--device-memory 0.0 GiB" in planned["no_room"]["message"]
    )


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory) -> dict:
    return _run(PIPELINES, tmp_path_factory.mktemp("plan_pp"))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in PIPELINES if n != "pp_cpu_counts"])
def test_every_pipeline_layout_steps_on_fake_cuda(pipelined, name):
    """One rank per stage: together the stages hold the whole model once per shard, and each
    holds its own gradients, optimizer state and the activations of its microbatches in flight."""
    assert "plan" in pipelined[name], pipelined[name]
    plan = pipelined[name]["plan"]
    world = PIPELINES[name]["world"]
    assert [(r["rank"], r["stage"]) for r in plan["ranks"]] == [(0, 0), (world // 2, 1)]
    layout = plan["layout"]
    shards = layout["data_shard"] * layout["tensor"]
    dtype_bytes = 2 if name == "pp_bf16_sr" else 4
    expected = _param_bytes(PIPELINES[name]) * dtype_bytes // 4 / shards
    # before torch 2.12: experts whole on their ranks
    if layout["expert"] > 1 and not fsdp_shards_experts():
        experts = _param_bytes(PIPELINES[name], ".experts.")
        expected += experts / (layout["expert"] * layout["tensor"]) - experts / shards
    held = sum(r["params"] for r in plan["ranks"])
    # + the rotary buffers of each stage
    assert expected * 0.97 <= held <= expected * 1.2, (held, expected)
    for r in plan["ranks"]:
        assert r["params"] * 0.95 <= r["grads"] <= r["params"] * 1.3, r
        assert r["optimizer"] >= 2 * r["params"] * 0.9, r
        assert r["activations"] > 0 and r["peak"] >= r["params"] + r["grads"] + r["optimizer"], r
    # 1F1B: the first stage holds both microbatches in flight, the last one at a time
    if name == "pp_1f1b":
        first, last = plan["ranks"]
        assert plan["traced_microbatches"] == 2 and first["activations"] > last["activations"]
    # GPipe keeps all 4 microbatches' activations; 2 are traced and the rest scaled
    if name == "pp_gpipe":
        assert plan["microbatches"] == 4 and plan["traced_microbatches"] == 2


@pytest.mark.slow
def test_a_cpu_tensor_in_a_collective_fails_under_a_pipeline_too(pipelined):
    assert pipelined["pp_cpu_counts"]["error"] == "CollectiveDeviceError", pipelined[
        "pp_cpu_counts"
    ]


def test_sizes_and_a_recipe_without_a_model_are_one_line():
    with pytest.raises(UserError, match="the recipe names no model: set model.init_from=FOLDER"):
        load_run_config(CONFIGS / "gpt-j-6b.yaml", [])
    with pytest.raises(UserError, match="--device-memory"):
        parse_memory("eighty")
    assert parse_memory("80GiB") == 80 * GiB == parse_memory("80")
    assert parse_memory("80GB") == 80 * 10**9


@needs_torch((2, 10), "lmforge plan of a CUDA run on a machine without one")
@pytest.mark.parametrize(
    "precision, dtype, size", [("bf16-sr", "bf16", 8), ("fp32", "fp32", 16), ("auto", "fp32", 16)]
)
def test_the_plan_says_the_precision_it_sized_and_what_a_parameter_costs(precision, dtype, size):
    """A recipe's explicit precision (neox-20b's bf16-sr) got no line; auto's said only what it
    was planned as."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmforge.cli",
            "plan",
            str(CONFIGS / "tiny-neox.yaml"),
            *TINY,
            f"trainer.precision={precision}",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    plan = json.loads(r.stdout)
    [line] = [n for n in plan["notes"] if n.startswith("trainer.precision=")]
    named = (
        precision
        if precision != "auto"
        else "auto, planned as bf16-mixed (a GPU with bf16 tensor cores: A100 and later)"
    )
    assert line.startswith(
        f"trainer.precision={named}: weights, gradients and both AdamW moments in {dtype}, {size} "
        "bytes a trained parameter"
    )
    held = sum(plan["per_rank_bytes"][k] for k in ("params", "grads", "optimizer"))
    # what the trace holds (and buffers)
    assert size * 0.99 <= held / plan["sized"]["parameters"] <= size * 1.01


RECIPES = {
    "pythia-6.9b": _case(16, config="pythia-6.9b.yaml", device_memory=80 * GiB),
    "llama2-7b": _case(
        16, "model.preset=llama-2-7b", config="llama2-7b-continued.yaml", device_memory=80 * GiB
    ),
    "pythia-12b-fsdp": _case(
        8, "trainer.data_parallel=fsdp", config="pythia-12b.yaml", device_memory=80 * GiB
    ),
    "gpt-j-6b": _case(8, "model.preset=gpt-j-6b", config="gpt-j-6b.yaml", device_memory=80 * GiB),
    "pythia-160m": _case(8, config="pythia-160m.yaml", device_memory=80 * GiB),
    "pythia-12b-ddp": _case(
        8, "trainer.data_parallel=ddp", config="pythia-12b.yaml", device_memory=80 * GiB
    ),
    "neox-20b": _case(32, config="neox-20b.yaml", device_memory=80 * GiB),  # TP 8 x PP 4
}


@pytest.mark.slow
def test_recipes_at_their_world_size(tmp_path):
    results = _run(RECIPES, tmp_path)
    for name, result in results.items():
        # 44 GiB of fp32 weights, as much gradient and twice in AdamW moments
        if name == "pythia-12b-ddp":
            assert result["error"] == "UserError", result
            assert "rank 0 (pipeline stage 0) needs 176.6 GiB at its peak" in result["message"], (
                result
            )
            assert "shard the model" in result["message"]
        else:
            assert "plan" in result, (name, result)
            assert 0 < result["plan"]["per_rank_bytes"]["peak"] <= 80 * GiB, (name, result)


@needs_torch((2, 7), "FSDP2 on the CPU")
def test_fresh_model_is_initialised_shard_by_shard():
    """FSDP x TP over 4 ranks (one traced here, with a fake process group on the CPU): each piece
    equals the one-process model's, and the initialisation's peak is the rank's shards plus one
    whole weight."""
    from lmforge.models.build import local_piece
    from lmforge.parallel import ParallelConfig, build_mesh, parallelize
    from lmforge.parallel.fake import TraceMode, fake_world
    from lmforge.parallel.load import allocated_bytes, init_sharded

    tiny = load_run_config(CONFIGS / "tiny-neox.yaml", TINY)
    mcfg = dataclasses.replace(tiny.model.resolve(), num_layers=4, make_vocab_size_divisible_by=256)
    whole = build(mcfg, seed=5)
    layout = ParallelConfig(tensor=2, data_shard=2)
    cpu = torch.device("cpu")
    for rank in range(4):
        with fake_world(cpu, 4, rank):
            mesh = build_mesh(layout, mcfg, device_type="cpu")
            pm = parallelize(build(mcfg, device="meta"), layout, mesh, device=cpu)
            with TraceMode(cpu) as meter:
                init_sharded(pm, seed=5)
            held = allocated_bytes(pm)
            largest = max(p.numel() * 4 for p in whole.parameters())
            assert meter.peak <= held + 2 * largest < sum(p.numel() * 4 for p in whole.parameters())
            reference = dict(whole.named_parameters())
            for name, p in pm.parts[0].named_parameters():
                local, box = local_piece(p)
                assert torch.equal(local, reference[name].detach()[box]), (rank, name)


@pytest.mark.slow
def test_expert_parallelism_sends_every_routed_row_through_all_to_all(planned):
    """Per MoE layer and micro-batch: tokens x experts_per_token rows of the hidden size go out
    to the experts and back in the forward, and their gradients both ways in the backward (4
    all-to-alls; the plan's fake routing is balanced, so each is the rank's whole routed rows)."""
    from lmforge.models import preset

    cfg = preset("tiny-qwen3-moe")
    [rank] = planned["moe_ep"]["plan"]["ranks"]
    micro_batches = 8 // (2 * 4)  # global batch / (micro batch x data-parallel size)
    rows = 2 * 64 * cfg.experts_per_token  # micro batch x sequence length x experts per token
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert (
        rank["collective_bytes"]["all_to_all"]
        == micro_batches * layers * 4 * rows * cfg.hidden_size * 4
    )
    # Beside tensor parallelism 2 (2 data ranks): every tensor-parallel rank sends its data rank's
    # whole micro-batch.
    [rank] = planned["moe_ep_tp"]["plan"]["ranks"]
    assert (
        rank["collective_bytes"]["all_to_all"]
        == 2 * micro_batches * layers * 4 * rows * cfg.hidden_size * 4
    )


@pytest.mark.parametrize(
    ("layout", "trainer", "base", "advice"),
    [
        (
            {},
            {},
            None,
            "shard the model (trainer.data_parallel=fsdp, parallel.tensor or parallel.pipeline), lower "
            "trainer.micro_batch_size, or set trainer.activation_checkpointing=selective (or full)",
        ),
        # Already sharded, one sequence per micro-batch, selective checkpointing (a 70B QLoRA run
        # over 2 ranks): what is left is more ranks and full checkpointing.
        (
            {"data_shard": 2},
            {"micro_batch_size": 1, "activation_checkpointing": "selective"},
            "nf4",
            "spread the model over more ranks (parallel.data_shard), or set trainer.activation_checkpointing=full",
        ),
        (
            {"tensor": 2},
            {"micro_batch_size": 4, "activation_checkpointing": "full"},
            "bf16",
            "spread the model over more ranks (parallel.data_shard, parallel.tensor or "
            "parallel.pipeline), hold the frozen "
            "base in NF4 (lora.base_dtype=nf4, QLoRA), or lower trainer.micro_batch_size",
        ),
        (
            {},
            {"micro_batch_size": 1, "activation_checkpointing": "full"},
            "nf4",
            "shard the model (trainer.data_parallel=fsdp)",
        ),
    ],
)
def test_the_does_not_fit_advice_names_only_what_the_run_does_not_do_yet(
    layout, trainer, base, advice
):
    from types import SimpleNamespace

    from lmforge.train.plan import Plan, RankPlan, check_memory

    rank = RankPlan(
        0, 0, params=10 * GiB, grads=GiB, optimizer=2 * GiB, activations=60 * GiB, peak=84 * GiB
    )
    plan = Plan(
        2,
        "cuda",
        "fakegpu",
        {"data_shard": 1, "tensor": 1, "pipeline": 1, **layout},
        1,
        1,
        [rank],
        80,
        [3, 6],
        1.0,
        sized={"lora": {"base_dtype": base}} if base else {},
    )
    t = SimpleNamespace(**{"micro_batch_size": 2, "activation_checkpointing": "none", **trainer})
    with pytest.raises(UserError) as e:
        check_memory(plan, 80 * GiB, t)
    assert str(e.value) == (
        "rank 0 (pipeline stage 0) needs 84.0 GiB at its peak (params 10.0, grads 1.0, optimizer "
        f"2.0, activations 60.0 GiB), more than --device-memory 80.0 GiB: {advice}"
    )
    check_memory(plan, 84 * GiB, t)  # fits: nothing to say
