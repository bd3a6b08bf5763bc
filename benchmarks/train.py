"""Training tokens/s and MFU: lmforge's Trainer vs a plain transformers loop, side by side, in one run.

One random Pythia-70m-shaped GPTNeoXForCausalLM is built in transformers and imported into
lmforge (lmforge.models.hf.import_hf), so both sides start from the same weights; both train on
the same batch. transformers: `model(input_ids, labels=input_ids).loss`, backward, gradient
clipping, torch.optim.AdamW (bf16: autocast over fp32 master weights). lmforge: the Trainer's own
`train_step` (what `lmforge pretrain` runs), eager and with trainer.compile, in fp32, bf16-mixed
(the same recipe as the transformers bf16 side) and bf16-sr. Before timing, the first-step losses
of the two sides must agree. Within each repeat the sides take turns (order rotated), and the fp32
and bf16 GEMM peaks are measured again; step times are medians, MFU uses the best peak seen.
A profile of one step per side says where the time goes. `--device` (default auto: CUDA when present)
puts both sides on the same device; on an accelerator each side's peak memory is reported too and
bf16 is a normal row. `--help` lists the options.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from report import BENCHMARKS_MD, accelerator_description, write_block  # benchmarks/report.py

from lmforge.data.indexed import IndexedDatasetWriter
from lmforge.devices import max_memory_allocated, memory_allocated, reset_peak_memory_stats, resolve_device, synchronize
from lmforge.errors import UserError
from lmforge.models import load_pretrained, preset
from lmforge.models.hf import import_hf
from lmforge.train.config import load_run_config
from lmforge.train.metrics import bounded_cpu_peak, flops_per_token
from lmforge.train.optim import param_groups
from lmforge.train.profile import profile_step, profile_table
from lmforge.train.trainer import Trainer

SECTION = "## Training step: lmforge vs transformers"
PYTHIA_70M = dict(vocab_size=50304, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                  intermediate_size=2048, rotary_pct=0.25, max_position_embeddings=2048)
QUICK = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
             rotary_pct=0.25, max_position_embeddings=256)
LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1


@dataclass
class Side:
    name: str
    dtype: torch.dtype  # whose GEMM peak its MFU is measured against
    step: object  # () -> loss of one training step
    state_bytes: object = None  # () -> bytes of its weights and optimizer state
    first_loss: float = float("nan")
    times: list[float] = field(default_factory=list)
    step_bytes: list[int] = field(default_factory=list)  # the most each timed step allocated above what it found

    @property
    def peak_bytes(self) -> int:
        """Its own state plus the most one of its steps allocated on top (the other sides' state left out)."""
        return self.state_bytes() + max(self.step_bytes)

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)


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


