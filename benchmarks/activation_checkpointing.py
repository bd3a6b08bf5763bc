"""Training step time under trainer.activation_checkpointing=none|selective|full, side by side in
one run.

One model per preset (random weights, fp32) with three copies of the same weights, one per mode
(lmforge.train.setup.apply_activation_checkpointing), each taking the pretraining step (fused
cross-entropy, backward, AdamW) on the same batch; the modes take turns, step by step; times are
medians, and each mode's cost is the median of its per-turn ratios to `none`. Before timing, the
three first steps' gradients must be equal bit for bit. The memory each mode saves is what `lmforge
plan` traces (README). `--help` lists the options.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from report import cpu_run_line, publish  # benchmarks/report.py

from lmforge.models import build, preset
from lmforge.train.setup import apply_activation_checkpointing
from lmforge.train.tasks import get_task

SECTION = "## Activation checkpointing: none, selective, full"
MODES = ("none", "selective", "full")


def run(args) -> list[dict]:
    rows = []
    task = get_task("pretrain")
    for name in args.models:
        cfg = preset(name)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab_size, (args.rows, args.seq), generator=gen)
        batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1)}
        steps, first = [], []
        for mode in MODES:
            model = build(cfg, seed=0).float().train()
            apply_activation_checkpointing(model, mode)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

            def step(model=model, optimizer=optimizer, batch=batch) -> None:
                optimizer.zero_grad(set_to_none=True)
                loss, count, _ = task.loss(model, batch)
                (loss / count).backward()
                optimizer.step()

            model.zero_grad(set_to_none=True)
            loss, count, _ = task.loss(model, batch)
            (loss / count).backward()
            first.append([p.grad.clone() for p in model.parameters()])
            steps.append(step)
        if not all(
            torch.equal(a, b) for grads in first[1:] for a, b in zip(first[0], grads, strict=True)
        ):
            raise SystemExit(f"{name}: the modes' gradients differ")
        times = [[] for _ in MODES]
        for _ in range(args.repeats + 1):  # the first turn warms up
            for step, t in zip(steps, times, strict=True):
                start = time.perf_counter()
                step()
                t.append(time.perf_counter() - start)
        times = [t[1:] for t in times]
        for mode, t in zip(MODES, times, strict=True):
            rows.append(
                dict(
                    model=name,
                    mode=mode,
                    seconds=statistics.median(t),
                    vs_none=statistics.median(a / b for a, b in zip(t, times[0], strict=True)),
                )
            )
            print(rows[-1], flush=True)
    return rows


def table(rows: list[dict], tokens: int) -> str:
    lines = [
        "| model | mode | s/step | tokens/s | time vs none |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {x['model']} | {x['mode']} | {x['seconds']:.2f} | {tokens / x['seconds']:,.0f} | "
        f"**{x['vs_none']:.2f}x** |"
        for x in rows
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        default="pythia-70m",
        type=lambda s: s.split(","),
        help="presets, comma-separated",
    )
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rows", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per mode and model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = run(args)
    body = (
        f"{cpu_run_line('activation_checkpointing.py')}; {args.rows} x {args.seq} tokens per step "
        f"(pretraining: fused cross-entropy, backward, AdamW); gradients of the three modes equal bit for bit; "
        f"median of {args.repeats} steps per mode, taking turns; {time.perf_counter() - t0:.0f} s in all, load "
        f"average {os.getloadavg()[0]:.1f} at the end.\n\n{table(rows, args.rows * args.seq)}\n"
    )
    publish(SECTION, body, args.write)


if __name__ == "__main__":
    main()
