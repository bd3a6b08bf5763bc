"""Greedy decoding: lmforge's KV-cache `generate` (eager and compiled) vs transformers' `generate`,
side by side.

One random Pythia-70m-shaped model (GPT-NeoX config built in transformers), saved once and loaded by
both; the same left-padded prompts; eos off so every row decodes exactly --new-tokens tokens. Sides:
transformers with its default dynamic cache; transformers with a static cache and torch.compile (its
own compiled decoding: its default reduce-overhead mode, CUDA graphs, on CUDA; forced on for CPU in
the default mode); lmforge eager; lmforge compile=True; lmforge compile="reduce-overhead" (the
static-shape decode step, replayed as CUDA graphs on CUDA; on the CPU the same static graph without
them). On CUDA the defaults are the issue's: batch 1, 8 and 32, 128-token prompts, 256 new tokens.
Within every repeat the sides take turns in rotated order, together with two probes of the floor:
the memory bandwidth (a large copy) and the decode step's matrix products alone. Batch-1 decoding
reads every weight once per token, so bandwidth / bytes read per token bounds tokens/s for any
implementation. Before timing, every lmforge side must produce transformers' tokens (fp32); bf16
rows run only on CPUs with bf16 matrix instructions (or with --force-bf16). `--device` (default
auto: CUDA when present) puts every side on the same device; on an accelerator bf16 is a normal row
and each side's peak memory is reported too. `--help` lists the options.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from report import BENCHMARKS_MD, accelerator_description, write_block  # benchmarks/report.py
from train_sides import hf_shape  # benchmarks/train_sides.py

from lmforge.devices import (
    max_memory_allocated,
    memory_allocated,
    reset_peak_memory_stats,
    resolve_device,
    synchronize,
)
from lmforge.errors import UserError
from lmforge.inference import generate, left_pad
from lmforge.models import load_pretrained

SECTION = "## Generation: greedy decode vs transformers"
# Pythia shapes (lmforge's presets, as transformers' GPTNeoXConfig): pythia-14m is dominated by
# per-token overhead (its weights are 31 MB in fp32, mostly the head), pythia-70m by reading 180 MB
# per token; pythia-1b is the GPU's shape, where a batch-1 step reads 2 GB in bf16 and the kernel
# launches of an eager step still show.
SHAPES = {
    name: hf_shape(name)
    for name in ("pythia-14m", "pythia-70m", "pythia-160m", "pythia-410m", "pythia-1b")
}
QUICK = dict(
    vocab_size=1000,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    rotary_pct=0.25,
    max_position_embeddings=256,
)
BANDWIDTH_MB = 512  # copied per bandwidth probe: far past the last-level cache


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Side:
    name: str
    run: Callable[[], list[list[int]]]
    warmup_s: float = 0.0  # the first call: compilation for the compiled sides
    tokens: list[list[int]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    # the most each run allocated above what it found
    extra_bytes: list[int] = field(default_factory=list)

    def tokens_per_second(self, tokens: int) -> float:
        return tokens / statistics.median(self.times)


def machine() -> tuple[str, list[str]]:
    """(CPU name, its bf16 matrix instruction flags)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
    flags = set(flags.group(1).split()) if flags else set()
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    return f"{name.group(1) if name else 'unknown CPU'} ({isa})", sorted(
        flags & {"avx512_bf16", "amx_bf16"}
    )


