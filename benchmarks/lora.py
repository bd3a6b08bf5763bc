"""LoRA fine-tuning tokens/s and peak memory: lmforge's Trainer vs PEFT + a plain transformers loop, in one run.

One random Pythia-shaped GPTNeoXForCausalLM (--shape) is saved once; both sides start from it with rank-16 adapters
(alpha 32, no dropout) on every linear layer of the blocks (PEFT: query_key_value, dense, dense_h_to_4h,
dense_4h_to_h; lmforge: lora.targets=all-linear), the base frozen, AdamW on the adapters, gradient clipping at 1,
fp32 (--precision bf16: the base in bf16, fp32 adapters, bf16 autocast on both sides), the same batch of random
tokens (loss on every position). PEFT side: `get_peft_model`, then
`model(input_ids, labels=input_ids).loss`, backward, clip, step. lmforge side: `lmforge finetune`'s own
`Trainer.train_step` with `model.init_from` the same folder and a `lora:` section. Both adapters start with B = 0,
so the first-step losses must agree before anything is timed.

Each side runs in its own process (peak memory is the process's peak RSS, what the OS sees: weights, adapters,
activations, optimizer state, the libraries), and the sides take turns, the order rotating from round to round,
each process one warm-up step (with --compile, the compilation) and then timed steps; step time is the median
over all rounds.
`--help` lists the options.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from report import BENCHMARKS_MD, write_block  # benchmarks/report.py

SECTION = "## LoRA fine-tuning: lmforge vs PEFT + transformers"
SHAPES = {
    "pythia-410m": dict(vocab_size=50304, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, rotary_pct=0.25, max_position_embeddings=2048),
    "pythia-160m": dict(vocab_size=50304, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                        intermediate_size=3072, rotary_pct=0.25, max_position_embeddings=2048),
    "quick": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                  rotary_pct=0.25, max_position_embeddings=256),
}
RANK, ALPHA, LR = 16, 32, 2e-4
PEFT_TARGETS = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
PRECISIONS = {"fp32": "fp32", "bf16": "the base in bf16, fp32 adapters, bf16 autocast"}
CPU_NOTE = " (CPU time of the step: at one thread the work, less the waits for the shared cores)"
SIDES = {"peft": "PEFT {peft} + transformers loop", "lmforge": "lmforge finetune",
         "lmforge-compile": "lmforge finetune, trainer.compile=true"}


def batch_ids(args, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))


def peft_step(args, folder: Path, vocab: int):
    """bf16: the base loaded in bf16, the adapters in fp32 (get_peft_model's autocast_adapter_dtype), the step under
    bf16 autocast: the usual PEFT recipe on one GPU."""
    import peft
    import transformers as tf

    bf16 = args.precision == "bf16"
    model = tf.GPTNeoXForCausalLM.from_pretrained(folder, dtype=torch.bfloat16 if bf16 else torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                       target_modules=PEFT_TARGETS)).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0)
    ids = batch_ids(args, vocab)

    def step() -> float:
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def lmforge_step(args, folder: Path, vocab: int, tmp: Path, compile: bool = False):
    import numpy as np

    from lmforge.data.indexed import IndexedDatasetWriter
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    with IndexedDatasetWriter(tmp / "corpus", np.uint16) as writer:  # the Trainer needs data to set up
        for _ in range(8):
            writer.add_document(np.random.default_rng(0).integers(0, vocab, args.seq * args.batch))
    cfg = load_run_config(None, [
        f"model.init_from={folder}", f"data.paths=[{tmp / 'corpus'}]", f"data.seq_length={args.seq}",
        f"trainer.global_batch_size={args.batch}", f"trainer.micro_batch_size={args.batch}",
        "trainer.precision=fp32", "trainer.val_check_interval=0", "trainer.max_steps=2", "trainer.progress_bar=false",
        "cost.peak_flops=1e12", "trainer.grad_clip=1.0", f"optim.lr={LR}", "optim.weight_decay=0.0",
        f"lora.rank={RANK}", f"lora.alpha={ALPHA}", "lora.targets=all-linear", f"run_dir={tmp / 'run'}",
        f"trainer.compile={str(compile).lower()}",
        *(["trainer.precision=bf16-mixed", "lora.base_dtype=bf16"] if args.precision == "bf16" else []),
    ])
    trainer = Trainer(cfg)
    ids = batch_ids(args, vocab)
    # transformers scores positions 0..seq-2 (labels shifted inside); lmforge gets the same targets.
    batches = itertools.repeat({"tokens": ids, "labels": torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100)],
                                                                   1)})
    return lambda: trainer.train_step(batches)["loss"]


def child(args) -> None:
    """One side in this process: a warm-up step, then --steps timed ones; JSON on stdout."""
    folder = Path(args.folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        step = (peft_step(args, folder, vocab) if args.side == "peft" else
                lmforge_step(args, folder, vocab, Path(tmp), compile=args.side == "lmforge-compile"))
        first = step()
        times, cpu = [], []
        for _ in range(args.steps):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    print(json.dumps({"first_loss": first, "times": times, "cpu": cpu, "peak_rss": peak}))


def save_stand_in_tokenizer(folder: Path) -> None:
    """A one-token tokenizer.json: model.init_from reads the folder's tokenizer; the steps use token ids only."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<|endoftext|>": 0}, unk_token="<|endoftext|>")).save(str(folder / "tokenizer.json"))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_side(args, side: str, folder: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", side, "--folder", str(folder), "--batch", str(args.batch),
           "--seq", str(args.seq), "--steps", str(args.steps), "--threads", str(args.threads),
           "--precision", args.precision]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"the {side} side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="pythia-410m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=2, help="rounds of one process per side, the order rotating")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per process (0: torch's default); at 1, CPU time measures the work and "
                        "not the other jobs on a shared machine")
    p.add_argument("--compile", action="store_true", help="add a side: lmforge with trainer.compile=true")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: the frozen base in bf16, fp32 adapters, bf16 autocast (PEFT: the base loaded in bf16; "
                        "lmforge: trainer.precision=bf16-mixed, lora.base_dtype=bf16)")
    p.add_argument("--quick", action="store_true", help="a tiny model: checks that the script runs")
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    p.add_argument("--child", choices=list(SIDES), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.side = args.child
        return child(args)
    if args.quick:
        if args.write:
            p.error("--quick numbers are not benchmark numbers: run without --quick to --write")
        args.shape, args.batch, args.seq, args.steps, args.rounds = "quick", 2, 32, 1, 1
    import peft
    import transformers as tf

    load_start, t0 = os.getloadavg()[0], time.perf_counter()
    sides = [s for s in SIDES if args.compile or s != "lmforge-compile"]
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        torch.manual_seed(0)
        tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**SHAPES[args.shape], bos_token_id=0, eos_token_id=0)).save_pretrained(
            folder)
        save_stand_in_tokenizer(folder)
        for r in range(args.rounds):
            for side in sides[r % len(sides):] + sides[: r % len(sides)]:
                runs[side].append(run_side(args, side, folder))
                last = runs[side][-1]
                log(f"round {r + 1}: {side} first loss {last['first_loss']:.5f}, steps "
                    f"{', '.join(f'{t:.2f}' for t in last['times'])} s (CPU "
                    f"{', '.join(f'{t:.2f}' for t in last['cpu'])} s), peak RSS {last['peak_rss'] / 2**30:.2f} GiB "
                    f"(load {os.getloadavg()[0]:.1f})")
    first = {side: runs[side][0]["first_loss"] for side in runs}
    for side in sides[1:]:
        if abs(first[side] - first["peft"]) > (1e-4 if args.precision == "fp32" else 2e-2) * abs(first["peft"]):
            raise SystemExit(f"first-step losses differ (PEFT {first['peft']:.6f}, {side} {first[side]:.6f}): "
                             "not benchmarking")
    tokens = args.batch * args.seq
    clock = "cpu" if args.threads == 1 else "times"  # one thread: CPU time, what other jobs' load moves least
    rows = {}
    for side, results in runs.items():
        seconds = statistics.median(t for r in results for t in r[clock])
        wall = statistics.median(t for r in results for t in r["times"])
        rows[side] = (seconds, tokens / seconds, max(r["peak_rss"] for r in results), wall)
    ref = rows["peft"]
    lines = [f"| side | step s ({'CPU' if clock == 'cpu' else 'wall'}) | tokens/s | wall s | peak RSS | "
             "tokens/s vs PEFT | peak memory vs PEFT |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for side in sides:
        s, tps, rss, wall = rows[side]
        lines.append(f"| {SIDES[side].format(peft=peft.__version__)} | {s:.2f} | {tps:,.0f} | {wall:.2f} | "
                     f"{rss / 2**30:.2f} GiB | {'1.00' if side == 'peft' else f'**{tps / ref[1]:.2f}x**'} | "
                     f"{'1.00' if side == 'peft' else f'**{rss / ref[2]:.2f}x**'} |")
    goals = []
    for side in sides[1:]:
        speed, memory = rows[side][1] / ref[1], rows[side][2] / ref[2]
        met = "met" if speed >= 1.2 and memory <= 1 else "not met"
        goals.append(f"{SIDES[side]}: {met} — {speed:.2f}x the tokens/s at {memory:.2f}x the peak memory")
    goal = f"Goal (>= 1.2x PEFT's tokens/s at no more peak memory): {'; '.join(goals)}."
    from train import machine  # benchmarks/train.py

    command = " ".join(["python", "benchmarks/lora.py", *sys.argv[1:]])
    body = (f"Command: `{command}`. CPU: {machine()[0]}; torch {torch.__version__}, transformers {tf.__version__}, "
            f"peft {peft.__version__}, {datetime.date.today()}. {args.shape} shape, LoRA rank {RANK} alpha {ALPHA} on "
            f"every block linear, {PRECISIONS[args.precision]}, batch {args.batch} x {args.seq} tokens, torch threads "
            f"per process: {args.threads or torch.get_num_threads()}. Median of {args.rounds} x {args.steps} steps per "
            f"side{CPU_NOTE if clock == 'cpu' else ''}; {time.perf_counter() - t0:.0f} s in all, load average "
            f"{load_start:.1f} at "
            f"the start and {os.getloadavg()[0]:.1f} at the end (a shared machine).\n\n" + "\n".join(lines) +
            f"\n\n{goal}\n")
    print(body)
    if args.write:
        write_block(SECTION, __doc__.split("\n\n", 1)[1].strip(), f"CPU, {args.precision}", body)
        print(f"wrote '{SECTION}' to {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
