"""lmforge.devices: which device a process computes on and how its process group talks (on this
CPU-only machine; an accelerator is stood in for where the rule depends on one)."""

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
    with pytest.raises(
        UserError,
        match=r"^trainer.device=cuda: cuda is not available here \(there is no accelerator",
    ):
        devices.resolve_device("cuda", key="trainer.device")
    with pytest.raises(UserError, match=r"^--device=gpu: unknown device .*: use auto, cpu"):
        devices.resolve_device("gpu")


def test_each_local_rank_gets_its_own_accelerator(monkeypatch):
    monkeypatch.setattr(devices, "accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    assert devices.resolve_device("auto", local_rank=1) == torch.device("cuda", 1)
    # an explicit index wins
    assert devices.resolve_device("cuda:0", local_rank=1) == torch.device("cuda", 0)
    with pytest.raises(
        UserError, match="has no cuda device of its own .* start at most 2 processes per node"
    ):
        devices.resolve_device("cuda", local_rank=2)


def test_the_process_group_speaks_gloo_for_cpu_tensors_and_the_devices_own_library_for_its_tensors():
    assert devices.dist_backend(torch.device("cpu")) == "gloo"
    assert devices.dist_backend(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert devices.dist_backend(torch.device("cuda", 0), "nccl") == "nccl"


@pytest.mark.slow
def test_a_training_run_on_an_absent_device_stops_before_any_compute(tmp_path):
    recipe = Path(__file__).resolve().parents[1] / "configs" / "tiny-neox.yaml"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmforge.cli",
            "pretrain",
            str(recipe),
            "trainer.device=cuda",
            f"run_dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
        "error: trainer.device=cuda: cuda is not"
    )
    assert not (tmp_path / "run").exists()


def test_suite_hides_accelerators_unless_asked():
    """The suite's exact references run on the CPU even on a GPU machine (see the root
    conftest.py)."""
    if os.environ.get("LMFORGE_TEST_DEVICE", "cpu") == "cpu":
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and os.environ["HIP_VISIBLE_DEVICES"] == ""
        assert devices.resolve_device("auto").type == "cpu"


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "flags", "expected"),
    [
        (True, False, set(), (True, "this CPU has AMX")),
        (False, True, set(), (True, "this CPU has avx512_bf16")),
        # an Arm CPU with the bf16 extension
        (False, False, {"fp", "asimd", "bf16"}, (True, "this CPU has bf16")),
        # the AVX2-only EPYC these notes were written on
        (False, False, {"avx2", "fma"}, (False, None)),
    ],
)
def test_bf16_matrix_units_of_a_cpu(amx, avx512_bf16, flags, expected, monkeypatch):
    """What trainer.precision=auto asks: torch's own CPU checks, then /proc/cpuinfo's flags."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(devices, "cpu_flags", lambda: flags)
    has, why = devices.bf16_matmul(torch.device("cpu"))
    assert has == expected[0]
    assert why == expected[1] if has else why.startswith("this CPU has no bf16 matrix instructions")


@pytest.mark.parametrize("supported", [True, False])
def test_bf16_matrix_units_of_a_cuda_device(supported, monkeypatch):
    monkeypatch.setattr(
        torch.cuda, "get_device_name", lambda device=None: "NVIDIA T4" if not supported else "H100"
    )
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: supported)
    has, why = devices.bf16_matmul(torch.device("cuda", 0))
    assert (
        has == supported
        and ("has bf16 tensor cores" if supported else "no bf16 tensor cores") in why
    )


def test_this_machines_cpu_flags_agree_with_torch():
    """The /proc/cpuinfo reading is what torch's own check finds (on x86 Linux, where both
    exist)."""
    flags = devices.cpu_flags()
    if "avx2" not in flags:
        pytest.skip("not an x86 Linux CPU")
    assert ("avx512_bf16" in flags) == torch.cpu._is_avx512_bf16_supported()


# torch 2.9+'s per-backend names, which set_float32_matmul_precision also writes ('none' ->
# 'ieee'/'tf32'): Inductor's cache key includes them, so a test that leaves them changed makes a
# later compiled run in the same process miss a cache another process filled
# (tests/train/test_compile.py failed after this test in the suite).
NEW_PRECISION_FLAGS = [
    (torch.backends.cuda.matmul, "fp32_precision"),
    # (torch 2.6 has no .matmul)
    (getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision"),
]


@pytest.fixture
def tf32_flags():
    """The process-wide TF32 flags, restored after the test (the legacy ones and torch 2.9+'s new
    names)."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    new = [
        (obj, name, getattr(obj, name)) for obj, name in NEW_PRECISION_FLAGS if hasattr(obj, name)
    ]
    yield lambda: (
        torch.get_float32_matmul_precision(),
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
    )
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cudnn.allow_tf32 = saved[1]
    for obj, name, value in new:
        setattr(obj, name, value)
    assert [getattr(obj, name) for obj, name, _ in new] == [value for *_, value in new]


def test_tf32_is_set_for_cuda_only_and_off_by_the_key(tf32_flags):
    torch.set_float32_matmul_precision("highest")
    before = tf32_flags()
    # a CPU keeps its own
    assert not devices.set_tf32(torch.device("cpu"), True) and tf32_flags() == before
    assert devices.set_tf32(torch.device("cuda", 1), True)
    assert tf32_flags() == ("high", True, True)
    # torch 2.9+: the new names agree, no mixed-API error
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert devices.set_tf32(torch.device("cuda"), False)
    assert tf32_flags() == ("highest", False, False)
