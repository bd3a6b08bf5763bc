"""What a training step costs: model FLOPs, the machine's peak, MFU, and tokens per dollar; the
run's totals (its last line); plus the run's metric sinks (TensorBoard scalars and a JSONL file)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lmforge.fsutil import atomic_write
from lmforge.models.config import ModelConfig

log = logging.getLogger(__name__)

# Dense (no sparsity) peak FLOP/s per GPU from the vendors' datasheets. NVIDIA H100 SXM5 / H200 SXM:
# "H100 Tensor Core GPU" and "H200 Tensor Core GPU" datasheets (989.4 TFLOPS bf16 dense, 66.9 TFLOPS
# fp32 / 494.7 TF32 dense); A100 SXM4: "A100 Tensor Core GPU" datasheet (312 TFLOPS bf16, 19.5
# fp32); H100 PCIe: 756 bf16, 51 fp32; H100 NVL: 835.5 bf16 dense (the datasheet's 1,671 is with
# sparsity), 60 fp32. The first key found in the device name wins: the specific variants come before
# the plain "H100" (the SXM part, named "NVIDIA H100 80GB HBM3"). FP8 (float8_e4m3fn, what
# trainer.float8's matmuls run in): the same datasheets list it with sparsity only (H100 SXM and
# H200 3,958 TFLOPS, H100 NVL 3,341, H100 PCIe 3,026): the dense peak is half. The A100 has no FP8.
FP8 = torch.float8_e4m3fn
GPU_PEAKS = {
    "H200": {torch.bfloat16: 989.4e12, torch.float32: 66.9e12, FP8: 1978.9e12},
    "H100 NVL": {torch.bfloat16: 835.5e12, torch.float32: 60.0e12, FP8: 1670.5e12},
    "H100 PCIe": {torch.bfloat16: 756.0e12, torch.float32: 51.2e12, FP8: 1513.0e12},
    "H100": {torch.bfloat16: 989.4e12, torch.float32: 66.9e12, FP8: 1978.9e12},
    "A100": {torch.bfloat16: 312.0e12, torch.float32: 19.5e12},
}


def datasheet_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, str] | None:
    """(a GPU's dense datasheet peak for `dtype`, its source), or None for a device or dtype not
    in GPU_PEAKS."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    key = next((key for key in GPU_PEAKS if key in name), None)
    if key is None or dtype not in GPU_PEAKS[key]:
        return None
    return GPU_PEAKS[key][dtype], f"datasheet: {key}, {str(dtype).removeprefix('torch.')} dense"


def flops_per_token(cfg: ModelConfig, seq_length: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), as in the PaLM paper's MFU: 6
    * N for the weight matmuls (N = parameters that multiply activations: every Linear and the
    output head, not the embedding lookup) + 12 * layers * seq * (heads * head_dim) for the
    attention scores and the weighted sum over values (not halved for causality); a
    sliding-window layer's keys are at most its window (Mistral, Gemma's local layers). A MoE
    layer counts the experts a token is routed through (experts_per_token of them) and its
    router, not the experts it skips."""
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = d * (h + 2 * kv) * hd + h * hd * d
    mlp = d * cfg.intermediate_size * (3 if cfg.gated_mlp else 2)
    moe = d * cfg.num_experts + cfg.experts_per_token * 3 * d * (cfg.moe_intermediate_size or 0)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    head = d * (cfg.num_labels or cfg.vocab_size)
    matmul_params = (
        cfg.num_layers * attn + (cfg.num_layers - moe_layers) * mlp + moe_layers * moe + head
    )
    keys = sum(min(seq_length, cfg.window(i) or seq_length) for i in range(cfg.num_layers))
    return 6.0 * matmul_params + 12.0 * keys * h * hd


def bounded_cpu_peak(
    dtype: torch.dtype, max_n: int = 2048, repeats: int = 3, time_limit: float = 3.0
) -> tuple[float, int]:
    """(FLOP/s, largest n timed): GEMMs from n = 256 up to max_n, doubling while the next size's
    timings fit in `time_limit` seconds. A CPU without bf16 matrix instructions runs bf16 GEMMs
    at ~1 GFLOP/s, where four 2048^3 GEMMs would take a minute of start-up; a fast one still
    reaches 2048."""
    start = time.perf_counter()
    best, n, size = 0.0, 256, 0
    # Its own generator: a run measures after its resume restored the global one, which the next
    # dropout mask reads.
    generator = torch.Generator().manual_seed(0)
    while n <= max_n:
        a, b = (torch.randn(n, n, dtype=dtype, generator=generator) for _ in range(2))
        fastest = float("inf")
        for i in range(repeats + 1):  # the first one warms the kernels up, and times them too
            t0 = time.perf_counter()
            a @ b
            fastest = min(fastest, time.perf_counter() - t0)
            if i and time.perf_counter() - start > time_limit:
                break
        best, size = max(best, 2 * n**3 / fastest), n
        # the next n costs 8x
        if time.perf_counter() - start + 8 * fastest * (repeats + 1) > time_limit:
            break
        n *= 2
    return best, size


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s of one process, where the figure comes from). A CPU's is measured, and a
    measurement taken while other processes share the cores comes out low: the best figure this
    machine ever gave (cpu_peak_key) is kept in the user's cache and used when it is higher."""
    if device.type == "cuda":
        found = datasheet_peak(device, dtype)
        if found is not None:
            return found
        log.warning(
            "no datasheet peak for %s: measuring a GEMM instead", torch.cuda.get_device_name(device)
        )
        a = torch.randn(
            8192, 8192, device=device, dtype=dtype, generator=torch.Generator(device).manual_seed(0)
        )
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
            log.warning(
                "bf16 GEMM peak %.1f GFLOP/s is below fp32's %.1f GFLOP/s: this CPU has no bf16 matrix "
                "instructions: bf16 training will be slow (trainer.precision=fp32 is faster here)",
                peak / 1e9,
                fp32 / 1e9,
            )
    threads = torch.get_num_threads()
    threads = f"{threads} thread{'s' * (threads != 1)}"
    source = f"measured GEMM {n}^3, {threads}"
    key = cpu_peak_key(dtype)
    best = remembered_peak(key)
    if best is not None and best > peak:
        # A few percent below the best is every run's jitter; well below it, the cores are busy with
        # something else.
        log.log(
            logging.INFO if peak < 0.8 * best else logging.DEBUG,
            "measured %.1f GFLOP/s now, %.1f GFLOP/s "
            "before on this machine: using the higher (the cores are probably shared now)",
            peak / 1e9,
            best / 1e9,
        )
        return best, f"best measured on this machine, {threads}"
    remember_peak(key, peak)
    return peak, source


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):  # noqa: SIM115 (a tiny pseudo-file)
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak_key(dtype: torch.dtype) -> str:
    """What a CPU peak depends on: the processor (its name, and its feature flags: a VM may name two
    generations alike, "AMD EPYC"), the threads the GEMM used, the dtype and the torch build."""
    from lmforge.devices import cpu_flags

    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]
    return (
        f"{_cpu_name()} (flags {flags}) | {torch.get_num_threads()} threads | "
        f"{str(dtype).removeprefix('torch.')} | torch {torch.__version__}"
    )


