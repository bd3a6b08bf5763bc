"""LoRA fine-tuning tokens/s and peak memory: lmforge's Trainer vs PEFT + a plain transformers loop,
in one run.

One random Pythia-shaped GPTNeoXForCausalLM (--shape) is saved once; both sides start from it with
rank-16 adapters (alpha 32, no dropout) on every linear layer of the blocks (PEFT: query_key_value,
dense, dense_h_to_4h, dense_4h_to_h; lmforge: lora.targets=all-linear), the base frozen, AdamW on
the adapters, gradient clipping at 1, fp32 (--precision bf16: the base in bf16, fp32 adapters, bf16
autocast on both sides), the same batch of random tokens (loss on every position). PEFT side:
`get_peft_model`, then `model(input_ids, labels=input_ids).loss`, backward, clip, step. lmforge
side: `lmforge finetune`'s own `Trainer.train_step` with `model.init_from` the same folder and a
`lora:` section. Both adapters start with B = 0, so the first-step losses must agree before anything
is timed.

Each side runs in its own process (peak memory is the process's peak RSS, what the OS sees: weights,
adapters, activations, optimizer state, the libraries), and the sides take turns, the order rotating
from round to round, each process one warm-up step (with --compile, the compilation) and then timed
steps; step time is the median over all rounds.

On CUDA (--device cuda) the model and the batch are on the GPU, each step is timed between two
device synchronizations, and peak memory is torch.cuda.max_memory_allocated over the process's whole
life (loading and the warm-up step included; the CUDA context and the allocator's cache not
counted). The CUDA defaults, pythia-410m at batch 8 x 1024: 8,192 tokens a step, so each GEMM has
8,192 rows, enough to keep a GPU's tensor cores busy at width 1,024 and to make the step the GPU's
work rather than the launches' (a CPU-sized batch of 4 x 256 would time Python); 1,024 tokens is a
usual fine-tuning length; the activations stay far inside an H200's memory. fp32 there is full fp32
on both sides (lmforge's trainer.tf32=false: PEFT's loop multiplies in fp32, torch's default).
--qlora adds lmforge with QLoRA's NF4 base (lora.base_dtype=nf4, through torchao; a CUDA GPU or the
CPU), set against the same PEFT row: PEFT's own QLoRA needs bitsandbytes. `--help` lists the
options.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from report import BENCHMARKS_MD, accelerator_description, write_block  # benchmarks/report.py

SECTION = "## LoRA fine-tuning: lmforge vs PEFT + transformers"
SHAPES = {
    "pythia-410m": dict(
        vocab_size=50304,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        rotary_pct=0.25,
        max_position_embeddings=2048,
    ),
    "pythia-160m": dict(
        vocab_size=50304,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        rotary_pct=0.25,
        max_position_embeddings=2048,
    ),
    "quick": dict(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        rotary_pct=0.25,
        max_position_embeddings=256,
    ),
}
DEFAULTS = {
    "cpu": dict(shape="pythia-410m", batch=4, seq=256, steps=3, rounds=2),
    # the module docstring says why
    "cuda": dict(shape="pythia-410m", batch=8, seq=1024, steps=10, rounds=2),
}
RANK, ALPHA, LR = 16, 32, 2e-4
PEFT_TARGETS = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
PRECISIONS = {"fp32": "fp32", "bf16": "the base in bf16, fp32 adapters, bf16 autocast"}
CPU_NOTE = " (CPU time of the step: at one thread the work, less the waits for the shared cores)"
GPU_NOTE = (
    " Each step timed with perf_counter between two device synchronizations. Peak GPU memory (allocated): "
    "torch.cuda.max_memory_allocated over each side's process, loading and the warm-up step included (not "
    "the CUDA context or the allocator's cache)."
)
SIDES = {
    "peft": "PEFT {peft} + transformers loop",
    "lmforge": "lmforge finetune",
    "lmforge-compile": "lmforge finetune, trainer.compile=true",
    "lmforge-qlora": "lmforge finetune, QLoRA (lora.base_dtype=nf4)",
}
QLORA = "lmforge-qlora"


@dataclass(frozen=True)
class DeviceChoices:
    """What the device decides for a run, in one place: a function of the device's type alone, so
    the CUDA choices are tested on a machine without CUDA."""

    # the `### ` block of the section this run rewrites (benchmarks/report.py's write_block)
    label: str
    memory: str  # what the memory column holds
    overrides: tuple[str, ...]  # the lmforge side's device settings
    digits: int  # decimals of step seconds: a GPU step takes tens of milliseconds
    cpu_clock: bool  # whether CPU time is recorded too (it measures nothing of a GPU's work)


def device_choices(device: torch.device, precision: str) -> DeviceChoices:
    if device.type == "cpu":
        # cost.peak_flops given: the Trainer would otherwise measure the CPU's peak at start-up,
        # seconds per process.
        return DeviceChoices(
            f"CPU, {precision}",
            "peak RSS",
            (f"trainer.device={device}", "cost.peak_flops=1e12"),
            2,
            True,
        )
    # No cost.peak_flops: the GPU's datasheet peak is used. fp32 with TF32 off: PEFT's loop
    # multiplies in full fp32 (torch's default), and fp32's first-loss tolerance holds only between
    # the same arithmetic.
    return DeviceChoices(
        f"{device.type.upper()}, {precision}",
        "peak GPU memory (allocated)",
        (f"trainer.device={device}", *(["trainer.tf32=false"] if precision == "fp32" else [])),
        4,
        False,
    )


def resolve(name: str) -> torch.device:
    """--device as the torch.device each process computes on ('cuda' is cuda:0); one line where
    it cannot be."""
    from lmforge.devices import resolve_device
    from lmforge.errors import UserError

    try:
        device = resolve_device(name)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"error: --device={name}: this benchmark runs on the CPU or a CUDA GPU")
    return device


def batch_ids(args, vocab: int) -> torch.Tensor:
    return torch.randint(
        0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)
    ).to(args.device)


def peft_step(args, folder: Path, vocab: int):
    """bf16: the base loaded in bf16, the adapters in fp32 (get_peft_model's
    autocast_adapter_dtype), the step under bf16 autocast: the usual PEFT recipe on one GPU."""
    import peft
    import transformers as tf

    bf16, device = args.precision == "bf16", args.device
    model = tf.GPTNeoXForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16 if bf16 else torch.float32
    ).to(device)
    model = peft.get_peft_model(
        model,
        peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=PEFT_TARGETS),
    ).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    # fused on a GPU, as a user there would pick it (and as lmforge's AdamW is); torch's default on
    # the CPU.
    opt = torch.optim.AdamW(
        trainable, lr=LR, weight_decay=0.0, fused=True if device.type == "cuda" else None
    )
    ids = batch_ids(args, vocab)

    def step() -> float:
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def lmforge_overrides(
    args, folder: Path, tmp: Path, compile: bool = False, qlora: bool = False
) -> list[str]:
    """The lmforge side's run config, as `lmforge finetune` overrides."""
    bf16 = args.precision == "bf16"
    base = ["lora.base_dtype=nf4"] if qlora else ["lora.base_dtype=bf16"] if bf16 else []
    return [
        f"model.init_from={folder}",
        f"data.paths=[{tmp / 'corpus'}]",
        f"data.seq_length={args.seq}",
        f"trainer.global_batch_size={args.batch}",
        f"trainer.micro_batch_size={args.batch}",
        "trainer.precision=fp32",
        "trainer.val_check_interval=0",
        "trainer.max_steps=2",
        "trainer.progress_bar=false",
        *device_choices(args.device, args.precision).overrides,
        "trainer.grad_clip=1.0",
        f"optim.lr={LR}",
        "optim.weight_decay=0.0",
        f"lora.rank={RANK}",
        f"lora.alpha={ALPHA}",
        "lora.targets=all-linear",
        f"run_dir={tmp / 'run'}",
        f"trainer.compile={str(compile).lower()}",
        *(["trainer.precision=bf16-mixed"] if bf16 else []),
        *base,
    ]


