"""lmforge.devices: which device a process computes on and how its process group talks (on this CPU-only
machine; an accelerator is stood in for where the rule depends on one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmforge import devices
from lmforge.errors import UserError


def test_auto_is_the_cpu_without_an_accelerator():
    assert devices.accelerator() is None
    assert devices.resolve_device("auto") == torch.device("cpu")
    assert devices.resolve_device("cpu") == torch.device("cpu")


def test_an_absent_or_unknown_device_is_one_line_naming_the_key():
    with pytest.raises(UserError, match=r"^trainer.device=cuda: cuda is not available here \(there is no accelerator"):
        devices.resolve_device("cuda", key="trainer.device")
    with pytest.raises(UserError, match=r"^--device=gpu: unknown device .*: use auto, cpu"):
        devices.resolve_device("gpu")


def test_each_local_rank_gets_its_own_accelerator(monkeypatch):
    monkeypatch.setattr(devices, "accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    assert devices.resolve_device("auto", local_rank=1) == torch.device("cuda", 1)
    assert devices.resolve_device("cuda:0", local_rank=1) == torch.device("cuda", 0)  # an explicit index wins
    with pytest.raises(UserError, match="has no cuda device of its own .* start at most 2 processes per node"):
        devices.resolve_device("cuda", local_rank=2)


def test_the_process_group_speaks_gloo_for_cpu_tensors_and_the_devices_own_library_for_its_tensors():
    assert devices.dist_backend(torch.device("cpu")) == "gloo"
    assert devices.dist_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert devices.dist_backend(torch.device("cuda", 0), "nccl") == "nccl"


@pytest.mark.slow
def test_a_training_run_on_an_absent_device_stops_before_any_compute(tmp_path):
    recipe = Path(__file__).resolve().parents[1] / "configs" / "tiny-neox.yaml"
    r = subprocess.run([sys.executable, "-m", "lmforge.cli", "pretrain", str(recipe), "trainer.device=cuda",
                        f"run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error: trainer.device=cuda: cuda is not")
    assert not (tmp_path / "run").exists()


def test_suite_hides_accelerators_unless_asked():
    """The suite's exact references run on the CPU even on a GPU machine (see the root conftest.py)."""
    if os.environ.get("LMFORGE_TEST_DEVICE", "cpu") == "cpu":
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and os.environ["HIP_VISIBLE_DEVICES"] == ""
        assert devices.resolve_device("auto").type == "cpu"
