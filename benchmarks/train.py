"""Training tokens/s and MFU: lmforge's Trainer vs a plain transformers loop, side by side, in one
run.

One random Pythia-shaped GPTNeoXForCausalLM (--shape: Pythia-70m by default, Pythia-1B for the GPU
goals) is built in transformers and imported into lmforge (lmforge.models.hf.import_hf), so both
sides start from the same weights; both train on the same batch. transformers: `model(input_ids,
labels=input_ids).loss`, backward, gradient clipping, torch.optim.AdamW (fused on an accelerator),
SDPA attention, bf16 autocast over fp32 master weights, and on an accelerator the same loop with the
model under torch.compile. lmforge: the Trainer's own `train_step` (what `lmforge pretrain` runs),
eager and with trainer.compile, in fp32, bf16-mixed (the same recipe as the transformers bf16 side),
bf16-sr, and on a GPU with FP8 tensor cores bf16-mixed with trainer.float8 (torchao). Before timing,
the first-step losses must agree. On a CPU the sides of a precision take turns within each repeat
(order rotated) and the GEMM peaks are measured again each repeat, MFU against the best peak seen;
on an accelerator one side is built, timed and freed after another (see train_sides.py), MFU is
against the device's datasheet peak (the measured 8192^3 GEMM peak beside it), and each side's peak
memory is reported. Step times are medians. A profile of one step per side says where the time goes:
on a CPU the ops' self time (transformers, lmforge, lmforge before its speed work), on an
accelerator the device's kernels (the goals' compiled sides: each kernel under the op that launched
it, and how long the device sat idle within the step). `--help` lists the options.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from report import BENCHMARKS_MD, accelerator_description, write_block  # benchmarks/report.py
from train_sides import (
    BETAS,
    LR,
    WEIGHT_DECAY,
    Side,
    device_peak,
    float8_ready,
    hf_model,
    hf_shape,
    hf_side,
    lmforge_side,
    lmforge_trainer,
    log,
    run_interleaved,
    run_sequential,
    write_corpus,
)

from lmforge.devices import resolve_device
from lmforge.errors import UserError
from lmforge.models import load_pretrained, preset
from lmforge.models.hf import import_hf
from lmforge.train.metrics import FP8, bounded_cpu_peak, datasheet_peak, flops_per_token
from lmforge.train.optim import param_groups
from lmforge.train.profile import (
    device_profile_table,
    profile_device_step,
    profile_step,
    profile_table,
)
from lmforge.train.trainer import Trainer

SECTION = "## Training step: lmforge vs transformers"
# Sides by key (--sides): (label, lmforge precision or None for transformers, compiled, float8
# recipe or None).
SIDES = {
    "hf": ("transformers", None, False, None),
    "hf-compile": ("transformers + torch.compile", None, True, None),
    "fp32": ("lmforge fp32", "fp32", False, None),
    "fp32-compile": ("lmforge fp32 + compile", "fp32", True, None),
    "bf16-mixed": ("lmforge bf16-mixed", "bf16-mixed", False, None),
    "bf16-mixed-compile": ("lmforge bf16-mixed + compile", "bf16-mixed", True, None),
    "bf16-sr": ("lmforge bf16-sr", "bf16-sr", False, None),
    "bf16-sr-compile": ("lmforge bf16-sr + compile", "bf16-sr", True, None),
    "fp8": ("lmforge bf16-mixed + float8 tensorwise + compile", "bf16-mixed", True, "tensorwise"),
    "fp8-rowwise": ("lmforge bf16-mixed + float8 rowwise + compile", "bf16-mixed", True, "rowwise"),
}
# the goals' sides (accelerator)
KERNEL_PROFILE = ["hf-compile", "bf16-mixed-compile", "bf16-sr-compile", "fp8"]
DEFAULT_SIDES = {  # (on an accelerator, precision) -> keys; the first is the reference of the group
    (False, "fp32"): ["hf", "fp32", "fp32-compile"],
    (False, "bf16"): ["hf", "bf16-mixed", "bf16-mixed-compile", "bf16-sr"],
    (True, "fp32"): ["hf", "fp32", "fp32-compile"],
    (True, "bf16"): [
        "hf",
        "hf-compile",
        "bf16-mixed",
        "bf16-mixed-compile",
        "bf16-sr-compile",
        "fp8",
    ],
}


def machine() -> tuple[str, bool]:
    """(CPU description, whether it has bf16 matrix instructions)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
    flags = set(flags.group(1).split()) if flags else set()
    bf16 = sorted(flags & {"avx512_bf16", "amx_bf16", "avx_ne_convert"})
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    desc = f"{name.group(1) if name else 'unknown CPU'} ({isa}, {'/'.join(bf16) or 'no bf16 instructions'})"
    return f"{desc}, {torch.get_num_threads()} threads", bool(bf16)


