"""What a training step costs: model FLOPs, the machine's peak, MFU, and tokens per dollar;
plus the run's metric sinks (TensorBoard scalars and a JSONL file)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from lmforge.models.config import ModelConfig

log = logging.getLogger(__name__)

# Dense (no sparsity) peak FLOP/s per GPU from the vendors' datasheets.
# NVIDIA H100 SXM5 / H200 SXM: "H100 Tensor Core GPU" and "H200 Tensor Core GPU" datasheets
# (989.4 TFLOPS bf16 dense, 66.9 TFLOPS fp32 / 494.7 TF32 dense); A100 SXM4: "A100 Tensor Core
# GPU" datasheet (312 TFLOPS bf16, 19.5 fp32); H100 PCIe: 756 bf16, 51 fp32; H100 NVL: 835.5 bf16 dense
# (the datasheet's 1,671 is with sparsity), 60 fp32. The first key found in the device name wins: the
# specific variants come before the plain "H100" (the SXM part, named "NVIDIA H100 80GB HBM3").
GPU_PEAKS = {
    "H200": {torch.bfloat16: 989.4e12, torch.float32: 66.9e12},
    "H100 NVL": {torch.bfloat16: 835.5e12, torch.float32: 60.0e12},
    "H100 PCIe": {torch.bfloat16: 756.0e12, torch.float32: 51.2e12},
    "H100": {torch.bfloat16: 989.4e12, torch.float32: 66.9e12},
    "A100": {torch.bfloat16: 312.0e12, torch.float32: 19.5e12},
}


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), as in the PaLM paper's MFU:
    6 * N for the weight matmuls (N = parameters that multiply activations: every Linear and
    the output head, not the embedding lookup) + 12 * layers * seq * (heads * head_dim) for the
    attention scores and the weighted sum over values (not halved for causality); a sliding-window
    layer's keys are at most its window (Mistral, Gemma's local layers)."""
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = d * (h + 2 * kv) * hd + h * hd * d
    mlp = d * cfg.intermediate_size * (3 if cfg.gated_mlp else 2)
    head = d * (cfg.num_labels or cfg.vocab_size)
    matmul_params = cfg.num_layers * (attn + mlp) + head
    keys = sum(min(seq_length, cfg.window(i) or seq_length) for i in range(cfg.num_layers))
    return 6.0 * matmul_params + 12.0 * keys * h * hd


def bounded_cpu_peak(dtype: torch.dtype, max_n: int = 2048, repeats: int = 3,
                     time_limit: float = 3.0) -> tuple[float, int]:
    """(FLOP/s, largest n timed): GEMMs from n = 256 up to max_n, doubling while the next size's
    timings fit in `time_limit` seconds. A CPU without bf16 matrix instructions runs bf16 GEMMs at
    ~1 GFLOP/s, where four 2048^3 GEMMs would take a minute of start-up; a fast one still reaches 2048."""
    start = time.perf_counter()
    best, n, size = 0.0, 256, 0
    while n <= max_n:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        fastest = float("inf")
        for i in range(repeats + 1):  # the first one warms the kernels up, and times them too
            t0 = time.perf_counter()
            a @ b
            fastest = min(fastest, time.perf_counter() - t0)
            if i and time.perf_counter() - start > time_limit:
                break
        best, size = max(best, 2 * n**3 / fastest), n
        if time.perf_counter() - start + 8 * fastest * (repeats + 1) > time_limit:  # the next n costs 8x
            break
        n *= 2
    return best, size


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of one process, where the figure comes from)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAKS.items():
            if key in name:
                return peaks[dtype], f"datasheet: {key}"
        log.warning("no datasheet peak for %s: measuring a GEMM instead", name)
        a = torch.randn(8192, 8192, device=device, dtype=dtype)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            a @ a
        torch.cuda.synchronize()
        return 5 * 2 * 8192**3 / (time.perf_counter() - t0), "measured GEMM 8192^3"
    peak, n = bounded_cpu_peak(dtype)
    if dtype == torch.bfloat16:
        fp32, _ = bounded_cpu_peak(torch.float32)
        if peak < fp32:
            log.warning("bf16 GEMM peak %.1f GFLOP/s is below fp32's %.1f GFLOP/s: this CPU has no bf16 matrix "
                        "instructions: bf16 training will be slow (trainer.precision=fp32 is faster here)",
                        peak / 1e9, fp32 / 1e9)
    return peak, f"measured GEMM {n}^3, {torch.get_num_threads()} threads"


def nodes_from_env() -> int:
    """Machines in a torchrun/Slurm launch: WORLD_SIZE / LOCAL_WORLD_SIZE (processes per node); 1 when unset."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return max(1, world // max(1, local))


def tokens_per_dollar(tokens_per_second: float, usd_per_hour: float, nodes: int = 1) -> float | None:
    """Tokens bought per US$ when each of `nodes` machines costs usd_per_hour."""
    return tokens_per_second * 3600 / (usd_per_hour * nodes) if usd_per_hour > 0 else None


class MetricSink:
    """Every logged scalar goes to TensorBoard and to metrics.jsonl (one JSON object per step)."""

    def __init__(self, run_dir: Path, enabled: bool = True, purge_step: int | None = None):
        self.enabled = enabled
        self._tb = None
        self._jsonl = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: a resumed run hides the events a killed run wrote past its checkpoint.
                self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step or None)
            except ImportError:
                log.warning("tensorboard is not installed: metrics go to metrics.jsonl only")

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                if value is not None:
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