def bf16_slowdown(n: int = 256) -> float:
    """How many times slower an n x 512 x 2048 bf16 matmul runs than fp32 here (one of the
    decode's shapes)."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(n, 512, dtype=dtype), torch.randn(2048, 512, dtype=dtype)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            F.linear(x, w)
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    return best[torch.bfloat16] / best[torch.float32]


def hf_model(shape: dict, folder: Path, device: torch.device | str = "cpu"):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPTNeoXConfig(**shape, bos_token_id=0, eos_token_id=0)
    model = tf.GPTNeoXForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    return model.to(device)


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Rows of different lengths (prompt_len down to 3/4 of it): left padding is part of the
    work."""
    gen = torch.Generator().manual_seed(batch)
    lengths = [prompt_len - (i * prompt_len // 4) // max(1, batch - 1) for i in range(batch)]
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_ours(model, prompts, new_tokens, compile=False):
    return generate(model, prompts, new_tokens, do_sample=False, stop_token_ids=[], compile=compile)


def run_hf(model, prompts, new_tokens, compile=False):
    kwargs = {}
    # transformers compiles its static-cache decoding by itself only on GPUs: ask for it on
    # CPU too
    if compile:
        from transformers import CompileConfig

        # Its own default mode on CUDA (reduce-overhead: CUDA graphs); "default" on the CPU, which
        # has none.
        mode = "reduce-overhead" if model.device.type == "cuda" else "default"
        config = CompileConfig(fullgraph=True, dynamic=False, mode=mode)
        config._compile_all_devices = True
        kwargs = dict(cache_implementation="static", compile_config=config)
    ids, mask = left_pad(prompts, 0, model.device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
            eos_token_id=None,
            **kwargs,
        )
    return out[:, ids.shape[1] :].tolist()


class Floor:
    """Probes of what no implementation can beat: memory bandwidth, and the decode step's matmuls
    alone."""

    def __init__(self, model, batch: int):
        n = BANDWIDTH_MB * 2**20 // 4
        p = next(model.parameters())
        self.device = p.device
        self.src, self.dst = torch.ones(n, device=self.device), torch.empty(n, device=self.device)
        head = model.lm_head.weight[: model.config.vocab_size]
        self.matrices = [
            (m.weight, m.bias) for m in model.layers.modules() if isinstance(m, torch.nn.Linear)
        ]
        self.matrices.append((head, None))
        self.inputs = {
            w.shape[1]: torch.randn(batch, w.shape[1], dtype=p.dtype, device=self.device)
            for w, _ in self.matrices
        }
        self.bandwidth, self.matmuls = [], []

    def probe(self) -> None:
        best = float("inf")
        for _ in range(3):
            synchronize(self.device)
            start = time.perf_counter()
            self.dst.copy_(self.src)
            synchronize(self.device)
            best = min(best, time.perf_counter() - start)
        self.bandwidth.append(2 * self.src.numel() * 4 / best)  # bytes read + written
        synchronize(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            for w, b in self.matrices:
                F.linear(self.inputs[w.shape[1]], w, b)
        synchronize(self.device)
        self.matmuls.append(time.perf_counter() - start)


def bytes_per_step(model, batch: int, mean_context: float) -> float:
    """Bytes one decode step must read: every weight but the embedding tables (a row each), the
    head's real-vocabulary rows, and the keys/values of the context so far."""
    cfg = model.config
    size = next(model.parameters()).element_size()
    weights = sum(
        p.numel() for n, p in model.named_parameters() if not n.startswith(("embed.", "pos_embed."))
    )
    if model.lm_head is not None:
        weights -= (cfg.padded_vocab_size - cfg.vocab_size) * cfg.hidden_size
    kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * mean_context
    return (weights + kv) * size


def measure_group(args, ours, ref, dtype: torch.dtype, batch: int, vocab: int) -> dict:
    device = args.device
    prompts = prompts_for(batch, args.prompt_len, vocab)
    n = args.new_tokens
    sides = [
        Side("transformers", lambda: run_hf(ref, prompts, n)),
        Side("lmforge eager", lambda: run_ours(ours, prompts, n)),
    ]
    if not args.no_compile:
        sides.insert(1, Side("transformers compile", lambda: run_hf(ref, prompts, n, compile=True)))
        sides.append(Side("lmforge compile", lambda: run_ours(ours, prompts, n, compile=True)))
        sides.append(
            Side(
                "lmforge reduce-overhead",
                lambda: run_ours(ours, prompts, n, compile="reduce-overhead"),
            )
        )
    for side in sides:  # warm-up, compilation included, and the tokens to compare
        synchronize(device)
        start = time.perf_counter()
        side.tokens = side.run()
        synchronize(device)
        side.warmup_s = time.perf_counter() - start
        assert all(len(r) == n for r in side.tokens), f"{side.name}: a row stopped early"
        log(f"  {side.name}: first call {side.warmup_s:.1f} s")
    same = {
        s.name: sum(x == y for ra, rb in zip(s.tokens, sides[0].tokens) for x, y in zip(ra, rb))
        / (batch * n)
        for s in sides
    }
    if dtype == torch.float32 and any(v < 1.0 for k, v in same.items() if k.startswith("lmforge")):
        raise SystemExit(
            f"fp32 greedy tokens differ from transformers (batch {batch}: {same}): not benchmarking"
        )
    floor = Floor(ours, batch)
    # rotate the order so that no side always runs right after another
    for r in range(args.repeats):
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
            before = memory_allocated(device)
            reset_peak_memory_stats(device)
            synchronize(device)
            start = time.perf_counter()
            side.run()
            synchronize(device)
            side.times.append(time.perf_counter() - start)
            if before is not None:
                side.extra_bytes.append(max_memory_allocated(device) - before)
        floor.probe()
    tokens = batch * n
    bandwidth = statistics.median(floor.bandwidth)
    step_bytes = bytes_per_step(ours, batch, args.prompt_len + n / 2)
    row = dict(
        dtype=str(dtype).removeprefix("torch."),
        batch=batch,
        same=same,
        bandwidth=bandwidth,
        step_mb=step_bytes / 1e6,
        bound=batch * bandwidth / step_bytes,
        matmuls=batch / statistics.median(floor.matmuls),
        load=os.getloadavg()[0],
        tok_s={s.name: s.tokens_per_second(tokens) for s in sides},
        warmup={s.name: s.warmup_s for s in sides},
        extra_mb={s.name: max(s.extra_bytes) / 1e6 for s in sides if s.extra_bytes},
    )
    log(
        f"  {row['dtype']} batch {batch}: "
        + ", ".join(f"{k} {v:.1f}" for k, v in row["tok_s"].items())
        + f" tok/s; matmuls alone {row['matmuls']:.1f}, bandwidth bound {row['bound']:.1f} tok/s"
    )
    return row


def measure(args, name: str, shape: dict, folder: Path, dtypes: list[torch.dtype]) -> list[dict]:
    ref32 = hf_model(shape, folder, args.device)
    rows = []
    for dtype in dtypes:
        ours = load_pretrained(folder, device=args.device, dtype=dtype)
        ref = ref32 if dtype == torch.float32 else hf_model(shape, folder, args.device).to(dtype)
        for batch in args.batch:
            log(f"{name} {dtype} batch {batch}")
            rows.append(
                {"shape": name, **measure_group(args, ours, ref, dtype, batch, shape["vocab_size"])}
            )
    return rows


def table(rows: list[dict]) -> str:
    names = list(rows[0]["tok_s"])
    head = " | ".join(f"{n} tok/s" for n in names)
    ratios = [n for n in names if n.startswith("lmforge")]
    lines = [
        f"| shape | dtype | batch | {head} | "
        + " | ".join(f"{n} / transformers" for n in ratios)
        + " | matmuls alone tok/s | bandwidth bound tok/s | best / bound | same tokens | load |",
        "| --- | --- | ---: |" + " ---: |" * (len(names) + len(ratios) + 5),
    ]
    for r in rows:
        t = r["tok_s"]
        best = max(t[n] for n in ratios)
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['batch']} | "
            + " | ".join(f"{t[n]:.1f}" for n in names)
            + " | "
            + " | ".join(f"**{t[n] / t['transformers']:.2f}**" for n in ratios)
            + f" | {r['matmuls']:.1f} | {r['bound']:.1f} | {100 * best / r['bound']:.0f}% | "
            + ", ".join(f"{100 * r['same'][n]:.0f}%" for n in names[1:])
            + f" | {r['load']:.1f} |"
        )
    return "\n".join(lines)


def ceiling(rows: list[dict]) -> str:
    """What the floor probes say about a speed-up over transformers: the decode step's matrix
    products alone, with nothing else, against transformers' whole generate. No implementation
    using these matmul kernels exceeds it."""
    parts = []
    for r in rows:
        hf = r["tok_s"]["transformers"]
        best = max(v for k, v in r["tok_s"].items() if k.startswith("lmforge"))
        compiled = r["tok_s"].get("transformers compile")
        against = f" ({best / compiled:.2f}x transformers compile)" if compiled else ""
        parts.append(
            f"{r['shape']} {r['dtype']} batch {r['batch']}: matmuls alone {r['matmuls'] / hf:.2f}x "
            f"transformers, the faster lmforge side {best / hf:.2f}x{against}"
        )
    return (
        "Ceiling on the speed-up (the decode step's matrix products alone, nothing else, against transformers' "
        "whole `generate`; no implementation calling these matmul kernels can beat it): "
        + "; ".join(parts)
        + "."
    )


def details(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        warm = ", ".join(f"{k} {v:.1f} s" for k, v in r["warmup"].items())
        memory = (
            "; peak memory above the weights (cache and activations): "
            + ", ".join(f"{k} {v:.0f} MB" for k, v in r["extra_mb"].items())
            if r["extra_mb"]
            else ""
        )
        lines.append(
            f"- {r['shape']} {r['dtype']} batch {r['batch']}: bandwidth {r['bandwidth'] / 1e9:.1f} GB/s, "
            f"{r['step_mb']:.0f} MB read per decode step; first call (compilation) {warm}{memory}."
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shape",
        nargs="+",
        default=None,
        choices=list(SHAPES),
        help="Pythia shapes to run (default pythia-14m pythia-70m; CUDA: pythia-160m pythia-1b)",
    )
    p.add_argument("--batch", type=int, nargs="+", default=None, help="default 1 8 (CUDA: 1 8 32)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 32 (CUDA: 128)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (CUDA: 256)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each side (median)")
    p.add_argument(
        "--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    p.add_argument(
        "--force-bf16", action="store_true", help="run bf16 rows even on a CPU without bf16 matmuls"
    )
    p.add_argument(
        "--no-compile", action="store_true", help="leave out the compiled sides (no compilation)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when present, else the CPU), cpu, cuda, cuda:1 ...",
    )
    p.add_argument(
        "--quick", action="store_true", help="a tiny model and few tokens: checks the script runs"
    )
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    try:
        args.device = resolve_device(args.device)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    cuda = args.device.type == "cuda"
    args.batch = args.batch or ([1, 8, 32] if cuda else [1, 8])
    args.prompt_len = args.prompt_len or (128 if cuda else 32)
    args.new_tokens = args.new_tokens or (256 if cuda else 128)
    args.shape = args.shape or (
        ["pythia-160m", "pythia-1b"] if cuda else ["pythia-14m", "pythia-70m"]
    )
    if args.quick:
        if args.write:
            p.error("--quick numbers are not benchmark numbers: run without --quick to --write")
        args.batch, args.prompt_len, args.new_tokens, args.repeats = [1, 2], 8, 8, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = {"tiny": QUICK} if args.quick else {name: SHAPES[name] for name in args.shape}
    on_cpu = args.device.type == "cpu"
    if on_cpu:
        cpu, bf16_flags = machine()
        cpu = f"{cpu}, {torch.get_num_threads()} threads"
    else:  # bf16 matrix units are what accelerators have: the CPU caveats do not apply
        cpu, bf16_flags = accelerator_description(args.device), ["device"]
    dtypes = [getattr(torch, d) for d in args.dtype]
    skipped = ""
    if torch.bfloat16 in dtypes and not bf16_flags and not args.force_bf16:
        dtypes.remove(torch.bfloat16)
        skipped = (
            f"bfloat16 rows skipped: this CPU has no bf16 matrix instructions (neither avx512_bf16 nor "
            f"amx_bf16 in /proc/cpuinfo); a 256x512x2048 bf16 matmul measured {bf16_slowdown():.0f}x "
            "slower than fp32 here, so bf16 would time the fallback kernels. --force-bf16 runs them."
        )
        log(skipped)
    import transformers

    load_start, t0 = os.getloadavg()[0], time.perf_counter()
    command = "python benchmarks/generate.py" + "".join(f" {a}" for a in sys.argv[1:])
    what = (
        "tiny GPT-NeoX (--quick)"
        if args.quick
        else (
            "Pythia shapes, random weights: "
            + ", ".join(
                f"{n} (d {SHAPES[n]['hidden_size']}, {SHAPES[n]['num_hidden_layers']} layers, "
                f"{SHAPES[n]['num_attention_heads']} heads)"
                for n in args.shape
            )
            + ", each with the 50304-row vocabulary and 25% rotary"
        )
    )

    def body(rows: list[dict], done: bool) -> str:
        return (
            f"Command: `{command}` (or `lmforge bench generate`). {what}; greedy, batch of left-padded prompts of "
            f"{args.prompt_len} down to {args.prompt_len - args.prompt_len // 4} tokens, {args.new_tokens} new "
            f"tokens per row (eos off), median of {args.repeats} runs. {cpu}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, {datetime.date.today()}; {time.perf_counter() - t0:.0f} s "
            f"{'in all' if done else 'so far (the run goes on: rows are written as they finish)'}, load average "
            f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end.\n\n"
            + (f"{table(rows)}\n\n{details(rows)}\n\n{ceiling(rows)}\n" if rows else "")
            + ("" if on_cpu or not rows else f"\n{goal(rows)}\n")
            + (f"\n{skipped}\n" if skipped else "")
        )

    label = f"CPU, {cpu}" if on_cpu else f"{args.device.type.upper()}, {cpu}"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in shapes.items() if dtypes else ():
            for row in measure(args, name, shape, Path(tmp) / name, dtypes):
                rows.append(row)
                if args.write:  # a run cut at a time limit keeps the rows it finished
                    write_block(SECTION, INTRO, label, body(rows, done=False))
    print(body(rows, done=True))
    if args.write:
        write_block(SECTION, INTRO, label, body(rows, done=True))
        print(f"wrote '{SECTION}' ({label}) to {BENCHMARKS_MD}")


def goal(rows: list[dict]) -> str:
    """Issue 14's decode goal on an accelerator: batch-1 greedy >= 2x transformers' compiled
    static-cache decode."""
    out = []
    for r in rows:
        hf, ours = r["tok_s"].get("transformers compile"), r["tok_s"].get("lmforge reduce-overhead")
        if r["batch"] == 1 and hf and ours:
            out.append(
                f"- {r['shape']} {r['dtype']} batch 1, lmforge reduce-overhead (CUDA graphs) >= 2x transformers "
                f"compile (static cache): {'met' if ours >= 2 * hf else 'not met'} — {ours / hf:.2f}x."
            )
    return "\n".join(out) or "- batch-1 goal: no batch-1 row with both compiled sides in this run."


INTRO = (
    "tok/s = new tokens / wall time of the whole `generate` call (prefill included), the sides taking turns in "
    "rotated order. *transformers*: its default dynamic cache and SDPA; *transformers compile*: "
    '`cache_implementation="static"` with its compiled decoding forced on for CPU (on CUDA its default '
    "reduce-overhead mode, CUDA graphs); *lmforge compile*: `generate(..., compile=True)` (the decode step through "
    "torch.compile over the filled slots of the preallocated cache); *lmforge reduce-overhead*: "
    '`compile="reduce-overhead"`, the static-shape step over the whole cache, replayed as CUDA graphs on CUDA (the '
    "same static graph without them on the CPU). *matmuls alone*: the decode step's matrix products and nothing "
    "else, timed in the same turns; *bandwidth bound*: copy bandwidth (512 MB, read + write) / bytes one decode step "
    "reads (weights but the embedding table, plus the keys/values of the mean context): no implementation reading "
    "the weights once per step exceeds it. *best / bound*: the faster lmforge side against that bound. *same "
    "tokens*: share of generated tokens equal to transformers' (fp32 lmforge must be 100%). *load*: 1-minute load "
    "average after the row (the machine is shared). One block per device; `--help` lists the options."
)


if __name__ == "__main__":
    main()