def _peak_cache() -> Path:
    return (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        / "lmforge"
        / "peak_flops.json"
    )


def remembered_peak(key: str) -> float | None:
    try:
        value = json.loads(_peak_cache().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def remember_peak(key: str, flops: float) -> None:
    """Keep the higher of `flops` and the cached figure for `key` (a cache that cannot be written
    is skipped)."""
    path = _peak_cache()
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or not JSON: start it afresh
        table = {}
    if not isinstance(table, dict):
        table = {}
    try:
        if flops > float(table.get(key) or 0.0):
            table[key] = flops
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, json.dumps(table, indent=1, sort_keys=True))
    except (OSError, ValueError, TypeError) as e:
        log.debug("peak cache %s not updated: %s", path, e)


ACHIEVED = "achieved by a training step"


class MFU:
    """Model FLOPs utilization, never above 1: a step that ran faster than the peak shows the
    peak was measured low (on shared cores), so the achieved rate becomes the peak, with a
    warning (and, for a measured CPU peak, the cache keeps it)."""

    def __init__(
        self,
        flops_per_token: float,
        peak: float,
        source: str,
        processes: int = 1,
        remember_as: str | None = None,
    ):
        self.flops_per_token, self.peak, self.source = flops_per_token, peak, source
        self.processes, self.remember_as = processes, remember_as

    def __call__(self, tokens_per_second: float) -> float:
        achieved = tokens_per_second * self.flops_per_token / self.processes
        if achieved > self.peak:  # said once: warm-up steps each run faster than the last
            say = log.debug if self.source == ACHIEVED else log.warning
            say(
                "a step ran at %.1f GFLOP/s per process, above the peak of %.1f GFLOP/s (%s): the peak was measured "
                "low; MFU is counted against the achieved rate from here on%s",
                achieved / 1e9,
                self.peak / 1e9,
                self.source,
                "" if self.remember_as else " (set cost.peak_flops to fix it)",
            )
            self.peak, self.source = achieved, ACHIEVED
            if self.remember_as is not None:
                remember_peak(self.remember_as, achieved)
        return achieved / self.peak


