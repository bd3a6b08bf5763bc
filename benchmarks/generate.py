"""Greedy decoding: lmforge's KV-cache `generate` vs transformers' `generate`, side by side.

One random Pythia-70m-shaped model (GPT-NeoX config built in transformers), saved once and loaded
by both; the same left-padded prompts; eos off so every row decodes exactly --new-tokens tokens.
The two take turns within every repeat, so load on the machine hits both alike. Before timing, the
script checks that both produce the same tokens (fp32); the table also reports agreement in bf16,
where kernels may round differently. `--help` lists the options.
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
from functools import partial
from pathlib import Path

import torch
from report import BENCHMARKS_MD, write_section  # benchmarks/report.py

from lmforge.inference import generate, left_pad
from lmforge.models import load_pretrained

SECTION = "## Generation: greedy decode vs transformers"
PYTHIA_70M = dict(vocab_size=50304, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                  intermediate_size=2048, rotary_pct=0.25, max_position_embeddings=2048)
QUICK = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             rotary_pct=0.25, max_position_embeddings=256)


def hf_model(shape: dict, folder: Path):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPTNeoXConfig(**shape, bos_token_id=0, eos_token_id=0)
    model = tf.GPTNeoXForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    return model


def prompts_for(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Rows of different lengths (prompt_len down to 3/4 of it): left padding is part of the work."""
    gen = torch.Generator().manual_seed(batch)
    lengths = [prompt_len - (i * prompt_len // 4) // max(1, batch - 1) for i in range(batch)]
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_ours(model, prompts, new_tokens):
    return generate(model, prompts, new_tokens, do_sample=False, stop_token_ids=[])


def run_hf(model, prompts, new_tokens):
    ids, mask = left_pad(prompts, 0)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
    return out[:, ids.shape[1]:].tolist()


def median_seconds(calls: list, repeats: int) -> list[float]:
    times = [[] for _ in calls]
    for _ in range(repeats):
        for fn, t in zip(calls, times, strict=True):
            start = time.perf_counter()
            fn()
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def measure(args, shape: dict, folder: Path) -> list[dict]:
    ref32 = hf_model(shape, folder)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        ours = load_pretrained(folder, dtype=dtype)
        ref = ref32 if dtype == torch.float32 else hf_model(shape, folder).to(dtype)
        for batch in args.batch:
            prompts = prompts_for(batch, args.prompt_len, shape["vocab_size"])
            a, b = run_ours(ours, prompts, args.new_tokens), run_hf(ref, prompts, args.new_tokens)  # warm-up
            assert all(len(r) == args.new_tokens for r in a + b), "a row stopped early"
            same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / (batch * args.new_tokens)
            if dtype == torch.float32 and same < 1.0:
                raise SystemExit(f"fp32 greedy tokens differ from transformers (batch {batch}): not benchmarking")
            calls = [partial(run_ours, ours, prompts, args.new_tokens), partial(run_hf, ref, prompts, args.new_tokens)]
            t_ours, t_hf = median_seconds(calls, args.repeats)
            tokens = batch * args.new_tokens
            rows.append(dict(dtype=str(dtype).removeprefix("torch."), batch=batch, ours=tokens / t_ours,
                             hf=tokens / t_hf, ratio=t_hf / t_ours, same=same))
            print(f"  {rows[-1]['dtype']} batch {batch}: ours {rows[-1]['ours']:.1f} tok/s, "
                  f"transformers {rows[-1]['hf']:.1f} tok/s", file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| dtype | batch | lmforge tok/s | transformers tok/s | lmforge / transformers | same tokens |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['ours']:.1f} | {r['hf']:.1f} | **{r['ratio']:.2f}** | "
                     f"{100 * r['same']:.0f}% |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each side (median)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--quick", action="store_true", help="a tiny model and few tokens: checks the script runs")
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    if args.quick:
        if args.write:
            p.error("--quick numbers are not benchmark numbers: run without --quick to --write")
        args.batch, args.prompt_len, args.new_tokens, args.repeats = [1, 2], 8, 8, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = QUICK if args.quick else PYTHIA_70M
    cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    machine = f"{cpu.group(1) if cpu else 'unknown CPU'}, {torch.get_num_threads()} threads"
    import transformers

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(args, shape, Path(tmp) / "model")
    command = "python benchmarks/generate.py" + "".join(f" {a}" for a in sys.argv[1:])
    what = "tiny GPT-NeoX (--quick)" if args.quick else "Pythia-70m shape (d 512, 6 layers, vocab 50304), random"
    body = (
        f"Command: `{command}`. {what}; greedy, batch of left-padded prompts of {args.prompt_len} down "
        f"to {args.prompt_len - args.prompt_len // 4} tokens, {args.new_tokens} new tokens per row (eos off). "
        "tok/s = new tokens / wall time of the whole `generate` call (prefill included), median of "
        f"{args.repeats} interleaved runs; transformers uses its default dynamic cache and SDPA. "
        "*same tokens*: share of generated tokens equal to transformers' (fp32 must be 100%).\n\n"
        f"{machine}, torch {torch.__version__}, transformers {transformers.__version__}, {datetime.date.today()}; "
        f"{time.perf_counter() - t0:.0f} s in all, load average {os.getloadavg()[0]:.1f} at the end.\n\n"
        f"{table(rows)}\n"
    )
    print(body)
    if args.write:
        write_section(SECTION, f"{SECTION}\n\n{body}")
        print(f"wrote '{SECTION}' to {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
