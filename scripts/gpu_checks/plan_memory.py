"""The plan check: `lmforge plan`'s peak memory (one step traced on fake tensors) against the
device allocator's measured peak for the same runs, in each activation-checkpointing mode, for a
dense model, a mixture of experts and LoRA."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from gpu_checks.base import ROOT, Context, Skip, check, free
from gpu_checks.training import overrides, train
from lmforge.devices import max_memory_allocated, reset_peak_memory_stats

# name -> the run's overrides beyond gpu_checks.training.overrides (bf16-mixed, 2 steps)
CASES = {
    "dense none": ["trainer.activation_checkpointing=none"],
    "dense selective": ["trainer.activation_checkpointing=selective"],
    "dense full": ["trainer.activation_checkpointing=full"],
    "moe full": [
        "model.preset=qwen3-30b-a3b",
        "model.num_layers=2",
        "model.hidden_size=1024",
        "model.num_heads=8",
        "model.num_kv_heads=4",
        "model.num_experts=32",
        "trainer.activation_checkpointing=full",
    ],
    "lora selective": [
        "lora.rank=16",
        "lora.targets=all-linear",
        "trainer.activation_checkpointing=selective",
    ],
}
# measured / planned: the allocator rounds blocks up and keeps cuBLAS workspaces; the plan counts
# tensors alone
LOW, HIGH = 0.85, 1.2


def planned_peak(args: list[str]) -> float:
    """`lmforge plan`'s peak for one process on this device, GiB: in a process of its own (its
    traces fork, which a process holding CUDA must not)."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmforge.cli",
            "plan",
            os.devnull,
            *args,
            "--world-size",
            "1",
            "--device",
            "cuda",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    if r.returncode != 0:
        raise AssertionError(f"lmforge plan failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout)["ranks"][0]["peak"] / 2**30


@check
def check_plan_memory(ctx: Context) -> tuple[str, dict]:
    """Each case trains 2 steps (the second holds the optimizer state through its forward and
    backward, as the plan counts it) from an empty device; its measured peak must be within
    LOW..HIGH of the plan's, and the dense modes' peaks must fall none > selective > full as
    planned."""
    if ctx.device.type != "cuda" or ctx.quick:
        raise Skip("the plan is of a CUDA run; the CPU allocator reports no peak")
    fig, bad = {}, []
    for name, extra in CASES.items():
        run_dir = ctx.tmp / f"plan-{name.replace(' ', '-')}"
        args = overrides(ctx, run_dir, 2, "trainer.precision=bf16-mixed", *extra)
        planned = planned_peak(args)
        free(ctx)
        reset_peak_memory_stats(ctx.device)
        trainer, _ = train(ctx, args)
        measured = max_memory_allocated(ctx.device) / 2**30
        del trainer
        free(ctx)
        shutil.rmtree(run_dir, ignore_errors=True)
        fig[name] = {"planned_gib": planned, "measured_gib": measured, "ratio": measured / planned}
        if not LOW <= measured / planned <= HIGH:
            bad.append(
                f"{name}: measured {measured:.2f} GiB, planned {planned:.2f} ({measured / planned:.2f}x)"
            )
    dense = [fig[f"dense {m}"]["measured_gib"] for m in ("none", "selective", "full")]
    if not dense[0] > dense[1] > dense[2]:
        bad.append(f"dense peaks none/selective/full {dense} do not fall")
    if bad:
        raise AssertionError("; ".join(bad))
    return ", ".join(
        f"{n} {v['measured_gib']:.2f}/{v['planned_gib']:.2f} GiB" for n, v in fig.items()
    ) + " (measured/planned, Pythia-160m shape, 4 x 1024 tokens, bf16-mixed)", fig
