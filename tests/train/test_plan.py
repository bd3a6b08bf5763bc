"""`lmforge plan`: one training step traced for N ranks on fake CUDA tensors with a fake process group.

- every layout's step (DDP, FSDP2, HSDP, TP, TP + sequence parallel, bf16 with stochastic rounding, a
  classification head) runs through the real code on the fake device, and reports each category's bytes;
  parameters, gradients and optimizer state equal what the layout holds (counted from the config);
- the defect class it exists for fails here, as it would on a GPU at step 1: a CPU tensor in a collective
  (CollectiveDeviceError naming the lmforge line), a CPU tensor mixed into a device op
  (FakeTensorDeviceMismatchError);
- deep models are traced at two depths and extrapolated: the bytes equal the full-depth trace;
- bad input (world size the layout does not divide, an unknown device, a size that is no size, a peak
  above --device-memory) is one line;
- a fresh model under a sharded layout is initialised shard by shard: every rank's pieces equal the
  one-process model's, and the peak memory of the initialisation is the rank's shards plus one weight.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models import build
from lmforge.parallel.fake import CollectiveDeviceError
from lmforge.train.config import load_run_config
from lmforge.train.plan import GiB, parse_memory, plan_run

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _cfg(*overrides: str):
    """tiny-neox (2 layers) at a small batch: every rank gets one micro-batch of 64 tokens per step."""
    return load_run_config(CONFIGS / "tiny-neox.yaml", ["data.seq_length=64", "trainer.global_batch_size=8",
                                                        "trainer.micro_batch_size=2", "model.vocab_size=512",
                                                        "trainer.precision=fp32", *overrides])


def _param_bytes(cfg) -> int:
    model = build(cfg.model.resolve(), device="meta")
    return sum(p.numel() for p in model.parameters()) * 4


LAYOUTS = {
    "ddp": (2, ["trainer.data_parallel=ddp"]),
    "fsdp": (4, ["trainer.data_parallel=fsdp"]),
    "hsdp": (4, ["parallel.data_replicate=2", "parallel.data_shard=2"]),
    "tp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=false", "model.make_vocab_size_divisible_by=256"]),
    "tp_sp_fsdp": (4, ["parallel.tensor=2", "parallel.sequence_parallel=true", "trainer.data_parallel=fsdp",
                       "model.make_vocab_size_divisible_by=256"]),
    "bf16_sr": (2, ["trainer.precision=bf16-sr", "trainer.data_parallel=fsdp"]),
    "bf16_mixed": (2, ["trainer.precision=bf16-mixed", "trainer.data_parallel=fsdp"]),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_steps_on_fake_cuda(name):
    world, overrides = LAYOUTS[name]
    cfg = _cfg(*overrides)
    plan = plan_run(cfg, world, "cuda")
    assert plan.device == "cuda" and plan.world_size == world
    [rank] = plan.ranks
    whole = _param_bytes(cfg)
    shards = world // plan.layout["data_replicate"]  # what divides the parameters: FSDP shards x TP
    dtype_bytes = 2 if name == "bf16_sr" else 4
    # Parameters are the whole model's divided by the shards (replicated norms and biases under TP, FSDP's
    # padding of uneven dims: a few percent), plus buffers (rotary frequencies).
    expected = whole * dtype_bytes // 4 / shards
    assert expected * 0.97 <= rank.params <= expected * 1.15, (rank.params, expected)
    # One gradient per parameter (under TP a replicated bias's gradient is whole on every rank, like it)
    assert rank.params * 0.95 <= rank.grads <= rank.params * 1.25, (rank.grads, rank.params)
    assert rank.optimizer >= 2 * rank.params * 0.9  # AdamW's two moments per parameter
    assert rank.activations > 0
    assert rank.peak >= rank.params + rank.grads + rank.optimizer
    assert set(plan.to_json()["per_rank_bytes"]) == {"params", "grads", "optimizer", "activations", "peak"}


def test_classification_head_steps():
    cfg = _cfg("data.task=classification", "trainer.data_parallel=fsdp")
    [rank] = plan_run(cfg, 2, "cuda").ranks
    assert rank.activations > 0


def test_cpu_tensor_in_a_collective_fails_like_nccl(monkeypatch):
    """The defect of the first GPU audit: the step's label count reduced as a CPU tensor."""
    from lmforge.parallel.mesh import all_reduce_data_parallel
    from lmforge.train.step import ParallelTraining
    from lmforge.train.tasks import count_tokens

    def cpu_counts(self, micro):
        counts = torch.tensor([sum(self.task.count(b) for b in micro), sum(count_tokens(b) for b in micro)],
                              dtype=torch.float64)
        return all_reduce_data_parallel(counts, self.mesh).tolist()

    monkeypatch.setattr(ParallelTraining, "global_counts", cpu_counts)
    with pytest.raises(CollectiveDeviceError, match=r"c10d.*cpu tensor.*lmforge/parallel/mesh\.py"):
        plan_run(_cfg("trainer.data_parallel=fsdp"), 2, "cuda")


