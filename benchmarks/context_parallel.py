"""Context parallelism on the CPU: per-rank memory and step time of causal attention over one long
sequence split over C = 1, 2, 4 gloo processes (lmforge.parallel.context), both methods, against one
process's attention (lmforge.models.attention: SDPA's CPU kernel).

Tiny heads (grouped-query: 4 query heads over 2 key/value heads of 16 dims), fp32, one sequence of
--seq tokens; a step is the attention's forward and backward (the loss: the output times fixed
weights, summed). Per rank: the bytes autograd saves for the backward (exact: counted through
saved_tensors_hooks), the growth of the process's peak resident memory over the step (ru_maxrss,
under MALLOC_MMAP_THRESHOLD_=65536 so that freed memory leaves; the transient blocks included), and
the step time (the slowest rank's, median of --repeats). Every configuration starts fresh processes,
one thread each. The outputs of every C are checked equal to the one process's first. `--help` lists
the options.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from report import cpu_run_line, publish  # benchmarks/report.py

SECTION = "## Context parallelism: attention over one long sequence split across processes (CPU)"
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


def inputs(seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(1, HEADS, seq, HEAD_DIM, generator=gen),
        "k": torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=gen),
        "v": torch.randn(1, KV_HEADS, seq, HEAD_DIM, generator=gen),
        "w": torch.randn(1, HEADS, seq, HEAD_DIM, generator=gen),
    }


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def measure(step, repeats: int) -> dict:
    """Saved bytes and peak-memory growth of the first step, times of `repeats` more."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    before = rss_kib()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    growth = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"saved": sum(saved.values()), "peak_growth": growth * 1024, "times": times, "out": out}


def single(seq: int, repeats: int, out: str) -> None:
    from lmforge.models.attention import attention

    torch.set_num_threads(1)
    x = inputs(seq)

    def step():
        q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
        y = attention(q, k, v, None, True, None, None, 0.0)
        (y * x["w"]).sum().backward()
        return y.detach()

    r = measure(step, repeats)
    torch.save(r.pop("out"), out + ".pt")
    Path(out).write_text(json.dumps([r]))


def rank_worker(
    rank: int, context: int, method: str, seq: int, repeats: int, port: int, out: str
) -> None:
    from lmforge.parallel.context import ContextShard, gather_sequence, split_sequence
    from lmforge.parallel.context_attention import ContextPlan, context_attention

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=context)
    shard = ContextShard.of()
    x = {n: split_sequence(t, shard, 2) for n, t in inputs(seq).items()}
    plan = ContextPlan(None, context, rank, seq // (2 * context), None)

    def step():
        q, k, v = (x[n].clone().requires_grad_() for n in "qkv")
        y = context_attention(q, k, v, plan, method)
        (y * x["w"]).sum().backward()
        return y.detach()

    r = measure(step, repeats)
    whole = gather_sequence(r.pop("out"), shard, 2)
    results = [None] * context
    dist.all_gather_object(results, r)
    if rank == 0:
        torch.save(whole, out + ".pt")
        Path(out).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    context: int, method: str | None, seq: int, repeats: int, tmp: Path
) -> tuple[list[dict], torch.Tensor]:
    out = str(tmp / f"{context}-{method}.json")
    if method is None:
        proc = mp.get_context("spawn").Process(target=single, args=(seq, repeats, out))
        proc.start()
        proc.join()
    else:
        mp.spawn(
            rank_worker, args=(context, method, seq, repeats, free_port(), out), nprocs=context
        )
    return json.loads(Path(out).read_text()), torch.load(out + ".pt")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192, help="sequence length (a multiple of 8)")
    p.add_argument(
        "--contexts", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes C"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (median)")
    p.add_argument("--write", action="store_true", help="put the table into BENCHMARKS.md")
    args = p.parse_args()
    torch.set_num_threads(1)  # as every process measured runs
    # Every allocation over 64 KiB its own mapping, returned when freed: peak RSS then follows the
    # live tensors, not glibc's heap, which keeps what it freed (the processes measured inherit it).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ref_ranks, ref = run(1, None, args.seq, args.repeats, Path(tmp))
        configs = [
            (c, m) for c in args.contexts for m in (("ring", "allgather") if c > 1 else ("ring",))
        ]
        results = {cfg: run(*cfg, args.seq, args.repeats, Path(tmp)) for cfg in configs}
    base = statistics.median(ref_ranks[0]["times"])
    rows.append(("one process (SDPA)", "-", ref_ranks[0], base, 0.0))
    for (c, m), (ranks, out) in results.items():
        slowest = statistics.median(max(ts) for ts in zip(*(r["times"] for r in ranks)))
        worst = max(ranks, key=lambda r: r["peak_growth"])
        diff = (out - ref).abs().max().item()
        rows.append((f"C={c}", m if c > 1 else "- (own blocks)", worst, slowest, diff))
    mib = 2**20
    lines = [
        "| layout | method | saved for backward, MiB/rank | peak RSS growth, MiB/rank | s/step | vs one process"
        " | max abs diff |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for layout, method, r, t, diff in rows:
        lines.append(
            f"| {layout} | {method} | {r['saved'] / mib:.2f} | {r['peak_growth'] / mib:.1f} | {t:.2f} | "
            f"{t / base:.2f}x | {diff:.1e} |"
        )
    body = (
        f"{cpu_run_line('context_parallel.py')}; one sequence of {args.seq} tokens, {HEADS} query heads over "
        f"{KV_HEADS} key/value heads of {HEAD_DIM}, causal, fp32; a step: attention forward + backward; every "
        f"layout in fresh processes of one thread each, MALLOC_MMAP_THRESHOLD_=65536; time: the slowest rank, "
        f"median of {args.repeats}; "
        f"{time.perf_counter() - started:.0f} s in all, load average {os.getloadavg()[0]:.1f} at the end.\n\n"
        + "\n".join(lines)
    )
    publish(SECTION, body, args.write)


if __name__ == "__main__":
    main()
