"""Partial rotary (rotary_pct < 1): transformers' slice-and-concatenate vs lmforge's full-head
rotation.

GPT-NeoX in transformers rotates q[..., :r] and concatenates q[..., r:] back; lmforge rotates
the whole (permuted) head with cos = 1, sin = 0 on the pass-through dims (lmforge/models/rope.py).
Both are timed side by side on the same inputs, interleaved so that load on the machine hits
both alike, after checking that they give the same attention scores. `--help` lists the options.
"""

import argparse
import datetime
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from report import BENCHMARKS_MD, write_block  # benchmarks/report.py

from lmforge.models.config import ModelConfig
from lmforge.models.rope import RotaryEmbedding, apply_rotary, rotary_permutation

SECTION = "## Partial rotary: full-head rotation vs slicing"
HEAD_DIMS = {64: "Pythia-70m…410m", 128: "Pythia-1.4b/6.9b/12b"}
ROTARY_PCT = 0.25
INTRO = f"""\
q and k of shape (batch, heads, seq, head_dim), rotary_pct {ROTARY_PCT}. *slice* is transformers' GPT-NeoX way
(rotate `x[..., :r]`, `torch.cat` with `x[..., r:]`); *full* is `lmforge.models.rope.apply_rotary` over the
whole permuted head (cos = 1, sin = 0 on the pass-through dims). Full does 4x the multiply-adds of slice at
this rotary_pct in exchange for no strided slices and no concatenation of the pass-through dims. Before
timing, the script asserts that both give the same fp32 attention scores q·kᵀ. The two take turns, block by
block; times are medians over the blocks, and slice/full is the median of the per-block ratios (robust to
other load on the machine): > 1 means full-head is faster.
"""


