"""The machine's peak for MFU (bounded on CPUs without bf16 matrix instructions) and the price of a launch."""

from __future__ import annotations

import logging

import pytest
import torch

from lmforge.train import metrics
from lmforge.train.metrics import bounded_cpu_peak, nodes_from_env, peak_flops, tokens_per_dollar


def test_the_peak_measurement_stops_growing_at_its_time_limit():
    # With no time to spare it times the smallest GEMM only (a bf16 2048^3 GEMM takes ~12 s on an AVX2 CPU).
    peak, n = bounded_cpu_peak(torch.float32, time_limit=0.0)
    assert n == 256 and peak > 0
    assert bounded_cpu_peak(torch.float32, max_n=512, time_limit=60.0)[1] == 512


def test_bf16_slower_than_fp32_is_a_warning(monkeypatch, caplog):
    fake = {torch.bfloat16: (1.4e9, 512), torch.float32: (5e10, 2048)}
    monkeypatch.setattr(metrics, "bounded_cpu_peak", lambda dtype, **kw: fake[dtype])
    with caplog.at_level(logging.WARNING, logger="lmforge.train.metrics"):
        peak, source = peak_flops(torch.device("cpu"), torch.bfloat16)
    assert peak == 1.4e9 and "512^3" in source
    assert "this CPU has no bf16 matrix instructions: bf16 training will be slow" in caplog.text
    caplog.clear()
    fake[torch.bfloat16] = (8e11, 2048)
    with caplog.at_level(logging.WARNING, logger="lmforge.train.metrics"):
        peak_flops(torch.device("cpu"), torch.bfloat16)
    assert "bf16" not in caplog.text


def test_nodes_come_from_torchrun_environment(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert nodes_from_env() == 1
    monkeypatch.setenv("WORLD_SIZE", "32")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert nodes_from_env() == 4
    assert tokens_per_dollar(1000.0, 2.0, nodes=4) == 1000.0 * 3600 / 8.0


@pytest.mark.parametrize(("name", "bf16"), [("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 NVL", 835.5e12),
                                            ("NVIDIA H100 PCIe", 756.0e12), ("NVIDIA H200", 989.4e12),
                                            ("NVIDIA A100-SXM4-80GB", 312.0e12)])
def test_each_gpu_gets_its_own_datasheet_peak(name, bf16, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak, source = peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert peak == bf16 and source.startswith("datasheet")


def test_a_sliding_window_layer_counts_the_keys_it_attends_to():
    from lmforge.models import preset
    from lmforge.train.metrics import flops_per_token

    cfg = preset("gemma-2-2b")  # 13 local layers (4096-token window) and 13 global ones
    per_key = 12.0 * cfg.num_heads * cfg.head_dim
    short, long = flops_per_token(cfg, 4096), flops_per_token(cfg, 8192)
    assert long - short == per_key * 13 * 4096  # only the global layers see the 4096 extra keys
