"""Load test of `lmforge serve`: many concurrent streaming completions over loopback, batched vs one
at a time.

A random Pythia-70m-shaped model (GPT-NeoX config built in transformers) with the real GPT-NeoX-20B
tokenizer is served by the real console script in a subprocess; a client process opens --requests
streams at once (`POST /v1/completions`, `stream: true`, usage in the last chunk) with prompts cut
from WikiText-2 lines. Reported per server setting: errors (a non-200 answer, an error event, or a
stream without `data: [DONE]`), time to first token and total time per request (p50/p99), and
completion tokens/s over the whole load. The same load runs against `--max-batch B` and `--max-batch
1` (each request decoded alone, in arrival order), alternating, so the ratio shows what continuous
batching buys. `--help` lists the options.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from report import publish  # benchmarks/report.py

SECTION = "## Serving: concurrent streaming requests (lmforge serve)"
SHARED = Path(
    os.environ.get("LMFORGE_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data")
)
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
    vocab_size=50304,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    rotary_pct=0.25,
    max_position_embeddings=256,
)


def make_model(shape: dict, folder: Path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    tf.GPTNeoXForCausalLM(
        tf.GPTNeoXConfig(**shape, bos_token_id=0, eos_token_id=0)
    ).save_pretrained(folder)
    shutil.copyfile(
        SHARED / "tokenizers" / "gpt-neox-20b" / "20B_tokenizer.json", folder / "tokenizer.json"
    )


def prompts(n: int, max_words: int) -> list[str]:
    lines = [
        ln.strip()
        for ln in (SHARED / "corpora" / "wikitext-2" / "valid.txt").read_text().splitlines()
        if len(ln.split()) > 12 and not ln.strip().startswith("=")
    ]
    rng = random.Random(0)
    return [" ".join(rng.choice(lines).split()[: rng.randint(8, max_words)]) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    folder: Path, max_batch: int, context: int, threads: int | None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    cmd = [
        sys.executable,
        "-m",
        "lmforge.cli",
        "serve",
        str(folder),
        "--port",
        str(port),
        "--max-batch",
        str(max_batch),
        "--max-context",
        str(context),
        "--max-queue",
        "100000",
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/ping").status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start: {proc.communicate()[0][-2000:]}")


async def one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, tokens, done, error = None, 0, False, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                elif chunk["choices"] and first is None:
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if error or not done or first is None:
        return {"error": error or "the stream ended without data: [DONE]"}
    return {"ttft": first, "total": time.perf_counter() - start, "tokens": tokens}


async def load(url: str, model: str, texts: list[str], max_tokens: int) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=len(texts) + 8, max_keepalive_connections=len(texts) + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900.0)) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, model, t, max_tokens) for t in texts))
        return results, time.perf_counter() - start


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(lmforge_engine_\w+) (\S+)$", text, re.M)
    }


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def run_once(folder: Path, max_batch: int, args, texts: list[str]) -> dict:
    proc, url = start_server(
        folder, max_batch, args.prompt_words * 2 + args.max_tokens + 16, args.threads
    )
    try:
        results, wall = asyncio.run(load(url, folder.name, texts, args.max_tokens))
        engine = scrape(url)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        print(f"  {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
    tokens = sum(r["tokens"] for r in ok)
    steps = engine.get("lmforge_engine_decode_steps_total", 0)
    row = dict(
        max_batch=max_batch,
        requests=len(results),
        errors=len(errors),
        tokens=tokens,
        wall=wall,
        tps=tokens / wall,
        ttft50=pct([r["ttft"] for r in ok], 0.5),
        ttft99=pct([r["ttft"] for r in ok], 0.99),
        total50=pct([r["total"] for r in ok], 0.5),
        total99=pct([r["total"] for r in ok], 0.99),
        mean_batch=engine.get("lmforge_engine_decoded_rows_total", 0) / steps if steps else 0.0,
    )
    print(
        f"  max-batch {max_batch}: {row['errors']} errors, {row['tps']:.1f} tok/s, TTFT p50 {row['ttft50']:.2f} s "
        f"p99 {row['ttft99']:.2f} s, total p50 {row['total50']:.2f} s p99 {row['total99']:.2f} s",
        file=sys.stderr,
    )
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| max batch | requests | errors | completion tokens | wall s | tokens/s | TTFT p50 s | TTFT p99 s | "
        "total p50 s | total p99 s | mean decode batch |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['max_batch']} | {r['requests']} | {r['errors']} | {r['tokens']} | {r['wall']:.1f} | "
            f"{r['tps']:.1f} | {r['ttft50']:.2f} | {r['ttft99']:.2f} | {r['total50']:.2f} | "
            f"{r['total99']:.2f} | {r['mean_batch']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200, help="concurrent streaming requests")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens asked per request")
    p.add_argument("--prompt-words", type=int, default=48, help="prompts are 8 to this many words")
    p.add_argument("--max-batch", type=int, default=16, help="the batched server's --max-batch")
    p.add_argument(
        "--baseline", type=int, default=1, help="the compared --max-batch (0: no comparison)"
    )
    p.add_argument(
        "--baseline-requests",
        type=int,
        default=50,
        help="requests of the baseline run (one at a time, its tokens/s does not depend on how many)",
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="alternating runs of each setting (median tokens/s)"
    )
    p.add_argument(
        "--threads", type=int, default=None, help="server torch threads (default: torch's choice)"
    )
    p.add_argument(
        "--quick", action="store_true", help="a tiny model and a small load: checks the script runs"
    )
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    if args.quick:
        if args.write:
            p.error("--quick numbers are not benchmark numbers: run without --quick to --write")
        args.requests, args.max_tokens, args.prompt_words, args.repeats, args.baseline_requests = (
            24,
            12,
            16,
            1,
            12,
        )
    if not SHARED.is_dir():
        raise SystemExit(f"needs the tokenizer and corpus in {SHARED} (set LMFORGE_SHARED_DATA)")
    texts = prompts(args.requests, args.prompt_words)
    settings = [args.max_batch] + ([args.baseline] if args.baseline else [])
    t0 = time.perf_counter()
    runs: dict[int, list[dict]] = {b: [] for b in settings}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / ("tiny-neox" if args.quick else "pythia-70m-random")
        make_model(QUICK if args.quick else PYTHIA_70M, folder)
        for _ in range(args.repeats):
            for b in settings:
                n = (
                    args.requests
                    if b == args.max_batch
                    else min(args.requests, args.baseline_requests)
                )
                runs[b].append(run_once(folder, b, args, texts[:n]))
    # the median run
    rows = [sorted(rs, key=lambda r: r["tps"])[len(rs) // 2] for rs in runs.values()]
    errors = sum(r["errors"] for rs in runs.values() for r in rs)
    cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    machine = f"{cpu.group(1) if cpu else 'unknown CPU'}, {os.cpu_count()} cores"
    ratio = ""
    if len(rows) > 1:
        ratio = (
            f" Continuous batching (max batch {rows[0]['max_batch']}) gives "
            f"**{rows[0]['tps'] / rows[1]['tps']:.1f}x** the tokens/s of max batch {rows[1]['max_batch']} "
            "(whose latencies, with another queue length, are not comparable)."
        )
    command = "python benchmarks/serve_load.py" + "".join(f" {a}" for a in sys.argv[1:])
    what = (
        "tiny GPT-NeoX (--quick)"
        if args.quick
        else "Pythia-70m shape (d 512, 6 layers, vocab 50304), random"
    )
    body = (
        f"Command: `{command}`. {what}, GPT-NeoX-20B tokenizer, served by `lmforge serve` in its own process "
        f"(fp32, CPU, torch threads: {args.threads or 'default'}); one client process opens {args.requests} "
        f"streaming `/v1/completions` requests at once over loopback (httpx), prompts of 8 to "
        f"{args.prompt_words} WikiText-2 words, max_tokens {args.max_tokens}, "
        "temperature 0.8. TTFT = request sent to first text chunk; total = to `data: [DONE]`; tokens/s = "
        "completion tokens (usage) of all requests / wall time of the whole load; mean decode batch = rows per "
        f"decode step (from /metrics). Median of {args.repeats} alternating run(s) per setting; {errors} errors "
        f"in all runs.{ratio} The client shares the CPU with the server.\n\n"
        f"{machine}, torch {torch.__version__}, {datetime.date.today()}; {time.perf_counter() - t0:.0f} s in all, "
        f"load average {os.getloadavg()[0]:.1f} at the end.\n\n{table(rows)}\n"
    )
    publish(SECTION, body, args.write)


if __name__ == "__main__":
    main()
