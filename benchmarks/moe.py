"""Mixture-of-experts MLP, forward + backward: lmforge's grouped experts vs transformers' Mixtral
and Qwen3-MoE blocks on the same weights and inputs.

transformers 5 runs its experts one of two ways: `grouped_mm` (its default where torch has a grouped
GEMM, this CPU build included: pairs sorted by expert, torch's grouped GEMM, autograd through it)
and `eager` (a loop over the experts that gathers each one's tokens, `index_add_`s its output, and
slices each expert's weight out of the stacked tensor, so autograd sums a whole-weight zero tensor
per expert). Both are timed beside lmforge's `lmforge.models.moe.MoE` (pairs sorted by expert once,
the per-expert GEMMs through torch's grouped GEMM on the CPU, forward and backward written out, each
expert's weight gradient written once). Before timing, the script asserts that the three give the
same output and gradients (fp32; bf16 on an accelerator, within bf16's rounding). The three take
turns, round by round; times are medians over the rounds, ratios the median of per-round ratios
(robust to other load on the machine): > 1 means lmforge is faster. `--device cuda` runs larger
shapes (Mixtral's width, Qwen3-30B-A3B's 128 experts) in bf16; where lmforge.models.moe.GROUPED_MM
does not list the device yet, a fourth side runs lmforge's experts through torch's grouped GEMM
there too (what listing it would give). `--help` lists the options.
"""

import argparse
import datetime
import os
import platform
import statistics
import time

import torch
import transformers as tf
from report import accelerator_description, write_block  # benchmarks/report.py
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from lmforge.devices import resolve_device, synchronize
from lmforge.models import moe as moe_module
from lmforge.models.config import ModelConfig
from lmforge.models.layers import ACTIVATIONS
from lmforge.models.moe import MoE

SECTION = "## Mixture of experts: grouped experts vs transformers' MoE blocks"
IMPLEMENTATIONS = ("grouped_mm", "eager")
# (name, family, hidden, expert width, experts, experts per token)
SHAPES = [
    ("Mixtral-shaped, tiny", "mixtral", 64, 128, 8, 2),
    ("Mixtral-shaped, small", "mixtral", 256, 512, 8, 2),
    ("Qwen3-MoE-shaped, tiny", "qwen3_moe", 64, 32, 32, 4),
    ("Qwen3-MoE-shaped, small", "qwen3_moe", 256, 128, 64, 8),
]
ACCELERATOR_SHAPES = [
    ("Mixtral-shaped", "mixtral", 1024, 3584, 8, 2),
    ("Qwen3-30B-A3B-shaped", "qwen3_moe", 2048, 768, 128, 8),
]