def neox_cos_sin(position_ids: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype):
    """cos/sin over the rotary dims only, as GPT-NeoX builds them: (batch, 1, seq, rotary_dim)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_slice(q, k, cos, sin):
    """Reference: rotate the first r dims of each head, pass the rest through, concatenate."""
    r, out = cos.shape[-1], []
    for x in (q, k):
        x_rot, x_pass = x[..., :r], x[..., r:]
        rotated_half = torch.cat((-x_rot[..., r // 2 :], x_rot[..., : r // 2]), dim=-1)
        out.append(torch.cat((x_rot * cos + rotated_half * sin, x_pass), dim=-1))
    return out


def rope_full(q, k, cos, sin):
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def timed_call(fn, inputs: tuple, grads: list | None):
    """fn(*inputs), then with grads the backward pass into q and k (inputs[:2])."""
    return (
        (lambda: fn(*inputs))
        if grads is None
        else (lambda: torch.autograd.grad(fn(*inputs), inputs[:2], grads))
    )


def paired_times(fns, sync, repeats: int, inner: int) -> list[list[float]]:
    """Seconds per call of each fn in every repeat; the fns take turns, so a repeat's times are a
    fair pair."""
    for fn in fns * 3:  # warm-up
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, t in zip(fns, times, strict=True):
            sync()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            t.append((time.perf_counter() - start) / inner)
    return times


def run(args, device: torch.device) -> list[dict]:
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    b, h, s, rows = args.batch, args.heads, args.seq, []
    for head_dim in HEAD_DIMS:
        cfg = ModelConfig(
            family="gpt_neox",
            vocab_size=128,
            hidden_size=h * head_dim,
            num_layers=1,
            num_heads=h,
            rotary_pct=ROTARY_PCT,
        )
        r, perm = (
            cfg.rotary_dim,
            rotary_permutation(head_dim, cfg.rotary_dim, interleaved=False).to(device),
        )
        position_ids = torch.arange(s, device=device).expand(b, s)
        rope = RotaryEmbedding(cfg).to(device)
        gen = torch.Generator(device).manual_seed(0)
        q32, k32 = (torch.randn(b, h, s, head_dim, device=device, generator=gen) for _ in range(2))

        # Equal work: full-head on the permuted q/k must give the slice way's attention scores.
        qs, ks = rope_slice(q32, k32, *neox_cos_sin(position_ids, r, cfg.rotary_base, torch.float))
        qf, kf = rope_full(q32[..., perm], k32[..., perm], *rope(position_ids, torch.float))
        torch.testing.assert_close(
            qf @ kf.transpose(-1, -2), qs @ ks.transpose(-1, -2), rtol=1e-5, atol=1e-4
        )
        torch.testing.assert_close(qf, qs[..., perm], rtol=0, atol=1e-6)

        for dtype in (torch.float32, torch.bfloat16):
            cos_r, sin_r = neox_cos_sin(position_ids, r, cfg.rotary_base, dtype)
            cos_f, sin_f = rope(position_ids, dtype)
            for backward in (False, True):
                q, k = (x.detach().to(dtype).requires_grad_(backward) for x in (q32, k32))
                qp, kp = (x[..., perm].detach().requires_grad_(backward) for x in (q, k))
                grads = [torch.randn_like(q), torch.randn_like(k)] if backward else None
                for compiled in [False, True] if args.compile else [False]:
                    torch.compiler.reset()  # each (shape, dtype, grad) gets its own fresh graph
                    fs, ff = (
                        torch.compile(f, dynamic=False) if compiled else f
                        for f in (rope_slice, rope_full)
                    )
                    # Every configuration (compiled, bf16) is checked against the other way too.
                    out_s, out_f = fs(q, k, cos_r, sin_r)[0], ff(qp, kp, cos_f, sin_f)[0]
                    torch.testing.assert_close(out_f, out_s[..., perm])
                    calls = [
                        timed_call(fs, (q, k, cos_r, sin_r), grads),
                        timed_call(ff, (qp, kp, cos_f, sin_f), grads),
                    ]
                    t_slice, t_full = paired_times(calls, sync, args.repeats, args.inner)
                    ms = [statistics.median(t) * 1e3 for t in (t_slice, t_full)]
                    ratio = statistics.median(
                        ts / tf for ts, tf in zip(t_slice, t_full, strict=True)
                    )
                    rows.append(
                        dict(
                            head_dim=head_dim,
                            r=r,
                            dtype=str(dtype).removeprefix("torch."),
                            pass_="fwd+bwd" if backward else "fwd",
                            mode="compile" if compiled else "eager",
                            slice_ms=ms[0],
                            full_ms=ms[1],
                            ratio=ratio,
                        )
                    )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| head_dim (rotary dims) | dtype | pass | mode | slice ms | full ms | slice/full |",
        "| --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for x in rows:
        lines.append(
            f"| {x['head_dim']} ({x['r']}), {HEAD_DIMS[x['head_dim']]} | {x['dtype']} | {x['pass_']} | "
            f"{x['mode']} | {x['slice_ms']:.3f} | {x['full_ms']:.3f} | **{x['ratio']:.2f}** |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """One line per (mode, pass): where each way wins, from the numbers just measured."""
    out = []
    for mode in dict.fromkeys(x["mode"] for x in rows):
        for pass_ in ("fwd", "fwd+bwd"):
            sel = [x for x in rows if x["mode"] == mode and x["pass_"] == pass_]
            wins = [f"{x['dtype']}/{x['head_dim']}" for x in sel if x["ratio"] > 1]
            ratios = ", ".join(f"{x['ratio']:.2f}" for x in sel)
            where = f"full-head faster for {', '.join(wins)}" if wins else "slice faster everywhere"
            out.append(f"- {mode} {pass_}: {where} (slice/full {ratios})")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--inner", type=int, default=5, help="calls per timed block")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="eager only")
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "cuda" and torch.cuda.is_available() else "cpu")
    if device.type != args.device:
        print(
            f"--device cuda: CUDA is not available (torch {torch.__version__}); falling back to CPU."
        )
    # glibc tuning
    malloc = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")]
    if device.type == "cuda":
        machine, label = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}", "CUDA"
    else:
        cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        machine = f"{cpu.group(1) if cpu else 'unknown CPU'}, {torch.get_num_threads()} threads"
        label = ", ".join(["CPU", f"{torch.get_num_threads()} threads", *malloc])
    t0 = time.perf_counter()
    rows = run(args, device)
    command = " ".join([*malloc, "python", "benchmarks/rotary.py", *sys.argv[1:]])
    body = (
        f"Command: `{command}`. {machine}, torch {torch.__version__}, {datetime.date.today()}; "
        f"batch {args.batch}, heads {args.heads}, seq {args.seq}; "
        f"median of {args.repeats} x {args.inner} calls; {time.perf_counter() - t0:.0f} s in all, "
        f"load average {os.getloadavg()[0]:.1f} at the end.\n\n"
        f"{table(rows)}\n\n{summary(rows)}\n"
    )
    print(body)
    if args.write:
        write_block(SECTION, INTRO, label, body)
        print(f"wrote '{SECTION}' ({label}) to {BENCHMARKS_MD}")


if __name__ == "__main__":
    main()