def side_keys(args, precision: str) -> list[str]:
    """The sides of one precision group, a transformers side first (the reference): --sides (or
    the device's defaults) less those of the other precision and the Float8 sides this machine
    cannot run."""
    keys = (
        DEFAULT_SIDES[(args.device.type != "cpu", precision)]
        if args.sides is None
        else list(args.sides)
    )
    if SIDES[keys[0]][1] is not None:
        keys = ["hf", *keys]
    keys = [
        k
        for k in dict.fromkeys(keys)
        if SIDES[k][1] is None or (SIDES[k][1] == "fp32") == (precision == "fp32")
    ]
    unable = float8_ready(args.device)
    for k in [k for k in keys if SIDES[k][3]] if unable else []:
        log(f"  {k} left out: {unable}")
    return [k for k in keys if not (SIDES[k][3] and unable)]


def build_side(
    key: str, args, tmp: Path, hf_dir: Path, ids, batch, weights, autocast: bool
) -> Side:
    label, precision, compile_, float8 = SIDES[key]
    dtype = torch.bfloat16 if autocast else torch.float32
    if precision is None:
        side = hf_side(
            label.replace(
                "transformers", "transformers (bf16 autocast)" if autocast else "transformers"
            ),
            hf_dir,
            ids,
            autocast,
            compile_,
        )
    else:
        trainer = lmforge_trainer(args, tmp, precision, compile_, weights, float8)
        side = lmforge_side(label, trainer, batch, dtype, float8=float8 is not None)
    side.rtol = 1e-4 if not autocast else 5e-2 if float8 else 2e-2
    return side


def measure(args, tmp: Path, bf16_ok: bool) -> tuple[list[list[Side]], dict, dict]:
    shape = hf_shape(args.preset)
    hf_dir, lm_dir, device = tmp / "hf", tmp / "lmforge", args.device
    hf_model(hf_dir, shape)
    import_hf(hf_dir, lm_dir)
    weights = load_pretrained(lm_dir).state_dict()
    write_corpus(tmp / "corpus", shape["vocab_size"], 4 * args.batch * args.seq)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=gen)
    # transformers scores positions 0..seq-2 (labels shifted inside); lmforge gets the same targets.
    batch = {"tokens": ids, "labels": torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100)], 1)}
    ids, batch = ids.to(device), {k: v.to(device) for k, v in batch.items()}
    peaks = {torch.float32: device_peak(torch.float32, device)}
    groups, profiles, kernels = [], {}, {}
    wanted = {SIDES[k][0] for k in args.kernel_profile}

    def kernel_profile(side: Side) -> None:
        if side.name.replace(" (bf16 autocast)", "") not in wanted:
            return
        log(f"  profiling the kernels of one {side.name} step")
        try:
            kernels[side.name] = profile_device_step(side.step, device)
        except Exception as e:  # a diagnostic: its failure must not cost the run its timings
            log(f"  kernel profile of {side.name} failed: {type(e).__name__}: {e}")

    for precision in args.precisions:
        if precision == "bf16" and not bf16_ok:
            peaks[torch.bfloat16] = bounded_cpu_peak(torch.bfloat16, max_n=256)[0]
            log(
                f"bf16 skipped: this CPU has no bf16 matrix instructions, its bf16 GEMMs run a reference loop at "
                f"{peaks[torch.bfloat16] / 1e9:.1f} GFLOP/s; --force-bf16 runs it anyway"
            )
            continue
        log(f"{precision}:")
        autocast = precision == "bf16"
        dtype = torch.bfloat16 if autocast else torch.float32
        if dtype not in peaks:
            peaks[dtype] = device_peak(dtype, device)
        keys = [k for k in side_keys(args, precision) if not (SIDES[k][2] and args.no_compile)]
        if len(keys) < 2:
            log(f"  no lmforge side of {precision} to compare: left out")
            continue
        builders = [
            functools.partial(build_side, k, args, tmp, hf_dir, ids, batch, weights, autocast)
            for k in keys
        ]
        if device.type == "cpu" and not args.one_at_a_time:
            sides = [b() for b in builders]
            run_interleaved(sides, args.repeats, peaks, device=device)
        else:
            sides = run_sequential(
                builders, args.repeats, device, kernel_profile if wanted else None
            )
        groups.append(sides)
        if precision in args.profile and device.type == "cpu":
            eager = next(
                (s for s in sides if s.trainer is not None and "compile" not in s.name), None
            )
            if eager is not None:
                profiles[precision] = profile_group(sides[0], eager.trainer, batch)
    return groups, peaks, profiles, kernels


