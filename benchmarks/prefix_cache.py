"""Prefix caching in the serving engine: time to first token for requests that share a long system
prompt, the cache on vs off.

A random Pythia-70m-shaped model (GPT-NeoX config built in transformers, loaded by lmforge) in the
engine that `lmforge serve` runs (lmforge.inference.engine), in this process, without HTTP, fp32.
Every request is a --system-len-token system prompt, the same for all, then a user turn of its own
(--user-len tokens, down to half of it), greedy, --new-tokens each (eos off). Two patterns:
*one after another* (each request submitted when the previous has finished: a chat service's
steady traffic) and *together* (all queued at once, the engine started after). Each side runs on an
engine already started and warmed by one request with the same system prompt (a server that has
been up a while): with the cache on, that request left the system prompt's blocks in the pool.
TTFT: submit to the first event, mean over the requests (median of --repeats runs, the sides taking
turns). Before timing, both sides must give every request the same tokens, and the cache-on side
must have read the system prompt from the cache. `--help` lists the options.
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
from prefill import PYTHIA_70M, QUICK, IdTokenizer, make_model  # benchmarks/prefill.py
from report import cpu_run_line, publish  # benchmarks/report.py

from lmforge.inference.engine import Engine, EngineConfig, RequestParams
from lmforge.inference.sampling import SamplingParams

SECTION = "## Serving engine: prefix caching"
SIDES = {"cache off": dict(prefix_cache=False), "cache on (default)": {}}


def prompts_for(
    n: int, system_len: int, user_len: int, vocab: int, shared: bool = True
) -> list[list[int]]:
    """n + 1 prompts (the first warms the engine): a system prompt, the same for all where
    `shared`, then a user turn of each one's own."""
    gen = torch.Generator().manual_seed(system_len)
    system = torch.randint(1, vocab, (system_len,), generator=gen).tolist()
    lengths = [user_len - (i * user_len // 2) // max(1, n - 1) for i in range(n + 1)]
    out = []
    for k in lengths:
        if not shared:
            system = torch.randint(1, vocab, (system_len,), generator=gen).tolist()
        out.append(system + torch.randint(1, vocab, (k,), generator=gen).tolist())
    return out


class Timed:
    """Submit requests to a started engine; each one's first-event time and its tokens."""

    def __init__(self, engine: Engine, new_tokens: int):
        self.engine, self.params = engine, RequestParams(new_tokens, SamplingParams(temperature=0))

    def submit(self, prompts: list[list[int]]) -> tuple[list[float], list[list[int]]]:
        n = len(prompts)
        sent, first, done = [0.0] * n, [0.0] * n, threading.Event()
        left = [n]

        def on_event(i, event):
            if not first[i]:
                first[i] = time.perf_counter()
            if event.finish_reason is not None:
                left[0] -= 1
                if not left[0]:
                    done.set()

        reqs = []
        for i, p in enumerate(prompts):
            sent[i] = time.perf_counter()
            reqs.append(self.engine.submit(p, self.params, lambda e, i=i: on_event(i, e)))
        done.wait()
        return [f - s for f, s in zip(first, sent)], [r.output_ids for r in reqs]


def run_side(model, prompts: list[list[int]], args, settings: dict, together: bool) -> dict:
    engine = Engine(
        model,
        IdTokenizer(),
        EngineConfig(max_batch=len(prompts), max_context=args.context, **settings),
    )
    if together:  # warm with the first request, then queue the rest while the engine is stopped
        engine.start()
        Timed(engine, args.new_tokens).submit(prompts[:1])
        engine.stop()
        timed = Timed(engine, args.new_tokens)
        rest = prompts[1:]
        first, start = [0.0] * len(rest), [0.0]
        left, done = [len(rest)], threading.Event()

        def on_event(i, event):
            if not first[i]:
                first[i] = time.perf_counter() - start[0]
            if event.finish_reason is not None:
                left[0] -= 1
                if not left[0]:
                    done.set()

        reqs = [
            engine.submit(p, timed.params, lambda e, i=i: on_event(i, e))
            for i, p in enumerate(rest)
        ]
        start[0] = time.perf_counter()
        engine.start()
        done.wait()
        ttft, tokens = first, [r.output_ids for r in reqs]
    else:
        engine.start()
        timed = Timed(engine, args.new_tokens)
        timed.submit(prompts[:1])
        ttft, tokens = [], []
        for p in prompts[1:]:
            t, out = timed.submit([p])
            ttft += t
            tokens += out
    hits = engine.prefix.hit_tokens if engine.prefix is not None else 0
    engine.stop()
    return dict(ttft=statistics.mean(ttft), tokens=tokens, hits=hits)


def measure(model, together: bool, args, shared: bool = True) -> dict:
    vocab = model.config.vocab_size
    prompts = prompts_for(args.requests, args.system_len, args.user_len, vocab, shared)
    checked = {name: run_side(model, prompts, args, s, together) for name, s in SIDES.items()}
    if checked["cache off"]["tokens"] != checked["cache on (default)"]["tokens"]:
        raise SystemExit("the greedy tokens differ with the cache on and off: not benchmarking")
    want_hits = args.requests * (args.system_len // 16 * 16) if shared else 0
    hits = checked["cache on (default)"]["hits"]
    if hits < want_hits or (hits and not shared):
        raise SystemExit("the cache-on side did not read from the cache what it shares")
    runs: dict[str, list[float]] = {name: [] for name in SIDES}
    names = list(SIDES)
    for r in range(args.repeats):
        for name in names[r % 2 :] + names[: r % 2]:
            runs[name].append(run_side(model, prompts, args, SIDES[name], together)["ttft"])
    row = dict(
        pattern=("together" if together else "one after another")
        + ("" if shared else ", no prefix shared"),
        load=os.getloadavg()[0],
        **{name: statistics.median(v) for name, v in runs.items()},
    )
    print(
        f"{row['pattern']}: TTFT "
        + ", ".join(f"{k} {row[k] * 1e3:.0f} ms" for k in SIDES)
        + f"; {row['cache off'] / row['cache on (default)']:.1f}x",
        file=sys.stderr,
        flush=True,
    )
    return row


def table(rows: list[dict], args) -> str:
    lines = [
        "| requests | pattern | TTFT mean ms, cache off | TTFT mean ms, cache on | off / on | load |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        off, on = r["cache off"], r["cache on (default)"]
        lines.append(
            f"| {args.requests} | {r['pattern']} | {off * 1e3:.0f} | {on * 1e3:.0f} | "
            f"**{off / on:.1f}x** | {r['load']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=8, help="requests timed per side and pattern")
    p.add_argument("--system-len", type=int, default=1024, help="shared system prompt, tokens")
    p.add_argument("--user-len", type=int, default=32, help="each request's own turn, tokens")
    p.add_argument("--new-tokens", type=int, default=8)
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
        args.requests, args.system_len, args.user_len, args.new_tokens, args.repeats = (
            3,
            64,
            8,
            2,
            1,
        )
    shape = QUICK if args.quick else PYTHIA_70M
    args.context = min(shape["max_position_embeddings"], args.system_len + args.user_len + 64)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start, t0 = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        model = make_model(shape, Path(tmp) / "model")
        rows = [measure(model, together, args) for together in (False, True)]
        rows.append(measure(model, False, args, shared=False))
    body = (
        f"{cpu_run_line('prefix_cache.py')}; {time.perf_counter() - t0:.0f} s in all, load average "
        f"{load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end. A random "
        "Pythia-70m-shaped model in the serving engine (in process, no HTTP); every request is the "
        f"same {args.system_len}-token system prompt and a user turn of its own ({args.user_len} "
        f"tokens down to half of it), greedy, {args.new_tokens} new tokens. Each side's engine is "
        "started and warmed first by one request with the same system prompt; *one after another*: "
        "each request submitted when the previous one has finished; *together*: all queued at once "
        "(the CPU's 256-token prefill budget then prefills them one by one); *no prefix shared*: one "
        "after another, each with a system prompt of its own (what the cache costs where it "
        "finds nothing: hashing, and keeping each prompt's blocks). TTFT: submit to the "
        f"first token, mean over the requests; medians of {args.repeats} runs per side, the sides "
        "taking turns; both sides first checked to give every request the same tokens.\n\n"
        + table(rows, args)
        + "\n"
    )
    publish(SECTION, body, args.write)


if __name__ == "__main__":
    main()
