"""Where a training step's time goes: torch.profiler self time per op, summed into a few categories
(GEMMs, the loss over the vocabulary, attention, dtype casts, optimizer ...) that say what to fix."""

from __future__ import annotations

from collections.abc import Callable

import torch

# (category, op-name prefixes), first match wins; checked after the ancestry rules in `category`.
OP_CATEGORIES = (
    ("GEMMs (mm, addmm, bmm)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation",
                                "aten::mkldnn_", "aten::_mkldnn")),
    ("attention (SDPA)", ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention")),
    ("loss over the vocabulary (log-softmax, NLL)", ("aten::_log_softmax", "aten::_softmax", "aten::nll_loss",
                                                     "aten::log_softmax", "aten::cross_entropy")),
    ("copies and dtype casts (copy_, _to_copy)", ("aten::copy_", "aten::_to_copy")),
    ("fill_ / zero_", ("aten::fill_", "aten::zero_")),
    ("layer norm", ("aten::native_layer_norm",)),
    ("GELU", ("aten::gelu",)),
    ("embedding", ("aten::embedding", "aten::index_select", "aten::index_add")),
    ("grad-norm clipping", ("aten::linalg_vector_norm", "aten::_foreach_norm", "aten::norm")),
)
OTHER = "other ops (add, mul, cat, rotary ...)"
ORDER = [name for name, _ in OP_CATEGORIES[:3]] + ["optimizer step"] + [n for n, _ in OP_CATEGORIES[3:]] + [
    OTHER, "Python / framework"]


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
    if name.startswith(("Optimizer.step", "Optimizer.zero_grad")) or _within(event, "Optimizer.step",
                                                                            "Optimizer.zero_grad"):
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
    lines = ["| where | " + " | ".join(f"{n} ms | %" for n in names) + " |",
             "| --- | " + " | ".join("---: | ---:" for _ in names) + " |"]
    for key in ORDER:
        if not any(profiles[n].get(key) for n in names):
            continue
        cells = [f"{1e3 * profiles[n].get(key, 0.0):,.0f} | {100 * profiles[n].get(key, 0.0) / totals[n]:.0f}%"
                 for n in names]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("| **step (profiled)** | " + " | ".join(f"**{1e3 * totals[n]:,.0f}** | 100%" for n in names) + " |")
    return "\n".join(lines)
