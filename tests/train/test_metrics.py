"""The machine's peak for MFU (bounded on CPUs without bf16 matrix instructions) and the price of
a launch."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from lmforge.train import metrics
from lmforge.train.metrics import (
    bounded_cpu_peak,
    flops_per_token,
    nodes_from_env,
    peak_flops,
    tokens_per_dollar,
)


@pytest.fixture(autouse=True)
def peak_cache(tmp_path, monkeypatch):
    """The best CPU peak is remembered in the user's cache: the made-up peaks here go to a folder
    of their own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "lmforge" / "peak_flops.json"


def test_the_peak_measurement_stops_growing_at_its_time_limit():
    # With no time to spare it times the smallest GEMM only (a bf16 2048^3 GEMM takes ~12 s on an
    # AVX2 CPU).
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


@pytest.mark.parametrize(
    ("name", "bf16"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 NVL", 835.5e12),
        ("NVIDIA H100 PCIe", 756.0e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312.0e12),
    ],
)
def test_each_gpu_gets_its_own_datasheet_peak(name, bf16, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak, source = peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert peak == bf16 and source.startswith("datasheet")


@pytest.mark.parametrize(
    ("name", "fp8"),
    [
        ("NVIDIA H100 80GB HBM3", 1978.9e12),
        ("NVIDIA H100 NVL", 1670.5e12),
        ("NVIDIA H100 PCIe", 1513.0e12),
        ("NVIDIA H200", 1978.9e12),
    ],
)
def test_float8_mfu_is_counted_against_the_fp8_dense_peak(name, fp8, monkeypatch):
    """Under trainer.float8, mfu_fp8 divides the achieved FLOP/s by the FP8 dense datasheet peak
    (twice bf16's on these parts), while mfu keeps the bf16 peak."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    bf16 = peak_flops(cuda, torch.bfloat16)[0]
    # the datasheets' sparse FP8 figure is 4x the dense bf16 one
    assert fp8 == pytest.approx(2 * bf16, rel=2e-3)
    mfu = metrics.float8_mfu(cuda, flops_per_token=6e9, processes=8)
    assert mfu.peak == fp8 and "float8_e4m3fn" in mfu.source
    # 50k tokens/s per GPU at 6 GFLOP per token: 300 TFLOP/s per GPU
    tokens_per_second = 8 * 50_000.0
    assert mfu(tokens_per_second) == pytest.approx(300e12 / fp8)
    assert metrics.MFU(6e9, bf16, "bf16", 8)(tokens_per_second) == pytest.approx(300e12 / bf16)
    # cost.peak_flops_fp8 overrides the datasheet
    assert metrics.float8_mfu(cuda, 6e9, peak=1e15).peak == 1e15


def test_float8_mfu_is_left_out_where_no_fp8_peak_is_known(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with caplog.at_level(logging.WARNING):
        assert metrics.float8_mfu(torch.device("cuda", 0), 6e9) is None
    assert "cost.peak_flops_fp8" in caplog.text
    # the bf16 peak is still there
    assert peak_flops(torch.device("cuda", 0), torch.bfloat16)[0] == 312.0e12


def test_a_sliding_window_layer_counts_the_keys_it_attends_to():
    from lmforge.models import preset
    from lmforge.train.metrics import flops_per_token

    cfg = preset("gemma-2-2b")  # 13 local layers (4096-token window) and 13 global ones
    per_key = 12.0 * cfg.num_heads * cfg.head_dim
    short, long = flops_per_token(cfg, 4096), flops_per_token(cfg, 8192)
    assert long - short == per_key * 13 * 4096  # only the global layers see the 4096 extra keys


def test_a_cpu_peak_measured_under_load_gives_way_to_the_best_one_seen(peak_cache, monkeypatch):
    """Issue 18 item 14: a peak measured once on shared cores came out low (MFU 1.25). The best
    measurement of this machine is kept, so a later one taken under load does not lower it."""
    measured = iter([(2.0e11, 2048), (0.8e11, 1024), (2.5e11, 2048)])
    monkeypatch.setattr(metrics, "bounded_cpu_peak", lambda dtype, **kw: next(measured))
    cpu = torch.device("cpu")
    assert peak_flops(cpu, torch.float32)[0] == 2.0e11
    peak, source = peak_flops(cpu, torch.float32)
    assert peak == 2.0e11 and "best measured on this machine" in source
    assert peak_flops(cpu, torch.float32)[0] == 2.5e11
    assert list(json.loads(peak_cache.read_text()).values()) == [2.5e11]
    peak_cache.write_text("{torn")  # a cache that does not parse is measured anew, and rewritten
    monkeypatch.setattr(metrics, "bounded_cpu_peak", lambda dtype, **kw: (1e11, 512))
    assert peak_flops(cpu, torch.float32)[0] == 1e11 and json.loads(peak_cache.read_text())


def test_a_peak_a_little_below_the_best_is_jitter_not_news(peak_cache, monkeypatch, caplog):
    """Every run said "measured 1381.5 GFLOP/s now, 1467.3 GFLOP/s before ... (the cores are
    probably shared now)": a few percent is any measurement's jitter. Said where the cores are
    clearly busy; the source says "1 thread"."""
    measured = iter([(2.0e11, 2048), (1.9e11, 2048), (0.9e11, 2048)])
    monkeypatch.setattr(metrics, "bounded_cpu_peak", lambda dtype, **kw: next(measured))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    cpu = torch.device("cpu")
    assert peak_flops(cpu, torch.float32) == (2.0e11, "measured GEMM 2048^3, 1 thread")
    with caplog.at_level(logging.INFO, logger="lmforge.train.metrics"):
        assert peak_flops(cpu, torch.float32) == (2.0e11, "best measured on this machine, 1 thread")
        assert not caplog.records
        peak_flops(cpu, torch.float32)
    assert [r.getMessage()[:40] for r in caplog.records] == [
        "measured 90.0 GFLOP/s now, 200.0 GFLOP/s"
    ]


def test_mfu_never_exceeds_one(peak_cache, caplog):
    """A step faster than the peak says the peak was measured low: the achieved rate becomes the
    peak (with a warning, remembered for the next run), so MFU stays <= 1 and is counted against
    the higher peak after."""
    key = metrics.cpu_peak_key(torch.float32)
    mfu = metrics.MFU(
        flops_per_token=1e6, peak=1e11, source="measured", processes=2, remember_as=key
    )
    assert mfu(100_000) == pytest.approx(0.5)  # 1e11 FLOP/s over 2 processes
    with caplog.at_level(logging.WARNING, logger="lmforge.train.metrics"):
        assert mfu(250_000) == 1.0
    assert "above the peak" in caplog.text
    assert mfu(100_000) == pytest.approx(0.4)
    assert metrics.remembered_peak(key) == 1.25e11
    # warm-up steps each faster than the last (every step of a GPU run, an H200 showed): said
    # once
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmforge.train.metrics"):
        assert mfu(300_000) == 1.0
    assert "above the peak" not in caplog.text
    assert metrics.remembered_peak(key) == 1.5e11


def test_tensorboard_tags_are_grouped():
    """Issue 18 item 21: TensorBoard shows train/, val/ and perf/ panels; metrics.jsonl keeps the
    plain names."""
    tags = {
        k: metrics.tensorboard_tag(k)
        for k in (
            "loss",
            "grad_norm",
            "lr",
            "reward_margin",
            "val_loss",
            "val_accuracy",
            "tokens_per_second",
            "mfu",
            "elapsed",
            "eval/sst2/acc",
        )
    }
    assert tags == {
        "loss": "train/loss",
        "grad_norm": "train/grad_norm",
        "lr": "train/lr",
        "reward_margin": "train/reward_margin",
        "val_loss": "val/loss",
        "val_accuracy": "val/accuracy",
        "tokens_per_second": "perf/tokens_per_second",
        "mfu": "perf/mfu",
        "elapsed": "perf/elapsed",
        "eval/sst2/acc": "eval/sst2/acc",
    }


def test_the_run_summary_gives_totals_and_averages():
    """Issue 18 item 15: the last line printed the last step's tokens/s (477) as a dict while the
    run averaged ~152: it now says what the run did, in words."""
    totals = metrics.RunTotals(first_step=10)
    for tokens, seconds in ((1024, 1.0), (1024, 2.0), (1024, 3.0)):
        totals.add(tokens, seconds)
    mfu = metrics.MFU(flops_per_token=1e6, peak=1e9, source="config")
    line = totals.summary(
        13,
        125.4,
        {"loss": 4.21349, "val_loss": 4.35, "val_ppl": 77.48, "tokens_per_second": 477.3},
        mfu,
    )
    assert line == (
        "finished at step 13: 3 steps, resumed at 10, 3,072 tokens in 2m 05s (6.0s in steps): 512 "
        "tokens/s, MFU 51.2%; loss 4.2135, val_loss 4.3500, val_ppl 77.48"
    )
    assert metrics.RunTotals(first_step=5).summary(5, 1.0, {}) == "at step 5: no steps to run"
    # Priced (cost.usd_per_hour x nodes): tokens per dollar over the whole time, what the run was
    # paid for.
    priced = totals.summary(13, 120.0, {"loss": 4.21349}, mfu, usd_per_hour=3.0)
    assert ", MFU 51.2%, 30,720 tokens/$ at $3/h; loss 4.2135" in priced


def test_two_cpus_with_one_name_keep_peaks_apart(monkeypatch):
    """A VM names a Zen 3 and a Zen 5 alike ("AMD EPYC"): their feature flags tell the remembered
    peaks apart."""
    from lmforge import devices

    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "fma"})
    zen3 = metrics.cpu_peak_key(torch.float32)
    monkeypatch.setattr(devices, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512_bf16"})
    assert metrics.cpu_peak_key(torch.float32) != zen3


def test_moe_flops_count_the_routed_experts_only():
    """A token runs experts_per_token experts (and the router), whatever the number of experts:
    the FLOPs of a dense model whose MLP is k experts wide, plus the router's."""
    import dataclasses

    from lmforge.models import preset

    moe = preset("tiny-qwen3-moe")  # 8 experts of width 48, 2 per token
    dense = dataclasses.replace(moe, num_experts=0, intermediate_size=2 * 48)
    router = 6.0 * moe.num_layers * moe.hidden_size * moe.num_experts
    assert flops_per_token(moe, 32) == flops_per_token(dense, 32) + router
    assert (
        flops_per_token(dataclasses.replace(moe, num_experts=64), 32)
        == flops_per_token(dense, 32) + 8 * router
    )


def test_measuring_the_cpu_peak_leaves_the_global_random_state_alone(monkeypatch, tmp_path):
    """A run measures the peak after its resume restored the random state; drawing its GEMM
    inputs from that state moved every later dropout mask, and a resumed LoRA run (dropout 0.05)
    left its uninterrupted twin at step 5."""
    import torch

    from lmforge.train import metrics

    # the best-ever figure's cache, not the user's
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    metrics.bounded_cpu_peak(torch.float32, max_n=256, repeats=1)
    assert torch.equal(torch.get_rng_state(), before)
