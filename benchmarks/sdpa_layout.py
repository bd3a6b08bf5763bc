"""SDPA on the CPU: q/k/v as strided views of the fused qkv projection vs copies made contiguous
first.

lmforge.models.layers.Attention views the qkv projection's output (batch, seq, groups, q_per_kv + 2,
head_dim) and transposes it to (batch, heads, seq, head_dim) without a copy; rotary makes new q and
k in that same strided layout, and v stays a view. The question: does SDPA's CPU kernel run faster
enough on contiguous inputs to pay for the three copies (and their backward)? Both ways get the same
tensors, take turns call by call, and their outputs and gradients must be equal (fp32) before
anything is timed; times are CPU time (the machine is shared), medians, the ratio the median of
per-pair ratios (> 1: contiguous faster). Shapes: a pretraining batch (Pythia-70m heads, causal over
512 tokens) and one packed-SFT document (one call per document, 113 tokens: the mean of `lmforge
bench sft_attention`'s Alpaca rows). `--help` lists the options.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from report import cpu_run_line, publish  # benchmarks/report.py

SECTION = "## Attention inputs: strided q/k/v vs contiguous before SDPA"
SHAPES = {
    "pretraining, pythia-70m heads": (8, 8, 512, 64),
    "one packed-SFT document": (1, 8, 113, 64),
}


def attend(qkv: torch.Tensor, contiguous: bool, backward: bool) -> tuple[torch.Tensor, ...]:
    """SDPA over q, k, v sliced from a (batch, seq, heads, 3, head_dim) projection, as the layer
    slices them."""
    qkv = qkv.detach().requires_grad_(backward)
    b, s, h, _, d = qkv.shape
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    q, k = q * 1.0, k * 1.0  # rotary's new tensors, in the same strided layout
    if contiguous:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h * d)
    if not backward:
        return (y,)
    y.backward(torch.ones_like(y))
    return y, qkv.grad


def timed(qkv: torch.Tensor, contiguous: bool, backward: bool) -> float:
    t0 = time.process_time()  # CPU time: on a shared machine the work, less the waits for a core
    attend(qkv, contiguous, backward)
    return time.process_time() - t0


def verdict(ratios: list[float]) -> str:
    faster = sum(r >= 1.05 for r in ratios)
    keep = (
        "lmforge keeps the strided views"
        if faster <= len(ratios) // 2
        else "contiguous inputs pay on this CPU"
    )
    return (
        f"Contiguous inputs at least 5% faster in {faster} of {len(ratios)} rows (strided / contiguous "
        f"{min(ratios):.2f}-{max(ratios):.2f}): {keep}."
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30, help="timed pairs per row")
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ratios_all = []
    lines = [
        "| shape | batch, heads, seq, head_dim | pass | strided CPU ms | contiguous CPU ms | "
        "strided / contiguous |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for name, (b, h, s, d) in SHAPES.items():
        qkv = torch.randn(b, s, h, 3, d, generator=torch.Generator().manual_seed(0))
        for backward in (False, True):
            for a, c in zip(attend(qkv, False, backward), attend(qkv, True, backward), strict=True):
                torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
            times: dict[bool, list[float]] = {False: [], True: []}
            ratios = []
            for r in range(args.repeats):
                for contiguous in (False, True) if r % 2 else (True, False):
                    times[contiguous].append(timed(qkv, contiguous, backward))
                ratios.append(times[False][-1] / times[True][-1])
            ratios_all.append(statistics.median(ratios))
            lines.append(
                f"| {name} | {b}, {h}, {s}, {d} | {'fwd+bwd' if backward else 'fwd'} | "
                f"{statistics.median(times[False]) * 1e3:.2f} | {statistics.median(times[True]) * 1e3:.2f} | "
                f"**{statistics.median(ratios):.2f}** |"
            )
    body = (
        f"{cpu_run_line('sdpa_layout.py')}; median of {args.repeats} pairs per row, taking turns; "
        f"{time.perf_counter() - t0:.0f} s in all, load average {os.getloadavg()[0]:.1f} at the end.\n\n"
        + "\n".join(lines)
        + "\n\n"
        + verdict(ratios_all)
        + "\n\n"
        + __doc__.split("\n\n", 1)[1].strip()
        + "\n"
    )
    publish(SECTION, body, args.write)


if __name__ == "__main__":
    main()
