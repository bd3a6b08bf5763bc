"""trainer.float8=true: refused in one line wherever it cannot run (CPU, no torchao, no FP8
tensor cores, tensor parallelism, LoRA) before anything is written; with torchao, the blocks'
linears become Float8Linear.

The FP8 step itself needs a CUDA GPU with FP8 tensor cores: it has not run here (a fake-CUDA
forward of Float8Linear aborts on a CPU-only torch)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models import build
from lmforge.train import float8
from lmforge.train.trainer import Trainer
from tests.train.conftest import run_config

CUDA = torch.device("cuda", 0)


def test_a_cpu_run_is_refused_before_anything_is_written(tiny_corpus, tmp_path):
    with pytest.raises(
        UserError, match=r"needs a CUDA GPU .* this run is on cpu: set trainer.float8=false"
    ):
        Trainer(run_config(tiny_corpus, tmp_path / "run", "trainer.float8=true"))
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device as torch would describe an H100, with torchao findable (or not: gpu.torchao
    = False)."""

    class State:
        torchao = True
        capability = (9, 0)

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            (object() if State.torchao else None) if name == "torchao" else find_spec(name, *a)
        ),
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: State.capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    return State


def test_without_torchao_the_line_gives_the_pip_command(gpu):
    gpu.torchao = False
    with pytest.raises(
        UserError, match=r"needs torchao, which is not installed: pip install 'lmforge\[fp8\]'"
    ):
        float8.check_float8(CUDA, tensor_parallel=1, lora=False)


def test_a_gpu_without_fp8_tensor_cores_and_unsupported_layouts_are_refused(gpu):
    float8.check_float8(CUDA, tensor_parallel=1, lora=False)  # an H100 (9.0) with torchao: accepted
    gpu.capability = (8, 0)
    with pytest.raises(
        UserError, match=r"compute capability 8.9 or higher\); NVIDIA A100-SXM4-80GB has 8.0"
    ):
        float8.check_float8(CUDA, tensor_parallel=1, lora=False)
    gpu.capability = (8, 9)
    with pytest.raises(UserError, match=r"parallel.tensor > 1 is not supported yet"):
        float8.check_float8(CUDA, tensor_parallel=2, lora=False)
    with pytest.raises(UserError, match=r"LoRA is not supported yet"):
        float8.check_float8(CUDA, tensor_parallel=1, lora=True)


def test_an_unknown_recipe_is_one_line(tiny_corpus, tmp_path):
    with pytest.raises(UserError, match="trainer.float8_recipe"):
        run_config(tiny_corpus, tmp_path / "run", "trainer.float8_recipe=blockwise")


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_the_blocks_linears_become_float8_and_the_head_stays(recipe):
    pytest.importorskip("torchao", reason="torchao is the optional lmforge[fp8] extra")
    from torchao.float8.float8_linear import Float8Linear

    model = build("tiny-neox", device="meta")
    assert float8.convert_to_float8(model, recipe) == 4 * len(model.layers)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert isinstance(module, Float8Linear) == name.startswith("layers."), name
    assert type(model.lm_head) is torch.nn.Linear