def lmforge_step(
    args, folder: Path, vocab: int, tmp: Path, compile: bool = False, qlora: bool = False
):
    import numpy as np

    from lmforge.data.indexed import IndexedDatasetWriter
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    rng = np.random.default_rng(0)
    # the Trainer needs data to set up
    with IndexedDatasetWriter(tmp / "corpus", np.uint16) as writer:
        # each ends in the stand-in tokenizer's end of document, as preprocess writes them
        for _ in range(8):
            writer.add_document(np.append(rng.integers(1, vocab, args.seq * args.batch - 1), 0))
    cfg = load_run_config(None, lmforge_overrides(args, folder, tmp, compile, qlora))
    trainer = Trainer(cfg)
    ids = batch_ids(args, vocab)
    # transformers scores positions 0..seq-2 (labels shifted inside); lmforge gets the same targets.
    # The batch is on the device already, as benchmarks/train.py hands it over: neither side's step
    # then includes the host copy.
    labels = torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100, device=ids.device)], 1)
    batches = itertools.repeat({"tokens": ids, "labels": labels})
    return lambda: trainer.train_step(batches)["loss"]


def child(args) -> None:
    """One side in this process: a warm-up step, then --steps timed ones; JSON on stdout."""
    from lmforge.devices import max_memory_allocated, reset_peak_memory_stats, synchronize

    folder, device = Path(args.folder), args.device
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    if args.threads:
        torch.set_num_threads(args.threads)
    # the process's whole life counts: loading and the warm-up step too
    reset_peak_memory_stats(device)
    cpu_clock = device_choices(device, args.precision).cpu_clock
    with tempfile.TemporaryDirectory() as tmp:
        step = (
            peft_step(args, folder, vocab)
            if args.side == "peft"
            else lmforge_step(
                args,
                folder,
                vocab,
                Path(tmp),
                compile=args.side == "lmforge-compile",
                qlora=args.side == QLORA,
            )
        )
        first = step()
        times, cpu = [], []
        for _ in range(args.steps):
            synchronize(device)  # no-ops on the CPU
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            synchronize(device)
            times.append(time.perf_counter() - t0)
            if cpu_clock:
                cpu.append(time.process_time() - c0)
    # kB on Linux
    peak = (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if device.type == "cpu"
        else max_memory_allocated(device)
    )
    print(json.dumps({"first_loss": first, "times": times, "cpu": cpu, "peak": peak}))