def transformers_block(
    family: str, hidden: int, width: int, experts: int, k: int, implementation: str
):
    if family == "mixtral":
        config = tf.MixtralConfig(
            hidden_size=hidden,
            intermediate_size=width,
            num_local_experts=experts,
            num_experts_per_tok=k,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
        cls = MixtralSparseMoeBlock
    else:
        config = tf.Qwen3MoeConfig(
            hidden_size=hidden,
            moe_intermediate_size=width,
            num_experts=experts,
            num_experts_per_tok=k,
            norm_topk_prob=True,
            num_attention_heads=4,
            num_key_value_heads=4,
        )
        cls = Qwen3MoeSparseMoeBlock
    config._experts_implementation = implementation
    return cls(config).train()


def lmforge_block(ref, family: str, hidden: int, width: int, experts: int, k: int) -> MoE:
    cfg = ModelConfig(
        family=family,
        vocab_size=16,
        hidden_size=hidden,
        num_layers=1,
        num_heads=4,
        intermediate_size=width,
        moe_intermediate_size=width,
        norm="rmsnorm",
        activation="silu",
        gated_mlp=True,
        mlp_bias=False,
        attention_bias=False,
        num_experts=experts,
        experts_per_token=k,
        router_norm_topk=True,
        qk_norm="head" if family == "qwen3_moe" else "none",
    )
    ours = MoE(cfg, ACTIVATIONS["silu"]).train()
    # transformers stacks each expert's gate rows then its up rows; lmforge gives each a dim
    with torch.no_grad():
        ours.router.weight.copy_(ref.gate.weight)
        ours.experts.gate_up.copy_(ref.experts.gate_up_proj.view(ours.experts.gate_up.shape))
        ours.experts.down.copy_(ref.experts.down_proj)
    return ours


def weights(block) -> list[torch.Tensor]:
    """(router, stacked gate/up, stacked down) of either kind of block."""
    if isinstance(block, MoE):
        return [block.router.weight, block.experts.gate_up, block.experts.down]
    return [block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]


def fwd_bwd(block, x: torch.Tensor, grad: torch.Tensor):
    return lambda: (block(x), *torch.autograd.grad(block(x), [x, *weights(block)], grad))


def timed_call(block, x: torch.Tensor, grad: torch.Tensor, grouped: bool = False):
    """One forward + backward of `block`; `grouped`: with x's device listed in GROUPED_MM for the
    call."""

    def call():
        listed = moe_module.GROUPED_MM.get(x.device.type)
        if grouped:
            moe_module.GROUPED_MM[x.device.type] = (x.dtype,)
        try:
            return torch.autograd.grad(block(x), [x, *weights(block)], grad)
        finally:
            if grouped and listed is None:
                del moe_module.GROUPED_MM[x.device.type]
            elif grouped:
                moe_module.GROUPED_MM[x.device.type] = listed

    return call


def check_equal(blocks, x: torch.Tensor, grad: torch.Tensor) -> None:
    """Output, and the gradients of the input, the router and the experts: the same from each
    block (fp32: to 1e-4; bf16: within its rounding of the largest entry)."""
    outs = [fwd_bwd(b, x, grad)() for b in blocks]
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            # lmforge's gate_up gives gate and up a dimension each: (experts, 2,
            # width, d)
            b = b.reshape(a.shape)
            if x.dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            else:
                torch.testing.assert_close(
                    a.float(), b.float(), rtol=5e-2, atol=5e-2 * b.abs().max().item()
                )


def run(args) -> list[dict]:
    rows = []
    device, dtype = args.device, torch.float32 if args.device.type == "cpu" else torch.bfloat16
    # a fourth side: lmforge with the device listed
    extra = device.type not in moe_module.GROUPED_MM
    for name, family, hidden, width, experts, k in (
        SHAPES if device.type == "cpu" else ACCELERATOR_SHAPES
    ):
        torch.manual_seed(0)
        theirs = {
            impl: transformers_block(family, hidden, width, experts, k, impl)
            for impl in IMPLEMENTATIONS
        }
        with torch.no_grad():
            for p in theirs["grouped_mm"].parameters():
                p.normal_(0.0, 0.02)
            theirs["eager"].load_state_dict(theirs["grouped_mm"].state_dict())
        ours = lmforge_block(theirs["grouped_mm"], family, hidden, width, experts, k)
        blocks = [b.to(device, dtype) for b in (theirs["grouped_mm"], theirs["eager"], ours)]
        x = (
            torch.randn(args.tokens // args.seq, args.seq, hidden)
            .to(device, dtype)
            .requires_grad_()
        )
        grad = torch.randn_like(x)
        check_equal(blocks, x, grad)
        calls = [timed_call(b, x, grad) for b in blocks] + (
            [timed_call(ours, x, grad, grouped=True)] if extra else []
        )
        for call in calls * 2:  # warm-up
            call()
        times = [[] for _ in calls]
        for _ in range(args.repeats):
            for call, t in zip(calls, times, strict=True):
                synchronize(device)
                start = time.perf_counter()
                call()
                synchronize(device)
                t.append(time.perf_counter() - start)
        ms = [statistics.median(t) * 1e3 for t in times]
        ratios = [
            statistics.median(a / b for a, b in zip(t, times[2], strict=True)) for t in times[:2]
        ]
        rows.append(
            dict(
                name=name,
                shape=f"d {hidden}, {experts} experts x {width}, top {k}",
                grouped=ms[0],
                eager=ms[1],
                ours=ms[2],
                vs_grouped=ratios[0],
                vs_eager=ratios[1],
            )
        )
        if extra:
            rows[-1].update(
                ours_grouped=ms[3],
                grouped_vs_grouped=statistics.median(
                    a / b for a, b in zip(times[0], times[3], strict=True)
                ),
            )
        r = rows[-1]
        print(
            f"{name}: transformers grouped_mm {r['grouped']:.1f} ms, eager {r['eager']:.1f} ms, lmforge "
            f"{r['ours']:.1f} ms ({r['vs_grouped']:.2f}x, {r['vs_eager']:.2f}x)",
            flush=True,
        )
    return rows


def table(rows: list[dict], args, load: tuple[float, float]) -> str:
    on_cpu = args.device.type == "cpu"
    where = (
        f"CPU fp32: {platform.processor() or platform.machine()} ({_cpu_name()}), {torch.get_num_threads()} "
        "threads"
        if on_cpu
        else f"{accelerator_description(args.device)}, bf16"
    )
    extra = "ours_grouped" in rows[0]
    lines = [
        f"`python benchmarks/moe.py{_options(args)} --write` (or `lmforge bench moe{_options(args)} --write`), "
        f"{datetime.date.today().isoformat()}, {where}, torch {torch.__version__}, transformers {tf.__version__}; "
        f"{args.tokens} tokens ({args.tokens // args.seq} x {args.seq}) through one MoE MLP, forward + backward "
        f"(gradients of the input and every weight), median of {args.repeats} rounds. Load average {load[0]:.1f} "
        f"before, {load[1]:.1f} after"
        + (
            " (2 cores shared with other work: absolute times move, the paired ratios much less)."
            if on_cpu
            else "."
        ),
        "",
        "| shape | transformers grouped_mm (default) ms | transformers eager ms | lmforge ms | vs grouped_mm "
        "| vs eager |" + (" lmforge, grouped GEMM ms | vs grouped_mm |" if extra else ""),
        "| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if extra else ""),
    ]
    for r in rows:
        lines.append(
            f"| {r['name']}: {r['shape']} | {r['grouped']:.1f} | {r['eager']:.1f} | {r['ours']:.1f} | "
            f"{r['vs_grouped']:.2f}x | {r['vs_eager']:.2f}x |"
            + (f" {r['ours_grouped']:.1f} | {r['grouped_vs_grouped']:.2f}x |" if extra else "")
        )

    def span(key: str) -> str:
        return f"{min(r[key] for r in rows):.2f}x-{max(r[key] for r in rows):.2f}x"

    def met(key: str) -> int:
        return sum(r[key] >= 2.0 for r in rows)

    lines += [
        "",
        f"lmforge against transformers' eager experts: {span('vs_eager')}; against its grouped_mm default: "
        f"{span('vs_grouped')}. 2x or more (lmforge's goal for grouped experts) on {met('vs_eager')} of "
        f"{len(rows)} shapes against eager, {met('vs_grouped')} of {len(rows)} against grouped_mm.",
    ]
    if extra:
        lines[-1] += (
            f" With its experts through the device's grouped GEMM (not listed in GROUPED_MM yet): "
            f"{span('grouped_vs_grouped')} against grouped_mm."
        )
    if on_cpu:
        lines[-1] += (
            " On the CPU lmforge and grouped_mm run the same grouped GEMMs through torch's kernel (a "
            "profile in BENCHMARKS.md counted the same GEMMs on both sides, ~87% of either's "
            "time): what can differ is the work around them (gathers, the scatter-add backward of "
            "transformers' indexing, the activation)."
        )
    return "\n".join(lines) + "\n"


def _options(args) -> str:
    """The options the run was given (defaults left out), as the command to repeat it."""
    given = {
        "tokens": 2048 if args.device.type == "cpu" else 8192,
        "seq": 512,
        "repeats": 5,
        "threads": None,
    }
    out = "".join(f" --{k} {getattr(args, k)}" for k, d in given.items() if getattr(args, k) != d)
    return out + ("" if args.device.type == "cpu" else f" --device {args.device}")


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="tokens per forward (default 2048; 8192 on an accelerator)",
    )
    p.add_argument(
        "--seq",
        type=int,
        default=512,
        help="sequence length the tokens are arranged in (default 512)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per shape (default 5)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1 ...")
    p.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    args = p.parse_args()
    args.device = resolve_device(args.device)
    args.tokens = args.tokens or (2048 if args.device.type == "cpu" else 8192)
    if args.threads:
        torch.set_num_threads(args.threads)
    before = os.getloadavg()[0]
    rows = run(args)
    body = table(rows, args, (before, os.getloadavg()[0]))
    print(body)
    if args.write:
        label = "CPU, fp32" if args.device.type == "cpu" else f"{args.device.type.upper()}, bf16"
        write_block(SECTION, __doc__.split("\n\n", 1)[1].strip(), label, body)
        print(f"wrote '{SECTION}'")


if __name__ == "__main__":
    main()
