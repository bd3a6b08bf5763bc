"""Throughput and tokens per dollar against the number of processes, in the NeoX-on-Trainium
write-up's form.

Each row is a real `lmforge pretrain` run under torchrun (gloo on CPU, one thread per process), same
model, sequence length and global batch, so a row differs from the first only in how the processes
share the step: data parallel (DDP, FSDP2) at 2 and 4 processes, tensor parallel 2, pipeline
parallel 2 (1F1B) and tensor 2 x pipeline 2 on 4 processes. seq/s and tokens/s are medians over the
steps after warm-up, read from the run's metrics.jsonl. The model's vocabulary is padded to a
multiple of 256 rows in every row (tensor parallel 2 splits it into 128-row multiples). Cost per
hour is `--usd-per-hour` per process (a "node" here) times the processes; tokens per dollar follows.
Beside each measured row: the bytes each rank sends per step from lmforge.parallel.comm_volume (the
analytic model that tests/parallel/test_comm_volume.py checks against the bytes gloo really writes),
and a second table applies the same model to the write-up's GPT-NeoX-20B layouts, so a user can see
what multi-node scaling costs in traffic.

On a 2-core machine, more than 2 processes cannot run faster: the table shows the overhead of
sharing the step, not the speed-up of more hardware. Run it on a multi-core or GPU machine for
scaling figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from report import publish  # benchmarks/report.py

from lmforge.data.indexed import IndexedDatasetWriter
from lmforge.models.presets import PRESETS
from lmforge.parallel.comm_volume import Layout, step_bytes

SECTION = "## Scaling: throughput and tokens per dollar vs processes"
# The write-up's GPT-NeoX-20B runs: TP 8, PP 4, seq 2048, 32 accelerator cores per node, so one
# model replica per node; (nodes, global batch, seq/s, M tokens per $). seq/s and tokens per $ are
# the published figures; the global batches are our assumption inside the write-up's 256-16384 range
# (the volume per rank depends on it only through the micro batches each replica runs).
NEOX_20B = [(4, 1024, 13.6, 3.30), (64, 16384, 212.0, 3.22)]


def corpus(folder: Path, vocab: int) -> Path:
    """Random token documents: throughput does not depend on what the tokens say."""
    prefix = folder / "random_text_document"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.int32 if vocab > 65500 else np.uint16) as writer:
        for _ in range(2000):
            writer.add_document(rng.integers(0, vocab, rng.integers(50, 800)))
    return prefix


# name: (processes, overrides, tensor, pipeline)
MESH_LAYOUTS = {
    "tp2": (2, ["parallel.tensor=2"], 2, 1),
    "pp2": (2, ["parallel.pipeline=2"], 1, 2),
    "tp2pp2": (4, ["parallel.tensor=2", "parallel.pipeline=2"], 2, 2),
}


def run(prefix: Path, processes: int, overrides: list[str], args, run_dir: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        "-m",
        "lmforge.cli",
        "pretrain",
        os.devnull,
        f"model.preset={args.model}",
        "model.make_vocab_size_divisible_by=256",
        f"data.paths=[{prefix}]",
        f"data.seq_length={args.seq}",
        f"trainer.max_steps={args.steps}",
        f"trainer.global_batch_size={args.global_batch}",
        f"trainer.micro_batch_size={args.micro_batch}",
        "trainer.val_check_interval=0",
        f"trainer.precision={args.precision}",
        "trainer.progress_bar=false",
        "checkpoint.every_n_steps=0",
        "checkpoint.save_top_k=0",
        "checkpoint.save_last=false",
        "cost.peak_flops=1e11",
        f"run_dir={run_dir}",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode:
        raise SystemExit(
            f"run with {processes} process(es), {overrides} failed:\n{r.stderr[-3000:]}"
        )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = rows[args.warmup :] or rows[-1:]
    return {
        "seq_s": statistics.median(r["sequences_per_second"] for r in steady),
        "tok_s": statistics.median(r["tokens_per_second"] for r in steady),
    }


LAYOUT_CAVEAT = (
    "The tensor- and pipeline-parallel rows also do more work per step than the others: their last stage computes "
    "the loss from whole logits (F.cross_entropy over the vocabulary, vocabulary-parallel under TP), where one "
    "process and DDP/FSDP use the chunked loss of lmforge.train.loss; and pythia-14m's 50304 x 128 head is 12.9 of "
    "the 15.3 MFLOP its weight matrices cost per token (forward), all of it on the last pipeline stage, so a "
    "pipeline over this model is mostly its last stage. Compare their communication columns, not their seq/s, "
    "with the data-parallel rows."
)


def measured_table(results: list[dict], args) -> str:
    cfg = dataclasses.replace(PRESETS[args.model], make_vocab_size_divisible_by=256)
    act = 4 if args.precision == "fp32" else 2
    lines = [
        "| model | TP | PP | processes | data parallel | cost/hour | seq len | global batch | seq/s | tokens/s | "
        "tokens per $ | scaling efficiency | sent per rank per step (analytic): data / tensor / pipeline |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base = results[0]["seq_s"]
    for r in results:
        n, tp, pp = r["processes"], r["tensor"], r["pipeline"]
        dp = n // (tp * pp)
        usd = args.usd_per_hour * n
        per_dollar = r["tok_s"] * 3600 / usd
        v = step_bytes(
            cfg,
            Layout(tensor=tp, pipeline=pp, data=dp, data_parallel=r["strategy"]),
            args.seq,
            args.global_batch,
            args.micro_batch,
            param_bytes=4,
            grad_bytes=4,
            activation_bytes=act,
            reduce_scatter_as_all_reduce=True,
        )
        sent = " / ".join(f"{v[k] / 1e6:.1f}" for k in ("data", "tensor", "pipeline"))
        lines.append(
            f"| {args.model} | {tp} | {pp} | {n} | {r['strategy'] if dp > 1 else '-'} | ${usd:.3f} | "
            f"{args.seq} | {args.global_batch} | {r['seq_s']:.2f} | {r['tok_s']:.0f} | "
            f"{per_dollar / 1e6:.2f} M | {100 * r['seq_s'] / (base * n):.0f}% | {sent} MB |"
        )
    return "\n".join(lines)


def neox_table() -> str:
    cfg = PRESETS["gpt-neox-20b"]
    lines = [
        "| nodes | TP | PP | DP | global batch (assumed) | published seq/s | published M tokens/$ | "
        "sent per rank per step: data / tensor / pipeline (GB) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for nodes, batch, seq_s, mtok in NEOX_20B:
        dp = nodes  # TP 8 x PP 4 = 32 cores = one node per replica
        v = step_bytes(cfg, Layout(tensor=8, pipeline=4, data=dp), 2048, batch, 1)
        lines.append(
            f"| {nodes} | 8 | 4 | {dp} | {batch} | {seq_s} | {mtok} | "
            f"{v['data'] / 1e9:.2f} / {v['tensor'] / 1e9:.1f} / {v['pipeline'] / 1e9:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="pythia-14m", choices=sorted(PRESETS))
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed", "bf16-sr", "bf16"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument(
        "--usd-per-hour", type=float, default=0.05, help="price of one process ('node') per hour"
    )
    p.add_argument(
        "--layouts",
        nargs="*",
        default=list(MESH_LAYOUTS),
        choices=list(MESH_LAYOUTS),
        help="tensor/pipeline-parallel rows (default: all)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="short runs of 1, 2 (DDP) and TP 2: checks the script runs",
    )
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    if args.quick:
        if args.write:
            p.error("--quick numbers are not benchmark numbers: run without --quick to --write")
        args.processes, args.strategies, args.steps, args.warmup, args.seq = (
            [1, 2],
            ["ddp"],
            3,
            1,
            64,
        )
        args.layouts = ["tp2"]
    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = corpus(Path(tmp), PRESETS[args.model].vocab_size)
        for strategy in args.strategies:
            for n in args.processes:
                if n == 1 and strategy != args.strategies[0]:
                    continue  # one process has no data parallelism to choose
                r = run(
                    prefix,
                    n,
                    [f"trainer.data_parallel={strategy}"],
                    args,
                    Path(tmp) / f"run-{strategy}-{n}",
                )
                results.append(
                    {
                        "processes": n,
                        "strategy": strategy if n > 1 else "-",
                        "tensor": 1,
                        "pipeline": 1,
                        **r,
                    }
                )
                print(f"{n} process(es), {strategy}: {r['seq_s']:.2f} seq/s", flush=True)
        for name in args.layouts:
            n, overrides, tp, pp = MESH_LAYOUTS[name]
            r = run(prefix, n, overrides, args, Path(tmp) / f"run-{name}")
            results.append({"processes": n, "strategy": "ddp", "tensor": tp, "pipeline": pp, **r})
            print(f"{n} process(es), {name}: {r['seq_s']:.2f} seq/s", flush=True)
    for r in results:
        r["strategy"] = "ddp" if r["strategy"] == "-" else r["strategy"]
    command = "python benchmarks/scaling.py" + "".join(f" {a}" for a in sys.argv[1:])
    body = (
        f"Command: `{command}`. {os.cpu_count()} cores, gloo, one thread per process, {args.precision}; "
        f"{datetime.date.today()}; {time.perf_counter() - t0:.0f} s in all, load average "
        f"{os.getloadavg()[0]:.1f} at the end. Medians over steps {args.warmup + 1}-{args.steps}; cost "
        f"${args.usd_per_hour}/hour per process.\n\n{measured_table(results, args)}\n\n"
        "Analytic bytes for gloo (a reduce-scatter runs as an all-reduce; fp32 parameters, gradients and "
        "activations in an fp32 run). On 2 cores every layout shares the same two cores: the rows show what "
        "splitting a step costs, not what more hardware gains. " + LAYOUT_CAVEAT + "\n\n"
        "The write-up's GPT-NeoX-20B layouts through the same communication model (bf16 parameters and "
        f"activations, fp32 gradients, NCCL's reduce-scatter), beside its published figures:\n\n{neox_table()}\n"
    )
    publish(SECTION, body, args.write)


if __name__ == "__main__":
    main()