def mfu_peak(dtype, peaks: dict, device: torch.device) -> tuple[float, str]:
    """The peak a side's MFU counts against: the datasheet's on an accelerator that has one, else
    the measured."""
    found = datasheet_peak(device, dtype)
    return found if found else (peaks[dtype], "measured")


def table(
    groups: list[list[Side]], tokens: int, flops: float, peaks: dict, device: torch.device
) -> str:
    memory = device.type != "cpu"
    fp8 = any(s.float8 for sides in groups for s in sides) and datasheet_peak(device, FP8)
    lines = [
        "| precision | side | step s | tokens/s | MFU | vs transformers (same precision) |"
        + (" MFU vs FP8 peak |" if fp8 else "")
        + (" peak GiB |" if memory else ""),
        "| --- | --- | ---: | ---: | ---: | ---: |"
        + (" ---: |" if fp8 else "")
        + (" ---: |" if memory else ""),
    ]
    for sides in groups:
        ref = sides[0]
        for s in sides:
            tps = tokens / s.seconds
            mfu = tps * flops / mfu_peak(s.dtype, peaks, device)[0]
            ratio = "1.00" if s is ref else f"**{ref.seconds / s.seconds:.2f}x**"
            # accelerator steps: milliseconds
            step = f"{s.seconds:.2f}" if not memory else f"{s.seconds:.4f}"
            row = (
                f"| {'fp32' if s.dtype == torch.float32 else 'bf16'} | {s.name} | {step} | {tps:,.0f} | "
                f"{100 * mfu:.0f}% | {ratio} |"
            )
            if fp8:
                row += f" {100 * tps * flops / fp8[0]:.0f}% |" if s.float8 else " |"
            lines.append(row + (f" {s.peak_bytes / 2**30:.2f} |" if memory else ""))
    return "\n".join(lines)


def goals(
    groups: list[list[Side]],
    tokens: int,
    flops: float,
    peaks: dict,
    device: torch.device,
    shape: str,
) -> str:
    if device.type != "cpu":
        return accelerator_goals(groups, tokens, flops, peaks, device, shape)
    out = []
    for sides in groups:
        hf, best = sides[0], min(sides[1:], key=lambda s: s.seconds)
        ratio, mfu = hf.seconds / best.seconds, tokens / best.seconds * flops / peaks[best.dtype]
        if best.dtype == torch.bfloat16:
            met = ratio >= 2 or mfu >= 0.55
            out.append(
                f"- bf16 goal (>= 2x transformers' tokens/s, or >= 55% MFU): {'met' if met else 'not met'} "
                f"— best lmforge side `{best.name}` at {ratio:.2f}x, {100 * mfu:.0f}% MFU."
            )
        else:
            out.append(
                f"- fp32 goal (at least transformers' speed): {'met' if ratio >= 1 else 'not met'} — best "
                f"lmforge side `{best.name}` at {ratio:.2f}x, {100 * mfu:.0f}% MFU."
            )
    return "\n".join(out)


def accelerator_goals(groups, tokens, flops, peaks, device, shape: str) -> str:
    """Issue 14's GPU goals, each said met / not met / not measured in this run."""
    sides = {s.name: s for group in groups for s in group if s.dtype == torch.bfloat16}
    hf = [s for n, s in sides.items() if n.startswith("transformers")]
    mixed = sides.get(SIDES["bf16-mixed-compile"][0])
    sr = sides.get(SIDES["bf16-sr-compile"][0])
    fp8 = sides.get(SIDES["fp8"][0]) or sides.get(SIDES["fp8-rowwise"][0])
    out = []
    if mixed and hf:
        best_hf = min(hf, key=lambda s: s.seconds)
        mfu = tokens / mixed.seconds * flops / mfu_peak(torch.bfloat16, peaks, device)[0]
        ratio = best_hf.seconds / mixed.seconds
        out.append(
            f"- bf16-mixed compiled >= 50% MFU and >= 1.3x transformers: "
            f"{'met' if mfu >= 0.5 and ratio >= 1.3 else 'not met'} — {100 * mfu:.0f}% MFU, {ratio:.2f}x "
            f"the faster transformers side (`{best_hf.name}`), {shape}."
        )
    if mixed and sr:
        slower = sr.seconds / mixed.seconds - 1
        out.append(
            f"- bf16-sr within 5% of bf16-mixed (both compiled): {'met' if slower <= 0.05 else 'not met'} — "
            f"bf16-sr's step {100 * slower:+.1f}%."
        )
    if mixed and fp8:
        ratio = mixed.seconds / fp8.seconds
        # Pythia-1.4B or larger
        big = preset(shape).num_layers * preset(shape).hidden_size ** 2 >= 24 * 2048**2
        verdict = (
            ("met" if ratio >= 1.2 else "not met")
            if big
            else "not judged (the goal is at Pythia-1.4B or larger)"
        )
        out.append(
            f"- Float8 >= 1.2x bf16-mixed (both compiled) on Pythia-1.4B or larger: {verdict} — {ratio:.2f}x "
            f"at {shape}."
        )
    return "\n".join(out) or "- no goal's sides were in this run."