def device_peak(dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of the best large GEMM: 2048^3 on a CPU (bounded_cpu_peak), 8192^3 on an accelerator."""
    if device.type == "cpu":
        return bounded_cpu_peak(dtype, time_limit=float("inf"))[0]
    n = 8192
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    fastest = float("inf")
    for _ in range(4):  # the first one warms the kernels up, and times them too
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        fastest = min(fastest, time.perf_counter() - t0)
    return 2 * n**3 / fastest


def state_bytes(model: torch.nn.Module, optimizer) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    for opt in getattr(optimizer, "optimizers", [optimizer]):  # lmforge's optimizer may wrap several
        tensors += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def hf_model(folder: Path, shape: dict | None = None, device: torch.device | str = "cpu"):
    import transformers as tf

    if shape is not None:  # build once, save; every side then loads these same weights
        torch.manual_seed(0)
        tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**shape, bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    return tf.GPTNeoXForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).train()


def hf_side(name: str, folder: Path, ids: torch.Tensor, autocast: bool) -> Side:
    """The plain loop a transformers user writes (on the device of `ids`)."""
    model = hf_model(folder, device=ids.device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)

    def step() -> float:
        with torch.autocast(ids.device.type, torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return Side(name, torch.bfloat16 if autocast else torch.float32, step, lambda: state_bytes(model, opt))


def lmforge_trainer(args, tmp: Path, precision: str, compile_: bool, weights: dict) -> Trainer:
    cfg = load_run_config(None, [
        f"model.preset={args.preset}", f"data.paths=[{tmp / 'corpus'}]", f"data.seq_length={args.seq}",
        f"trainer.global_batch_size={args.batch}", f"trainer.micro_batch_size={args.batch}",
        f"trainer.precision={precision}", f"trainer.compile={compile_}", "trainer.val_check_interval=0",
        f"trainer.device={args.device}",
        f"trainer.compile_cache_dir={Path(tempfile.gettempdir()) / 'lmforge-bench-train-compile'}",
        "trainer.max_steps=2", "trainer.progress_bar=false", "cost.peak_flops=1e12", "trainer.grad_clip=1.0",
        f"optim.lr={LR}", f"optim.betas=[{BETAS[0]},{BETAS[1]}]", f"optim.weight_decay={WEIGHT_DECAY}",
        f"run_dir={tmp / f'run-{precision}-{compile_}'}",
    ])
    trainer = Trainer(cfg)
    trainer.model.load_state_dict(weights)  # the imported transformers weights (cast to bf16 for bf16-sr)
    return trainer


def lmforge_side(name: str, trainer: Trainer, batch: dict, dtype: torch.dtype) -> Side:
    batches = itertools.repeat(batch)
    return Side(name, dtype, lambda: trainer.train_step(batches)["loss"],
                lambda: state_bytes(trainer.model, trainer.optimizer))


def write_corpus(prefix: Path, vocab: int, tokens: int) -> None:
    """A small random corpus: Trainer needs data to set up; the timed steps reuse one fixed batch."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16 if vocab < 65500 else np.int32) as writer:
        for _ in range(max(4, tokens // 2000)):
            writer.add_document(rng.integers(0, vocab, 2000))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_group(sides: list[Side], repeats: int, peaks: dict, rtol: float, device: torch.device) -> None:
    """Warm up each side once (its first-step loss, compilation), check the losses agree, then time
    one step per side per repeat, taking turns in a rotated order, with the peaks re-measured."""
    for side in sides:
        synchronize(device)
        t0 = time.perf_counter()
        side.first_loss = side.step()
        synchronize(device)
        log(f"  {side.name}: first step {time.perf_counter() - t0:.1f} s, loss {side.first_loss:.5f}")
    ref = sides[0].first_loss
    for side in sides[1:]:
        if abs(side.first_loss - ref) > rtol * abs(ref):
            raise SystemExit(f"first-step loss of {side.name} ({side.first_loss:.6f}) differs from {sides[0].name} "
                             f"({ref:.6f}) by more than {rtol:g} (relative): not benchmarking")
    for r in range(repeats):
        for dtype in peaks:
            peaks[dtype] = max(peaks[dtype], device_peak(dtype, device))
        for side in sides[r % len(sides):] + sides[: r % len(sides)]:
            before = memory_allocated(device)
            reset_peak_memory_stats(device)
            synchronize(device)
            t0 = time.perf_counter()
            side.step()
            synchronize(device)
            side.times.append(time.perf_counter() - t0)
            if before is not None:
                side.step_bytes.append(max_memory_allocated(device) - before)
        log(f"  repeat {r + 1}/{repeats}: " + ", ".join(f"{s.name} {s.times[-1]:.2f} s" for s in sides)
            + f" (load {os.getloadavg()[0]:.1f})")


def table(groups: list[list[Side]], tokens: int, flops: float, peaks: dict) -> str:
    memory = all(s.step_bytes for sides in groups for s in sides)  # where the device counts its memory
    lines = ["| precision | side | step s | tokens/s | MFU | vs transformers (same precision) |"
             + (" peak GiB |" if memory else ""),
             "| --- | --- | ---: | ---: | ---: | ---: |" + (" ---: |" if memory else "")]
    for sides in groups:
        ref = sides[0]
        for s in sides:
            tps = tokens / s.seconds
            mfu = tps * flops / peaks[s.dtype]
            ratio = "1.00" if s is ref else f"**{ref.seconds / s.seconds:.2f}x**"
            step = f"{s.seconds:.2f}" if not memory else f"{s.seconds:.4f}"  # accelerator steps: milliseconds
            lines.append(f"| {'fp32' if s.dtype == torch.float32 else 'bf16'} | {s.name} | {step} | "
                         f"{tps:,.0f} | {100 * mfu:.0f}% | {ratio} |"
                         + (f" {s.peak_bytes / 2**30:.2f} |" if memory else ""))
    return "\n".join(lines)


def goals(groups: list[list[Side]], tokens: int, flops: float, peaks: dict) -> str:
    out = []
    for sides in groups:
        hf, best = sides[0], min(sides[1:], key=lambda s: s.seconds)
        ratio, mfu = hf.seconds / best.seconds, tokens / best.seconds * flops / peaks[best.dtype]
        if best.dtype == torch.bfloat16:
            met = ratio >= 2 or mfu >= 0.55
            out.append(f"- bf16 goal (>= 2x transformers' tokens/s, or >= 55% MFU): {'met' if met else 'not met'} "
                       f"— best lmforge side `{best.name}` at {ratio:.2f}x, {100 * mfu:.0f}% MFU.")
        else:
            out.append(f"- fp32 goal (at least transformers' speed): {'met' if ratio >= 1 else 'not met'} — best "
                       f"lmforge side `{best.name}` at {ratio:.2f}x, {100 * mfu:.0f}% MFU.")
    return "\n".join(out)


def measure(args, tmp: Path, bf16_ok: bool) -> tuple[list[list[Side]], dict, dict]:
    shape = QUICK if args.quick else PYTHIA_70M
    hf_dir, lm_dir, device = tmp / "hf", tmp / "lmforge", args.device
    hf_model(hf_dir, shape)
    import_hf(hf_dir, lm_dir)
    imported = load_pretrained(lm_dir)
    weights = imported.state_dict()
    write_corpus(tmp / "corpus", shape["vocab_size"], 4 * args.batch * args.seq)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=gen)
    # transformers scores positions 0..seq-2 (labels shifted inside); lmforge gets the same targets.
    batch = {"tokens": ids, "labels": torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100)], 1)}
    ids, batch = ids.to(device), {k: v.to(device) for k, v in batch.items()}
    peaks = {torch.float32: device_peak(torch.float32, device)}
    groups, profiles = [], {}
    for precision in args.precisions:
        if precision == "bf16" and not bf16_ok:
            peaks[torch.bfloat16] = bounded_cpu_peak(torch.bfloat16, max_n=256)[0]
            log(f"bf16 skipped: this CPU has no bf16 matrix instructions, its bf16 GEMMs run a reference loop at "
                f"{peaks[torch.bfloat16] / 1e9:.1f} GFLOP/s; --force-bf16 runs it anyway")
            continue
        log(f"{precision}:")
        autocast = precision == "bf16"
        dtype = torch.bfloat16 if autocast else torch.float32
        if dtype not in peaks:
            peaks[dtype] = device_peak(dtype, device)
        sides = [hf_side("transformers" + (" (bf16 autocast)" if autocast else ""), hf_dir, ids, autocast)]
        recipes = [("bf16-mixed", False), ("bf16-mixed", True), ("bf16-sr", False)] if autocast else [
            ("fp32", False), ("fp32", True)]
        eager = None
        for lm_precision, compile_ in recipes:
            if compile_ and args.no_compile:
                continue
            trainer = lmforge_trainer(args, tmp, lm_precision, compile_, weights)
            eager = eager or trainer
            name = f"lmforge {lm_precision}" + (" + compile" if compile_ else "")
            sides.append(lmforge_side(name, trainer, batch, dtype))
        run_group(sides, args.repeats, peaks, rtol=1e-4 if not autocast else 2e-2, device=device)
        groups.append(sides)
        if precision in args.profile:
            profiles[precision] = profile_group(sides[0], eager, batch)
    return groups, peaks, profiles


