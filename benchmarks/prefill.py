"""The serving engine's batched prefill: N requests arriving at once, prefilled together vs one at a
time.

A random Pythia-70m-shaped model (GPT-NeoX config built in transformers, loaded by lmforge) in the
engine that `lmforge serve` runs (lmforge.inference.engine), in this process, without HTTP:
--requests prompts of --prompt-len tokens (down to 3/4 of it) are queued, then the engine starts,
greedy, --new-tokens each (eos off). The sides, in one run taking turns in rotated order:
`prefill_batch=1` (each waiting request prefilled by a forward of its own, the engine before batched
prefill) and the default (the waiting requests in one forward, right-padded). Reported per side:
time to first token (queue to the first event, mean and slowest over the requests), the time until
every request has finished, and completion tokens/s over it (median of --repeats). Before timing,
both sides must give every request the tokens `generate` gives for it alone. `--help` lists the
options.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from report import cpu_run_line, publish  # benchmarks/report.py

from lmforge.inference import generate
from lmforge.inference.engine import Engine, EngineConfig, RequestParams
from lmforge.inference.sampling import SamplingParams
from lmforge.models import load_pretrained

SECTION = "## Serving engine: batched prefill"
PYTHIA_70M = dict(
    vocab_size=50304,
    hidden_size=512,
    num_hidden_layers=6,
    num_attention_heads=8,
    intermediate_size=2048,
    rotary_pct=0.25,
    max_position_embeddings=2048,
)
QUICK = dict(
    vocab_size=1000,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    rotary_pct=0.25,
    max_position_embeddings=256,
)
# EngineConfig settings of each side: the engine before batched prefill, its default now, and every
# waiting request in one forward whatever its length (the accelerator default's behaviour, on this
# device).
SIDES = {
    "one at a time": dict(prefill_batch=1),
    "batched (default)": {},
    "all in one": dict(max_prefill_tokens=1 << 30),
}


class IdTokenizer:
    """Text is not measured here: ids as words, no eos of its own."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))

    def token_to_id(self, text):
        return None

    def model_special_ids(self, declared, classifier=False):
        return {k: declared.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def make_model(shape: dict, folder: Path):
    import transformers as tf

    torch.manual_seed(0)
    tf.GPTNeoXForCausalLM(
        tf.GPTNeoXConfig(**shape, bos_token_id=0, eos_token_id=0)
    ).save_pretrained(folder)
    model = load_pretrained(folder).eval()
    model.config.eos_token_id = None  # every request runs to --new-tokens
    return model


def prompts_for(n: int, prompt_len: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n * prompt_len)
    lengths = [prompt_len - (i * prompt_len // 4) // max(1, n - 1) for i in range(n)]
    return [torch.randint(1, vocab, (k,), generator=gen).tolist() for k in lengths]


def run_engine(model, prompts: list[list[int]], new_tokens: int, settings: dict) -> dict:
    """Queue every prompt, start the engine, wait for all to finish; per-request first-token
    times and tokens."""
    engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=len(prompts), **settings))
    first: dict[int, float] = {}
    done = threading.Event()
    finished = [0]

    def on_event(i, event):
        first.setdefault(i, time.perf_counter())
        if event.finish_reason is not None:
            finished[0] += 1
            if finished[0] == len(prompts):
                done.set()

    params = RequestParams(new_tokens, SamplingParams(temperature=0))
    reqs = [engine.submit(p, params, lambda e, i=i: on_event(i, e)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    engine.start()
    done.wait()
    end = time.perf_counter()
    engine.stop()
    ttft = [first[i] - start for i in range(len(prompts))]
    return dict(
        ttft_mean=statistics.mean(ttft),
        ttft_max=max(ttft),
        total=end - start,
        tokens=[r.output_ids for r in reqs],
        prefills=engine.prefills,
    )


def measure(model, n: int, prompt_len: int, args) -> dict:
    prompts = prompts_for(n, prompt_len, model.config.vocab_size)
    alone = [
        generate(model, [p], args.new_tokens, do_sample=False, stop_token_ids=[])[0]
        for p in prompts
    ]
    runs: dict[str, list[dict]] = {name: [] for name in SIDES}
    for name, settings in SIDES.items():  # warm-up, and the tokens checked
        result = run_engine(model, prompts, args.new_tokens, settings)
        if result["tokens"] != alone:
            raise SystemExit(
                f"{name}: the engine's greedy tokens differ from generate alone: not benchmarking"
            )
    names = list(SIDES)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(run_engine(model, prompts, args.new_tokens, SIDES[name]))
    row = dict(requests=n, prompt_len=prompt_len, load=os.getloadavg()[0])
    for name, results in runs.items():
        row[name] = {
            key: statistics.median(x[key] for x in results)
            for key in ("ttft_mean", "ttft_max", "total")
        }
        row[name]["tok_s"] = n * args.new_tokens / row[name]["total"]
        row[name]["prefills"] = results[0]["prefills"]
    print(
        f"{n} x {prompt_len}: TTFT mean "
        + ", ".join(f"{k} {row[k]['ttft_mean'] * 1e3:.0f} ms" for k in SIDES)
        + "; tok/s "
        + ", ".join(f"{k} {row[k]['tok_s']:.0f}" for k in SIDES),
        file=sys.stderr,
        flush=True,
    )
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| requests x prompt | side | prefill forwards | TTFT mean ms | slowest TTFT ms | all done s | tok/s | "
        "TTFT mean: one at a time / side | tok/s: side / one at a time | load |",
        "| --- | --- |" + " ---: |" * 8,
    ]
    for r in rows:
        one = r["one at a time"]
        for name in SIDES:
            x = r[name]
            lines.append(
                f"| {r['requests']} x {r['prompt_len']} | {name} | {x['prefills']} | "
                f"{x['ttft_mean'] * 1e3:.0f} | {x['ttft_max'] * 1e3:.0f} | {x['total']:.2f} | "
                f"{x['tok_s']:.1f} | "
                f"**{one['ttft_mean'] / x['ttft_mean']:.2f}x** | **{x['tok_s'] / one['tok_s']:.2f}x** | "
                f"{r['load']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, nargs="+", default=[8], help="requests arriving at once")
    p.add_argument(
        "--prompt-len", type=int, nargs="+", default=[16, 128], help="longest prompt, tokens"
    )
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)"
    )
    p.add_argument("--quick", action="store_true", help="a tiny model: checks the script runs")
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    if args.quick:
        if args.write:
            p.error("--quick numbers are not benchmark numbers: run without --quick to --write")
        args.requests, args.prompt_len, args.new_tokens, args.repeats = [3], [8], 4, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start, t0 = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        model = make_model(QUICK if args.quick else PYTHIA_70M, Path(tmp) / "model")
        rows = [measure(model, n, s, args) for n in args.requests for s in args.prompt_len]
    body = (
        f"{cpu_run_line('prefill.py')}; {time.perf_counter() - t0:.0f} s in all, load average {load_start:.1f} at "
        f"the start and {os.getloadavg()[0]:.1f} at the end. A random Pythia-70m-shaped model in the serving engine "
        f"(in process, no HTTP); the requests are queued together, then the engine starts; greedy, "
        f"{args.new_tokens} new tokens each, prompts from the longest down to 3/4 of it. *one at a time*: "
        "`prefill_batch=1`, each request prefilled by its own forward (the engine before batched prefill); "
        "*batched (default)*: the waiting requests together, right-padded, at most 256 padded tokens a forward on the "
        "CPU; *all in one*: every waiting request in one forward (what the accelerator default of 8192 tokens does "
        "here). TTFT: from the start to a "
        "request's first token; *all done*: until the last request's last token; tok/s: completion tokens over that "
        f"time. Medians of {args.repeats} runs per side, the sides taking turns; every side first checked to give "
        "each request generate's tokens for it alone. Ratios > 1 favour the side over one at a time.\n\n"
        + table(rows)
        + "\n"
    )
    publish(SECTION, body, args.write)


if __name__ == "__main__":
    main()
