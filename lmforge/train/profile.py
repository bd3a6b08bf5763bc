"""Where a training step's time goes: torch.profiler self time per op, summed into a few
categories (GEMMs, the loss over the vocabulary, attention, dtype casts, optimizer ...) that say
what to fix."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.autograd import DeviceType

# (category, op-name prefixes), first match wins; checked after the ancestry rules in `category`.
OP_CATEGORIES = (
    (
        "GEMMs (mm, addmm, bmm)",
        (
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::baddbmm",
            "aten::_addmm_activation",
            "aten::mkldnn_",
            "aten::_mkldnn",
        ),
    ),
    (
        "attention (SDPA)",
        ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention"),
    ),
    (
        "loss over the vocabulary (log-softmax, NLL)",
        (
            "aten::_log_softmax",
            "aten::_softmax",
            "aten::nll_loss",
            "aten::log_softmax",
            "aten::cross_entropy",
        ),
    ),
    ("copies and dtype casts (copy_, _to_copy)", ("aten::copy_", "aten::_to_copy")),
    ("fill_ / zero_", ("aten::fill_", "aten::zero_")),
    ("layer norm", ("aten::native_layer_norm",)),
    ("GELU", ("aten::gelu",)),
    ("embedding", ("aten::embedding", "aten::index_select", "aten::index_add")),
    ("grad-norm clipping", ("aten::linalg_vector_norm", "aten::_foreach_norm", "aten::norm")),
)
OTHER = "other ops (add, mul, cat, rotary ...)"
ORDER = (
    [name for name, _ in OP_CATEGORIES[:3]]
    + ["optimizer step"]
    + [n for n, _ in OP_CATEGORIES[3:]]
    + [OTHER, "Python / framework"]
)


def _within(event, *names: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if any(n in parent.name for n in names):
            return True
        parent = parent.cpu_parent
    return False


def category(event) -> str:
    """The category of one profiler event's self time."""
    name = event.name
    if name.startswith(("Optimizer.step", "Optimizer.zero_grad")) or _within(
        event, "Optimizer.step", "Optimizer.zero_grad"
    ):
        return "optimizer step"  # whatever the op: the optimizer's
    if name.startswith(OP_CATEGORIES[0][1]):
        return OP_CATEGORIES[0][0]
    if not name.startswith("aten::"):
        return "Python / framework"  # record_function ranges, autograd nodes: their own time only
    if _within(event, "LinearCrossEntropy"):  # the non-GEMM work of lmforge's chunked cross-entropy
        return OP_CATEGORIES[2][0]
    for label, prefixes in OP_CATEGORIES[1:]:
        if name.startswith(prefixes):
            return label
    return OTHER


def categorize(events) -> dict[str, float]:
    """Seconds of self time per category over profiler events (`prof.events()`)."""
    out: dict[str, float] = {}
    for event in events:
        key = category(event)
        out[key] = out.get(key, 0.0) + event.self_cpu_time_total / 1e6
    return out