def profile_group(hf: Side, trainer: Trainer, batch: dict) -> dict[str, dict[str, float]]:
    """One profiled step each: transformers, lmforge now, and lmforge as it was before the speed
    work (logits + F.cross_entropy, torch AdamW with foreach=True) on the same trainer."""
    log("  profiling one step per side")
    batches = itertools.repeat(batch)
    out = {"transformers": profile_step(hf.step), "lmforge": profile_step(lambda: trainer.train_step(batches))}
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
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3, help="timed steps per side (median)")
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--profile", nargs="*", default=None, choices=["fp32", "bf16"],
                   help="precisions to profile (default bf16, or fp32 where bf16 is skipped; none on an "
                        "accelerator: the profile counts CPU time)")
    p.add_argument("--no-compile", action="store_true", help="skip the trainer.compile sides")
    p.add_argument("--force-bf16", action="store_true", help="run bf16 even on a CPU without bf16 instructions")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present, else the CPU), cpu, cuda, cuda:1 ...")
    p.add_argument("--quick", action="store_true", help="a tiny model: checks that the script runs")
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    if args.quick and args.write:
        p.error("--quick numbers are not benchmark numbers: run without --quick to --write")
    try:
        args.device = resolve_device(args.device)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    args.preset = "tiny-neox" if args.quick else "pythia-70m"
    if args.quick:
        args.batch, args.seq, args.repeats = 2, 64, 1
    on_cpu = args.device.type == "cpu"
    if on_cpu:
        desc, bf16_ok = machine()
        bf16_ok = bf16_ok or args.force_bf16
    else:  # bf16 matrix units are what accelerators have: the CPU caveats do not apply
        desc, bf16_ok = accelerator_description(args.device), True
    if args.profile is None:
        args.profile = ["bf16"] if on_cpu else []
    elif args.profile and not on_cpu:
        log("note: the profile counts CPU time (kernel launches), not the device's kernels")
    if not bf16_ok and "bf16" in args.profile and "fp32" not in args.profile:
        args.profile = ["fp32"]
    load_start = os.getloadavg()[0]
    import transformers

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        groups, peaks, profiles = measure(args, Path(tmp), bf16_ok)
    tokens, flops = args.batch * args.seq, flops_per_token(preset(args.preset), args.seq)
    malloc = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")]  # glibc tuning
    command = " ".join([*malloc, "python", "benchmarks/train.py", *sys.argv[1:]])
    unit, scale = ("GFLOP/s", 1e9) if on_cpu else ("TFLOP/s", 1e12)
    peak_text = ", ".join(f"{'fp32' if d == torch.float32 else 'bf16'} {v / scale:.3g} {unit}"
                          for d, v in peaks.items())
    skipped = "" if bf16_ok or "bf16" not in args.precisions else (
        " bf16 not run: this CPU has no bf16 matrix instructions (bf16 peak measured with 256^3 GEMMs).")
    body = (
        f"Command: `{command}`. {desc}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{datetime.date.today()}. {'Pythia-70m shape' if not args.quick else 'tiny-neox (--quick)'}, batch "
        f"{args.batch} x {args.seq} tokens, {flops / 1e6:.0f} MFLOP per token (6N + attention, "
        f"lmforge.train.metrics). GEMM peak (best {2048 if on_cpu else 8192}^3 in this run): {peak_text}.{skipped} "
        f"Median of {args.repeats} interleaved steps per side; {time.perf_counter() - t0:.0f} s in all, load average "
        f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end.{'' if on_cpu else MEMORY}\n\n"
        f"{table(groups, tokens, flops, peaks)}\n\n"
        f"{goals(groups, tokens, flops, peaks)}\n")
    for precision, prof in profiles.items():
        body += (f"\nWhere one {precision} step's time goes (torch.profiler, self time per op, "
                 f"lmforge.train.profile):\n\n{profile_table(prof)}\n")
    print(body)
    if args.write:
        label = f"CPU, {desc}" if on_cpu else f"{args.device.type.upper()}, {desc}"
        write_block(SECTION, INTRO, label + (f", {' '.join(malloc)}" if malloc else ""), body)
        print(f"wrote '{SECTION}' to {BENCHMARKS_MD}")


MEMORY = (" Peak GiB: the side's weights and optimizer state plus the most one of its steps allocated on top "
          "(lmforge.devices.max_memory_allocated; the CUDA context and the allocator's cache not counted).")
INTRO = (__doc__.split("\n\n", 1)[1].strip() + "\n\n"
         "`lmforge bench train` runs this script. The *before* column of the profile is lmforge's step as it was "
         "before the speed work (full logits + F.cross_entropy, torch AdamW foreach), rebuilt in the same run.")


if __name__ == "__main__":
    main()