def test_cpu_tensor_in_a_device_op_fails(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    from lmforge.train.tasks.pretrain import Pretrain

    loss = Pretrain.loss

    def with_cpu_term(self, model, batch, fused=True):
        value, count, correct = loss(self, model, batch, fused)
        return (value.reshape(1) + torch.ones(1)).sum(), count, correct  # a 1-element CPU tensor: no scalar

    monkeypatch.setattr(Pretrain, "loss", with_cpu_term)
    with pytest.raises(FakeTensorDeviceMismatchError):
        plan_run(_cfg("trainer.data_parallel=fsdp"), 2, "cuda")


def test_deep_models_extrapolate_to_the_full_trace(monkeypatch):
    """8 layers traced whole equal 3 and 6 layers extrapolated, category by category."""
    import lmforge.train.plan as plan_module

    cfg = _cfg("model.num_layers=8", "trainer.data_parallel=fsdp")
    extrapolated = plan_run(cfg, 2, "cuda")
    assert extrapolated.traced_layers == [3, 6]
    monkeypatch.setattr(plan_module, "SHALLOW", 4)
    whole = plan_run(cfg, 2, "cuda")
    assert whole.traced_layers == [8]
    assert extrapolated.ranks[0].bytes() == whole.ranks[0].bytes()


def test_bad_input_is_one_line():
    with pytest.raises(UserError, match="the recipe names no model: set model.init_from=FOLDER"):
        load_run_config(CONFIGS / "gpt-j-6b.yaml", [])
    with pytest.raises(UserError, match="does not divide the world size 3"):
        plan_run(_cfg("parallel.tensor=2", "model.make_vocab_size_divisible_by=256"), 3, "cuda")
    with pytest.raises(UserError, match="--device 'nope'"):
        plan_run(_cfg(), 2, "nope")
    with pytest.raises(UserError, match="--device-memory"):
        parse_memory("eighty")
    assert parse_memory("80GiB") == 80 * GiB == parse_memory("80")
    assert parse_memory("80GB") == 80 * 10**9
    with pytest.raises(UserError, match=r"needs .* GiB at its peak .* more than --device-memory 0\.0 GiB"):
        plan_run(_cfg(), 2, "cuda", device_memory=1024)


@pytest.mark.slow
@pytest.mark.parametrize("recipe,world,overrides", [
    ("pythia-6.9b.yaml", 16, []),
    ("llama2-7b-continued.yaml", 16, ["model.preset=llama-2-7b"]),
    ("pythia-12b.yaml", 8, ["trainer.data_parallel=fsdp"]),
    ("gpt-j-6b.yaml", 8, ["model.preset=gpt-j-6b"]),
    ("pythia-160m.yaml", 8, []),
])
def test_recipes_at_their_world_size(recipe, world, overrides):
    plan = plan_run(load_run_config(CONFIGS / recipe, overrides), world, "cuda", device_memory=80 * GiB)
    assert 0 < plan.per_rank_bytes()["peak"] <= 80 * GiB


@pytest.mark.slow
def test_ddp_pythia_12b_does_not_fit_80gb():
    cfg = load_run_config(CONFIGS / "pythia-12b.yaml", ["trainer.data_parallel=ddp"])
    with pytest.raises(UserError, match=r"rank 0 .* needs 1\d\d\.\d GiB at its peak .* shard the model"):
        plan_run(cfg, 8, "cuda", device_memory=80 * GiB)


def test_fresh_model_is_initialised_shard_by_shard():
    """FSDP x TP over 4 ranks (one traced here, with a fake process group on the CPU): each piece equals the
    one-process model's, and the initialisation's peak is the rank's shards plus one whole weight."""
    from lmforge.models.build import local_piece
    from lmforge.parallel import ParallelConfig, build_mesh, parallelize
    from lmforge.parallel.fake import TraceMode, fake_world
    from lmforge.parallel.load import allocated_bytes, init_sharded

    mcfg = dataclasses.replace(_cfg().model.resolve(), num_layers=4, make_vocab_size_divisible_by=256)
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