def profile_group(hf: Side, trainer: Trainer, batch: dict) -> dict[str, dict[str, float]]:
    """One profiled step each: transformers, lmforge now, and lmforge as it was before the speed
    work (logits + F.cross_entropy, torch AdamW with foreach=True) on the same trainer."""
    log("  profiling one step per side")
    batches = itertools.repeat(batch)
    out = {
        "transformers": profile_step(hf.step),
        "lmforge": profile_step(lambda: trainer.train_step(batches)),
    }
    fused_optimizer = trainer.optimizer
    if isinstance(fused_optimizer, torch.optim.AdamW):
        groups = param_groups(trainer.model, WEIGHT_DECAY)
        trainer.optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, foreach=True)
    trainer.training.fused_loss = False
    trainer.train_step(batches)  # the new optimizer's state is created outside the profile
    out["lmforge before"] = profile_step(lambda: trainer.train_step(batches))
    trainer.training.fused_loss, trainer.optimizer = True, fused_optimizer
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shape",
        default=None,
        help="a GPT-NeoX preset: pythia-70m (default on a CPU), pythia-1b "
        "(default on an accelerator), pythia-1.4b (the Float8 goal's), ...",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences per step (default 8 on a CPU, 4 on an accelerator)",
    )
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help="tokens per sequence (default 512 on a CPU, 2048 on an accelerator)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed steps per side (median; default 3 on a CPU, 10 on an accelerator)",
    )
    p.add_argument(
        "--precisions",
        nargs="+",
        default=None,
        choices=["fp32", "bf16"],
        help="default fp32 bf16 on a CPU, bf16 on an accelerator",
    )
    p.add_argument(
        "--sides",
        type=lambda s: s.split(","),
        default=None,
        help=f"comma-separated, from {', '.join(SIDES)} (default: the device's set; a transformers "
        "side always comes first)",
    )
    p.add_argument(
        "--profile",
        nargs="*",
        default=None,
        choices=["fp32", "bf16"],
        help="precisions to profile on a CPU (default bf16, or fp32 where bf16 is skipped)",
    )
    p.add_argument(
        "--kernel-profile",
        type=lambda s: [] if s == "none" else s.split(","),
        default=None,
        metavar="SIDES",
        help="on an accelerator: the sides whose device kernels one extra step profiles "
        f"(default {','.join(KERNEL_PROFILE)}, those in the run; none: no profile)",
    )
    p.add_argument("--no-compile", action="store_true", help="skip the compiled sides")
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="build, time and free one side after another (what "
        "an accelerator always does; on a CPU the sides otherwise take turns step by step)",
    )
    p.add_argument(
        "--force-bf16", action="store_true", help="run bf16 even on a CPU without bf16 instructions"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when present, else the CPU), cpu, cuda, cuda:1 ...",
    )
    p.add_argument("--quick", action="store_true", help="a tiny model: checks that the script runs")
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    if args.quick and args.write:
        p.error("--quick numbers are not benchmark numbers: run without --quick to --write")
    unknown = [k for k in (args.sides or []) + (args.kernel_profile or []) if k not in SIDES]
    if unknown:
        p.error(
            f"--sides/--kernel-profile: unknown {', '.join(unknown)}; choose from {', '.join(SIDES)}"
        )
    try:
        args.device = resolve_device(args.device)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    on_cpu = args.device.type == "cpu"
    defaults = (
        dict(shape="pythia-70m", batch=8, seq=512, repeats=3, precisions=["fp32", "bf16"])
        if on_cpu
        else dict(shape="pythia-1b", batch=4, seq=2048, repeats=10, precisions=["bf16"])
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.preset = args.shape
    if args.quick:
        args.preset, args.batch, args.seq, args.repeats = "tiny-neox", 2, 64, 1
    if on_cpu:
        desc, bf16_ok = machine()
        bf16_ok = bf16_ok or args.force_bf16
    else:  # bf16 matrix units are what accelerators have: the CPU caveats do not apply
        desc, bf16_ok = accelerator_description(args.device), True
    if args.kernel_profile and on_cpu:
        log(
            "note: --kernel-profile profiles an accelerator's kernels; on a CPU --profile says where the time goes"
        )
    args.kernel_profile = (
        [] if on_cpu else KERNEL_PROFILE if args.kernel_profile is None else args.kernel_profile
    )
    if args.profile is None:
        args.profile = ["bf16"] if on_cpu else []
    elif args.profile and not on_cpu:
        log("note: the profile counts CPU time (kernel launches): no profile on an accelerator")
    if not bf16_ok and "bf16" in args.profile and "fp32" not in args.profile:
        args.profile = ["fp32"]
    load_start = os.getloadavg()[0]
    import transformers

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        groups, peaks, profiles, kernels = measure(args, Path(tmp), bf16_ok)
    tokens, flops = args.batch * args.seq, flops_per_token(preset(args.preset), args.seq)
    # glibc tuning
    malloc = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")]
    command = " ".join([*malloc, "python", "benchmarks/train.py", *sys.argv[1:]])
    unit, scale = ("GFLOP/s", 1e9) if on_cpu else ("TFLOP/s", 1e12)
    peak_text = ", ".join(
        f"{'fp32' if d == torch.float32 else 'bf16'} {v / scale:.3g} {unit}"
        for d, v in peaks.items()
    )
    mfu_text = (
        ""
        if on_cpu
        else " MFU against "
        + "; ".join(
            f"{mfu_peak(d, peaks, args.device)[1]} {mfu_peak(d, peaks, args.device)[0] / 1e12:.1f} TFLOP/s"
            for d in peaks
        )
        + (
            f"; FP8 {datasheet_peak(args.device, FP8)[0] / 1e12:.1f} TFLOP/s (datasheet, dense)"
            if datasheet_peak(args.device, FP8)
            else ""
        )
        + "."
    )
    skipped = (
        ""
        if bf16_ok or "bf16" not in args.precisions
        else (
            " bf16 not run: this CPU has no bf16 matrix instructions (bf16 peak measured with 256^3 GEMMs)."
        )
    )
    order = (
        "Median of {n} interleaved steps per side"
        if on_cpu and not args.one_at_a_time
        else "Median of {n} steps per side, one side built, timed and freed after another"
    )
    body = (
        f"Command: `{command}`. {desc}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{datetime.date.today()}. {args.preset} shape, batch {args.batch} x {args.seq} tokens, "
        f"{flops / 1e6:,.0f} MFLOP per token (6N + attention, lmforge.train.metrics). GEMM peak (best "
        f"{2048 if on_cpu else 8192}^3 in this run): {peak_text}.{mfu_text}{skipped} "
        f"{order.format(n=args.repeats)}; {time.perf_counter() - t0:.0f} s in all, load average "
        f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end.{'' if on_cpu else MEMORY}\n\n"
        f"{table(groups, tokens, flops, peaks, args.device)}\n\n"
        f"{goals(groups, tokens, flops, peaks, args.device, args.preset)}\n"
    )
    for precision, prof in profiles.items():
        body += (
            f"\nWhere one {precision} step's time goes (torch.profiler, self time per op, "
            f"lmforge.train.profile):\n\n{profile_table(prof)}\n"
        )
    if kernels:
        # at seq 0 the matmuls' 6N alone
        gemm_flops = flops_per_token(preset(args.preset), 0) * tokens
        body += (
            "\nWhere one step's device time goes (torch.profiler's kernels, by the op that launched each or "
            "else its name: lmforge.train.profile; one more step per side after its timed ones, the profiler "
            f"warmed up by another):\n\n{device_profile_table(kernels, gemm_flops)}\n"
        )
    print(body)
    if args.write:
        label = f"CPU, {desc}" if on_cpu else f"{args.device.type.upper()}, {desc}, {args.preset}"
        write_block(SECTION, INTRO, label + (f", {' '.join(malloc)}" if malloc else ""), body)
        print(f"wrote '{SECTION}' to {BENCHMARKS_MD}")


MEMORY = (
    " Peak GiB: the most the side held at once above what was allocated before it was built: its weights, "
    "optimizer state and one step's activations (lmforge.devices.max_memory_allocated; the CUDA context and "
    "the allocator's cache not counted)."
)
INTRO = (
    __doc__.split("\n\n", 1)[1].strip() + "\n\n"
    "`lmforge bench train` runs this script. The *before* column of the profile is lmforge's step as it was "
    "before the speed work (full logits + F.cross_entropy, torch AdamW foreach), rebuilt in the same run."
)


if __name__ == "__main__":
    main()