def profile_step(step: Callable[[], object]) -> dict[str, float]:
    """Seconds of self time per category over one call of `step` (a training step)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return categorize(prof.events())


def profile_table(profiles: dict[str, dict[str, float]]) -> str:
    """A markdown table: one row per category, ms and share of the step for each profiled side."""
    names = list(profiles)
    totals = {n: sum(profiles[n].values()) for n in names}
    lines = [
        "| where | " + " | ".join(f"{n} ms | %" for n in names) + " |",
        "| --- | " + " | ".join("---: | ---:" for _ in names) + " |",
    ]
    for key in ORDER:
        if not any(profiles[n].get(key) for n in names):
            continue
        cells = [
            f"{1e3 * profiles[n].get(key, 0.0):,.0f} | {100 * profiles[n].get(key, 0.0) / totals[n]:.0f}%"
            for n in names
        ]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append(
        "| **step (profiled)** | "
        + " | ".join(f"**{1e3 * totals[n]:,.0f}** | 100%" for n in names)
        + " |"
    )
    return "\n".join(lines)


# --- On an accelerator: the device's kernel time, not the host's op time
# ---------------------------------------------

FUSED = "Inductor-fused kernels (Triton)"
COMMUNICATION = "communication (NCCL)"
# Kernel names -> category, first match wins, for kernels whose launching op does not say (Triton
# kernels that Inductor launches under a range named after the kernel, NCCL's under c10d's ranges).
# Inductor names a fused kernel after the ops it fused (triton_red_fused__log_softmax_...,
# triton_poi_fused__to_copy_0: a cast).
KERNEL_NAMES = (
    (OP_CATEGORIES[1][0], ("flash", "fmha", "attention", "attn", "sdpa", "flex")),
    (
        OP_CATEGORIES[0][0],
        (
            "gemm",
            "nvjet",
            "cutlass",
            "xmma",
            "wgmma",
            "cublas",
            "triton_tem_fused_mm",
            "triton_tem_fused_addmm",
            "triton_tem_fused_bmm",
        ),
    ),
    (COMMUNICATION, ("nccl",)),
    (OP_CATEGORIES[2][0], ("log_softmax", "nll_loss", "cross_entropy", "logsumexp")),
    # lmforge.train.optim_triton's, torch's
    ("optimizer step", ("adamwsr", "multi_tensor_apply", "fused_adam")),
    ("layer norm", ("layer_norm", "rms_norm")),
    ("GELU", ("gelu",)),
    (OP_CATEGORIES[3][0], ("memcpy", "_to_copy", "copy_kernel")),
    (OP_CATEGORIES[4][0], ("memset", "fill", "zero")),
    (FUSED, ("triton_",)),
)
DEVICE_ORDER = [*ORDER[:-1], COMMUNICATION, FUSED]


def kernel_category(name: str) -> str:
    low = name.lower()
    return next((label for label, keys in KERNEL_NAMES if any(k in low for k in keys)), OTHER)


@dataclass
class DeviceProfile:
    """One step's device time: `categories` sums kernel durations; `busy` is their union in time
    (kernels that ran side by side on two streams counted once), so `wall - busy` is the device
    idle within the step: what the host (Python, launches, syncs) did not keep fed."""

    wall: float
    busy: float = 0.0
    kernels: int = 0
    categories: dict[str, float] = field(default_factory=dict)
    # (kernel, launches, seconds), longest first
    top: list[tuple[str, int, float]] = field(default_factory=list)


def summarize_device(events, wall: float, top: int = 8) -> DeviceProfile:
    """A DeviceProfile of profiler events (`prof.events()`) over a step that took `wall` seconds.
    A kernel goes to the category of the op that launched it (the CPU rules: within the
    optimizer's step the optimizer, aten::mm a GEMM ...), and by its own name where that op does
    not say (a record_function range, a compiled graph's launch)."""
    cpu = {e.id: e for e in events if e.device_type == DeviceType.CPU}
    # gpu_user_annotation events are record_function ranges mirrored on the device's timeline, not
    # kernels.
    kernels = [
        e
        for e in events
        if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
    ]
    out = DeviceProfile(wall=wall, kernels=len(kernels))
    per_name: dict[str, list] = {}
    spans = []
    for k in kernels:
        seconds = (k.time_range.end - k.time_range.start) / 1e6
        launcher = cpu.get(getattr(k, "linked_correlation_id", 0) or -1)
        label = category(launcher) if launcher is not None else "Python / framework"
        if label in ("Python / framework", OTHER):
            label = kernel_category(k.name)
        out.categories[label] = out.categories.get(label, 0.0) + seconds
        entry = per_name.setdefault(k.name, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds
        spans.append((k.time_range.start, k.time_range.end))
    end = float("-inf")
    for start, stop in sorted(spans):  # the union of the kernels' intervals
        if stop > end:
            out.busy += (stop - max(start, end)) / 1e6
            end = stop
    out.top = sorted(((n, c, s) for n, (c, s) in per_name.items()), key=lambda t: -t[2])[:top]
    return out


def profile_device_step(step: Callable[[], object], device: torch.device) -> DeviceProfile:
    """One step's kernels on `device` (CUDA; elsewhere only the wall time comes back). A first
    profiled step warms the profiler up (CUPTI's start-up would otherwise land in the measured
    step); the second is the one counted."""
    from lmforge.devices import synchronize

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        step()
        synchronize(device)
        prof.step()
        start = time.perf_counter()
        step()
        synchronize(device)
        wall = time.perf_counter() - start
        prof.step()
    return summarize_device(prof.events() or [], wall)


def device_profile_table(
    profiles: dict[str, DeviceProfile], gemm_flops: float | None = None
) -> str:
    """A markdown table: kernel ms per category and its share of the step's wall time, per
    profiled side; then the device's busy and idle time, the kernel count and (given the step's
    matmul FLOPs) the GEMM kernels' rate."""
    names = list(profiles)
    head = [
        "| where (device time) | " + " | ".join(f"{n} ms | % of step" for n in names) + " |",
        "| --- | " + " | ".join("---: | ---:" for _ in names) + " |",
    ]

    def row(label: str, values: list[float]) -> str:
        return (
            f"| {label} | "
            + " | ".join(
                f"{1e3 * v:,.1f} | {100 * v / profiles[n].wall:.0f}%" for n, v in zip(names, values)
            )
            + " |"
        )

    lines = [
        row(key, [profiles[n].categories.get(key, 0.0) for n in names])
        for key in DEVICE_ORDER
        if any(profiles[n].categories.get(key) for n in names)
    ]
    lines += [
        row("**device busy** (kernels' union in time)", [profiles[n].busy for n in names]),
        row(
            "**device idle** within the step (host-bound)",
            [profiles[n].wall - profiles[n].busy for n in names],
        ),
        row("**step** (wall, profiled)", [profiles[n].wall for n in names]),
        "| kernels launched | " + " | ".join(f"{profiles[n].kernels:,} | " for n in names) + " |",
    ]
    if gemm_flops:
        rates = [
            gemm_flops / p.categories[OP_CATEGORIES[0][0]] / 1e12
            if p.categories.get(OP_CATEGORIES[0][0])
            else None
            for p in (profiles[n] for n in names)
        ]
        lines.append(
            "| GEMM kernels' rate (6N FLOPs / their time), TFLOP/s | "
            + " | ".join(f"{r:,.0f} | " if r else "- | " for r in rates)
            + " |"
        )
    tops = []
    for n in names:
        shown = "; ".join(f"`{k[:70]}` {1e3 * s:.1f} ms ({c}x)" for k, c, s in profiles[n].top[:5])
        tops.append(f"- {n}, longest kernels: {shown or 'none recorded'}")
    return "\n".join(head + lines) + "\n\n" + "\n".join(tops)