def save_stand_in_tokenizer(folder: Path, vocab: int) -> None:
    """A tokenizer.json of `vocab` made-up words, id 0 the end of document: model.init_from reads
    the folder's tokenizer, and lmforge refuses data holding ids past it; the steps use token ids
    only."""
    from tokenizers import Tokenizer, models

    words = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, vocab)}}
    Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>")).save(
        str(folder / "tokenizer.json")
    )


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child_command(args, side: str, folder: Path) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--child",
        side,
        "--folder",
        str(folder),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
        "--precision",
        args.precision,
        "--device",
        str(args.device),
    ]


def run_side(args, side: str, folder: Path) -> dict:
    out = subprocess.run(
        child_command(args, side, folder), capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(f"the {side} side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_first_losses(first: dict[str, float], precision: str) -> None:
    """Every side's first-step loss against PEFT's, before anything is timed."""
    ref = first["peft"]
    for side, loss in first.items():
        # NF4 rounds the blocks' linear weights to 4 bits, so QLoRA trains another model than
        # PEFT's: its first loss agrees only to within the quantization's error. 5% still refuses a
        # side that diverged or is off the scale; the LoRA sides share PEFT's exact weights and are
        # held to the arithmetic's tolerance.
        rtol = 0.05 if side == QLORA else 1e-4 if precision == "fp32" else 2e-2
        if not abs(loss - ref) <= rtol * abs(ref):  # `not <=`: a NaN loss is refused too
            raise SystemExit(
                f"first-step losses differ (PEFT {ref:.6f}, {side} {loss:.6f}): not benchmarking"
            )


def table(rows: dict, choices: DeviceChoices, clock: str, peft_version: str) -> list[str]:
    """The markdown table: rows[side] = (step seconds, tokens/s, peak bytes, wall seconds),
    PEFT's first."""
    ref, d = rows["peft"], choices.digits
    lines = [
        f"| side | step s ({'CPU' if clock == 'cpu' else 'wall'}) | tokens/s | wall s | {choices.memory} | "
        "tokens/s vs PEFT | peak memory vs PEFT |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for side, (s, tps, peak, wall) in rows.items():
        lines.append(
            f"| {SIDES[side].format(peft=peft_version)} | {s:.{d}f} | {tps:,.0f} | {wall:.{d}f} | "
            f"{peak / 2**30:.2f} GiB | {'1.00' if side == 'peft' else f'**{tps / ref[1]:.2f}x**'} | "
            f"{'1.00' if side == 'peft' else f'**{peak / ref[2]:.2f}x**'} |"
        )
    return lines


def report(args, runs: dict[str, list[dict]], elapsed: float, loads: tuple[float, float]) -> str:
    """The BENCHMARKS.md block: what ran where, the table, the goal; `runs[side]`: its processes'
    JSON lines."""
    import peft
    import transformers as tf

    choices, on_cpu = device_choices(args.device, args.precision), args.device.type == "cpu"
    tokens = args.batch * args.seq
    # one thread: what other jobs move least
    clock = "cpu" if args.threads == 1 and choices.cpu_clock else "times"
    rows = {}
    for side, results in runs.items():
        seconds = statistics.median(t for r in results for t in r[clock])
        wall = statistics.median(t for r in results for t in r["times"])
        rows[side] = (seconds, tokens / seconds, max(r["peak"] for r in results), wall)
    ref, lines = rows["peft"], table(rows, choices, clock, peft.__version__)
    goals = []
    # QLoRA trades speed for memory: not the goal's recipe
    for side in [s for s in rows if s not in ("peft", QLORA)]:
        speed, memory = rows[side][1] / ref[1], rows[side][2] / ref[2]
        met = "met" if speed >= 1.2 and memory <= 1 else "not met"
        goals.append(
            f"{SIDES[side]}: {met} — {speed:.2f}x the tokens/s at {memory:.2f}x the peak memory"
        )
    goal = f"Goal (>= 1.2x PEFT's tokens/s at no more peak memory): {'; '.join(goals)}."
    if QLORA in rows:
        bnb = (
            "is not installed here"
            if importlib.util.find_spec("bitsandbytes") is None
            else "is not run here"
        )
        goal += (
            f"\n\nThe QLoRA row (the blocks' linear weights in torchao's 4-bit NF4, the rest of the base in bf16) "
            f"is set against the PEFT row above, whose base is in {args.precision}: PEFT's own QLoRA "
            f"(bitsandbytes' 4-bit base) {bnb}. Its first-step loss is held within 5% of PEFT's (NF4 changes "
            "the weights), and it is not part of the goal."
        )
    if on_cpu:
        from train import machine  # benchmarks/train.py

        where = f"CPU: {machine()[0]}"
        threads = f", torch threads per process: {args.threads or torch.get_num_threads()}"
    else:  # the parent touches the GPU only now, after every side's process has ended
        where, threads = f"GPU: {accelerator_description(args.device)}", ""
    command = " ".join(["python", "benchmarks/lora.py", *sys.argv[1:]])
    return (
        f"Command: `{command}`. {where}; torch {torch.__version__}, transformers {tf.__version__}, "
        f"peft {peft.__version__}, {datetime.date.today()}. {args.shape} shape, LoRA rank {RANK} alpha {ALPHA} on "
        f"every block linear, {PRECISIONS[args.precision]}, batch {args.batch} x {args.seq} tokens{threads}. "
        f"Median of {args.rounds} x {args.steps} steps per "
        f"side{CPU_NOTE if clock == 'cpu' else ''}; {elapsed:.0f} s in all, load average {loads[0]:.1f} at "
        f"the start and {loads[1]:.1f} at the end{' (a shared machine)' if on_cpu else ''}."
        f"{'' if on_cpu else GPU_NOTE}\n\n" + "\n".join(lines) + f"\n\n{goal}\n"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--device", default="cpu", help="cpu (default), cuda, cuda:1, ...: where each side trains"
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: pythia-410m")
    p.add_argument("--batch", type=int, default=None, help="default: 4 on the CPU, 8 on CUDA")
    p.add_argument("--seq", type=int, default=None, help="default: 256 on the CPU, 1024 on CUDA")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per process (default: 3 on the CPU, 10 on CUDA)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of one process per side, the order rotating (default 2)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per process (0: torch's default); at 1, CPU time measures the work and "
        "not the other jobs on a shared machine",
    )
    p.add_argument(
        "--compile", action="store_true", help="add a side: lmforge with trainer.compile=true"
    )
    p.add_argument(
        "--qlora",
        action="store_true",
        help="add a side: lmforge with QLoRA's NF4 base "
        "(lora.base_dtype=nf4; needs torchao), against the same PEFT row",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: the frozen base in bf16, fp32 adapters, bf16 autocast (PEFT: the base loaded in bf16; "
        "lmforge: trainer.precision=bf16-mixed, lora.base_dtype=bf16)",
    )
    p.add_argument("--quick", action="store_true", help="a tiny model: checks that the script runs")
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    p.add_argument("--child", choices=list(SIDES), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.device = resolve(args.device)
    if args.child:
        args.side = args.child
        return child(args)
    for key, value in DEFAULTS[args.device.type].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        if args.write:
            p.error("--quick numbers are not benchmark numbers: run without --quick to --write")
        args.shape, args.batch, args.seq, args.steps, args.rounds = "quick", 2, 32, 1, 1
    # lmforge's own refusal (torchao missing, a device NF4 does not run on), before any side
    # runs
    if args.qlora:
        from lmforge.errors import UserError
        from lmforge.models.lora import LoRAConfig
        from lmforge.parallel.mesh import ParallelConfig
        from lmforge.train.lora import check_qlora

        try:
            check_qlora(LoRAConfig(base_dtype="nf4"), args.device, ParallelConfig().resolved(1))
        except UserError as e:
            raise SystemExit(f"error: --qlora: {e}") from None
    import transformers as tf

    choices = device_choices(args.device, args.precision)
    load_start, t0 = os.getloadavg()[0], time.perf_counter()
    sides = [
        s for s in SIDES if (args.compile or s != "lmforge-compile") and (args.qlora or s != QLORA)
    ]
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        torch.manual_seed(0)
        tf.GPTNeoXForCausalLM(
            tf.GPTNeoXConfig(**SHAPES[args.shape], bos_token_id=0, eos_token_id=0)
        ).save_pretrained(folder)
        save_stand_in_tokenizer(folder, SHAPES[args.shape]["vocab_size"])
        for r in range(args.rounds):
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                runs[side].append(run_side(args, side, folder))
                last, d = runs[side][-1], choices.digits
                cpu = (
                    f" (CPU {', '.join(f'{t:.{d}f}' for t in last['cpu'])} s)"
                    if last["cpu"]
                    else ""
                )
                log(
                    f"round {r + 1}: {side} first loss {last['first_loss']:.5f}, steps "
                    f"{', '.join(f'{t:.{d}f}' for t in last['times'])} s{cpu}, {choices.memory} "
                    f"{last['peak'] / 2**30:.2f} GiB (load {os.getloadavg()[0]:.1f})"
                )
    check_first_losses({side: runs[side][0]["first_loss"] for side in runs}, args.precision)
    body = report(args, runs, time.perf_counter() - t0, (load_start, os.getloadavg()[0]))
    print(body)
    if args.write:
        write_block(SECTION, __doc__.split("\n\n", 1)[1].strip(), choices.label, body)
        print(f"wrote '{SECTION}' to {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