def float8_mfu(
    device: torch.device, flops_per_token: float, processes: int = 1, peak: float | None = None
) -> MFU | None:
    """MFU against the device's FP8 dense peak (`mfu_fp8`), reported beside `mfu` (against the
    bf16 peak) when trainer.float8 is on: every model FLOP is counted against it, though only the
    blocks' linears run in FP8 (attention scores and the output head stay in bf16), so it is a
    lower bound on how busy the FP8 units are. `peak` (cost.peak_flops_fp8) overrides the
    datasheet; None where neither gives a figure."""
    found = (peak, "config") if peak else datasheet_peak(device, FP8)
    if found is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        log.warning(
            "no FP8 datasheet peak for %s: mfu_fp8 is not reported (set cost.peak_flops_fp8 to report it)",
            name,
        )
        return None
    return MFU(flops_per_token, found[0], found[1], processes)


@dataclass
class RunTotals:
    """What the steps of one invocation did, summed: the run's last line (summary)."""

    first_step: int
    steps: int = 0
    tokens: float = 0.0
    step_time: float = 0.0

    def add(self, tokens: float, step_time: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.step_time += step_time

    def summary(
        self,
        step: int,
        wall: float,
        last: dict[str, float],
        mfu: MFU | None = None,
        usd_per_hour: float = 0.0,
    ) -> str:
        """One readable line: steps, tokens, time, average tokens/s and MFU (and, priced, tokens
        per dollar over the whole time, as compare counts it), then the final loss and
        validation."""
        if not self.steps:
            return f"at step {step}: no steps to run"
        resumed = f", resumed at {self.first_step}" if self.first_step else ""
        speed = self.tokens / self.step_time if self.step_time > 0 else 0.0
        parts = [
            f"{self.steps} step{'s' * (self.steps != 1)}{resumed}, {self.tokens:,.0f} tokens in {_duration(wall)} "
            f"({_duration(self.step_time)} in steps): {speed:,.0f} tokens/s"
            + (f", MFU {mfu(speed):.1%}" if mfu is not None and speed > 0 else "")
            + (
                f", {self.tokens * 3600 / (usd_per_hour * wall):,.0f} tokens/$ at ${usd_per_hour:g}/h"
                if usd_per_hour > 0 and wall > 0
                else ""
            )
        ]
        formats = {
            "loss": "{:.4f}",
            "val_loss": "{:.4f}",
            "val_ppl": "{:,.2f}",
            "val_accuracy": "{:.2%}",
        }
        shown = [
            f"{k} {fmt.format(last[k])}"
            for k, fmt in formats.items()
            if isinstance(last.get(k), float | int) and math.isfinite(last[k])
        ]
        if shown:
            parts.append(", ".join(shown))
        return f"finished at step {step}: " + "; ".join(parts)


def _duration(seconds: float) -> str:
    if seconds < 10:  # "0s in steps" beside a token rate read as a division by zero
        return f"{seconds:.1f}s"
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s" if m else f"{s}s"


def nodes_from_env() -> int:
    """Machines in a torchrun/Slurm launch: WORLD_SIZE / LOCAL_WORLD_SIZE (processes per node); 1
    when unset."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return max(1, world // max(1, local))


def tokens_per_dollar(
    tokens_per_second: float, usd_per_hour: float, nodes: int = 1
) -> float | None:
    """Tokens bought per US$ when each of `nodes` machines costs usd_per_hour."""
    return tokens_per_second * 3600 / (usd_per_hour * nodes) if usd_per_hour > 0 else None


# TensorBoard groups scalars by the part of a tag before "/": a run's panels come as train/, val/
# and perf/ (metrics.jsonl keeps the plain names, which `lmforge compare` and scripts read).
PERF_METRICS = frozenset(
    {
        "step_time",
        "tokens_per_second",
        "sequences_per_second",
        "mfu",
        "mfu_fp8",
        "memory_gb",
        "tokens_per_dollar",
        "usd_per_million_tokens",
        "elapsed",
        "time_to_first_step",
    }
)


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a metric: val_loss -> val/loss, mfu -> perf/mfu, loss ->
    train/loss; a name that has a group already (eval/...) keeps it."""
    if "/" in key:
        return key
    if key.startswith("val_"):
        return "val/" + key.removeprefix("val_")
    return ("perf/" if key in PERF_METRICS else "train/") + key


class MetricSink:
    """Every logged scalar goes to TensorBoard (grouped, tensorboard_tag) and to metrics.jsonl
    (one JSON object per step, plain names)."""

    def __init__(self, run_dir: Path, enabled: bool = True, purge_step: int | None = None):
        self.enabled = enabled
        self._tb = None
        self._jsonl = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: readers hide earlier writers' events at steps >= it (a resume's
                # start + 1 drops what a killed run logged past its checkpoint; 1, a restart, all).
                self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge_step)
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
                    self._tb.add_scalar(tensorboard_tag(key), value, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
