"""The training path on the device: the Trainer in every precision, eager and compiled; resume;
export-hf; the exported tokenizer and served text; two ranks on one device through torchrun."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from gpu_checks.base import ROOT, Context, Skip, check, free
from lmforge.devices import max_memory_allocated, reset_peak_memory_stats

NEOX_TOKENIZER = "tokenizers/gpt-neox-20b/20B_tokenizer.json"


def corpus(ctx: Context) -> Path:
    """Arithmetic sequences mod 64: a model learns within a few steps which tokens occur (then
    what comes next), so the loss must fall."""

    def make():
        import numpy as np

        from lmforge.data.indexed import IndexedDatasetWriter

        prefix = ctx.tmp / "corpus" / "arith_text_document"
        prefix.parent.mkdir()
        rng = np.random.default_rng(0)
        with IndexedDatasetWriter(prefix, np.uint16) as writer:
            for _ in range(300 if ctx.quick else 3000):
                n, start, step = rng.integers(5, 400), rng.integers(0, 1000), rng.integers(1, 5)
                writer.add_document((start + step * np.arange(n)) % 64)
        return prefix

    return ctx.once("corpus", make)


def tokenizer_file(ctx: Context) -> Path:
    path = ctx.shared_data / NEOX_TOKENIZER
    if not path.is_file():
        raise Skip(f"no GPT-NeoX tokenizer at {path} (set --shared-data or LMFORGE_SHARED_DATA)")
    return path


def overrides(ctx: Context, run_dir: Path, steps: int, *extra: str, big: bool = True) -> list[str]:
    """A run of the Pythia-160m shape (2 layers and 256 tokens unless `big`), or tiny-neox under
    --quick."""
    if ctx.quick:
        model, seq, lr = ["model.preset=tiny-neox"], 32, 3e-3
    elif big:
        model, seq, lr = ["model.preset=pythia-160m"], 1024, 1e-3
    else:
        model, seq, lr = ["model.preset=pythia-160m", "model.num_layers=2"], 256, 1e-3
    return [
        *model,
        f"data.paths=[{corpus(ctx)}]",
        f"data.seq_length={seq}",
        f"trainer.max_steps={steps}",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",
        "trainer.val_check_interval=0",
        "trainer.progress_bar=false",
        f"optim.lr={lr}",
        "optim.warmup_steps=3",
        f"trainer.device={ctx.device}",
        f"trainer.compile_cache_dir={ctx.tmp / 'compile-cache'}",
        f"run_dir={run_dir}",
        *cpu_peak(ctx),
        *extra,
    ]


def cpu_peak(ctx: Context) -> list[str]:
    """A CPU's peak is measured at the first step unless given (seconds); an accelerator's is its
    datasheet's."""
    return ["cost.peak_flops=1e12"] if ctx.device.type == "cpu" else []


def train(ctx: Context, args: list[str]) -> tuple[object, list[dict]]:
    """Run the Trainer in this process: (the trainer, its metrics.jsonl rows)."""
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    trainer = Trainer(load_run_config(None, args))
    trainer.fit()
    rows = [
        json.loads(line)
        for line in (Path(trainer.cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    return trainer, rows


def _neighbours_missed(got: torch.Tensor, want: torch.Tensor) -> int:
    """How many bf16 values of `got` are not one of the two bf16 neighbours of fp32 `want`."""
    down = want.view(torch.int32).bitwise_and(-65536).view(torch.float32)  # toward zero, in bf16
    up = torch.nextafter(down.bfloat16(), want.sign().bfloat16() * float("inf")).float()
    return int(((got.float() != down) & (got.float() != up)).sum())


@check
def check_optimizer(ctx: Context) -> tuple[str, dict]:
    """bf16-sr's AdamWSR on the device, its compiled update (on a GPU: the multi-tensor Triton
    kernel, and torch.compile's kernel called per tensor) and its eager one: each result torch's
    fp32 AdamW rounded to one of its two bf16 neighbours (a compiled kernel's division and square
    root may differ by an fp32 ulp: at most 1 in 10,000 values elsewhere), their step times
    beside fused fp32 AdamW's, and on a GPU how many values differ from the CPU's eager update
    (the multi-tensor kernel's IEEE arithmetic should give its bits: expected 0)."""
    from lmforge.train.optim import AdamWSR

    n = 1 << 16 if ctx.quick else 1 << 24
    # a matrix, odd lengths, a scalar-like vector
    shapes = [(n // 256, 256), (n // 4 + 3,), (4097,), (1,)]
    gen = torch.Generator(ctx.device).manual_seed(0)
    w, g, m = (
        [torch.randn(s, device=ctx.device, generator=gen).bfloat16() for s in shapes]
        for _ in range(3)
    )
    v = [torch.rand(s, device=ctx.device, generator=gen).bfloat16() for s in shapes]
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def make(dtype, **extra):
        params = [torch.nn.Parameter(x.to(dtype, copy=True)) for x in w]
        for p, x in zip(params, g, strict=True):
            p.grad = x.to(dtype, copy=True)
        opt = (
            AdamWSR(params, **kw, **extra)
            if dtype == torch.bfloat16
            else torch.optim.AdamW(params, **kw, **extra)
        )
        # fused: its own state
        for p, a, b in zip(params, m, v, strict=True) if "fused" not in extra else ():
            opt.state[p] = {
                "step": torch.tensor(1.0),
                "exp_avg": a.to(dtype, copy=True),
                "exp_avg_sq": b.to(dtype, copy=True),
            }
        return params, opt

    ways = {"eager": dict(compiled=False)}
    # the CPU's C++ loop builds for ~1 min on a fresh machine
    if not (ctx.quick and ctx.device.type == "cpu"):
        # on a GPU with Triton: the multi-tensor kernel, one launch per group
        ways["compiled"] = dict(compiled=True)
    if ctx.device.type != "cpu":
        # torch.compile's kernel, a call each
        ways["compiled per tensor"] = dict(compiled=True, multi_tensor=False)
    ref, ref_opt = make(torch.float32, foreach=False)
    ref_opt.step()
    want = [
        t
        for p in ref
        for t in (p.detach(), ref_opt.state[p]["exp_avg"], ref_opt.state[p]["exp_avg_sq"])
    ]
    missed, times, cpu_bits = {}, {}, {}
    cpu = None
    # the CPU's eager update on the same values: the bits the C++ loop gives
    if ctx.device.type != "cpu":
        cpu_params = [torch.nn.Parameter(x.to("cpu", copy=True)) for x in w]
        for p, x in zip(cpu_params, g, strict=True):
            p.grad = x.cpu()
        cpu_opt = AdamWSR(cpu_params, **kw, compiled=False)
        for p, a, b in zip(cpu_params, m, v, strict=True):
            cpu_opt.state[p] = {
                "step": torch.tensor(1.0),
                "exp_avg": a.to("cpu", copy=True),
                "exp_avg_sq": b.to("cpu", copy=True),
            }
        cpu_opt.step()
        cpu = [
            t
            for p in cpu_params
            for t in (p.detach(), cpu_opt.state[p]["exp_avg"], cpu_opt.state[p]["exp_avg_sq"])
        ]
    for name, extra in {**ways, "fused fp32": dict(fused=True)}.items():
        params, opt = make(torch.float32 if name == "fused fp32" else torch.bfloat16, **extra)
        opt.step()  # the first: compiles
        if name != "fused fp32":
            got = [
                t
                for p in params
                for t in (p.detach(), opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])
            ]
            missed[name] = sum(_neighbours_missed(a, b) for a, b in zip(got, want, strict=True))
            # the multi-tensor kernel's IEEE arithmetic should give them exactly
            if cpu is not None:
                cpu_bits[name] = sum(
                    int((a.cpu().view(torch.int16) != b.view(torch.int16)).sum())
                    for a, b in zip(got, cpu, strict=True)
                )
            if getattr(opt, "_multi_failed", False) or getattr(opt, "_compile_failed", False):
                raise AssertionError(
                    f"{name}: the compiled update failed and the step fell back (see the warning)"
                )
        for _ in range(3):
            opt.step()
        sync = torch.cuda.synchronize if ctx.device.type == "cuda" else lambda: None
        sync()
        start = time.perf_counter()
        for _ in range(5):
            opt.step()
        sync()
        times[name] = (time.perf_counter() - start) / 5
    total = 3 * sum(x.numel() for x in w)
    bad = [
        f"{name}: {k} of {total} values not a bf16 neighbour of fp32 AdamW's"
        for name, k in missed.items()
        if k > (0 if name == "eager" and ctx.device.type == "cpu" else total // 10_000)
    ]
    if bad:
        raise AssertionError("; ".join(bad))
    note = (
        ""
        if "compiled" in ways
        else " (the compiled CPU loop left out under --quick: tests/train cover it)"
    )
    steps = ", ".join(f"{name} {1e3 * t:.2f} ms" for name, t in times.items())
    same = ""
    if cpu_bits:
        same = "; values unlike the CPU's eager bits: " + ", ".join(
            f"{k} {n}" for k, n in cpu_bits.items()
        )
    return (
        f"{total // 3:,} bf16 parameters: results fp32 AdamW's bf16 neighbours ("
        + ", ".join(f"{name}: {k} missed" for name, k in missed.items())
        + f"); step {steps}{note}{same}",
        {"missed": missed, "step_s": times, "parameters": total // 3, "unlike_cpu_bits": cpu_bits},
    )


@check
def check_train(ctx: Context) -> tuple[str, dict]:
    steps = 12 if ctx.quick else 30
    fig, bad, first = {}, [], {}
    for precision in ("fp32", "bf16-mixed", "bf16-sr"):
        for compiled in (False, True):
            name = f"{precision}{' compiled' if compiled else ''}"
            run_dir = ctx.tmp / f"train-{precision}-{compiled}"
            reset_peak_memory_stats(ctx.device)
            start = time.perf_counter()
            trainer, rows = train(
                ctx,
                overrides(
                    ctx,
                    run_dir,
                    steps,
                    f"trainer.precision={precision}",
                    f"trainer.compile={str(compiled).lower()}",
                    f"trainer.compile_backend={ctx.compile_backend}",
                ),
            )
            seconds = time.perf_counter() - start
            losses = [r["loss"] for r in rows]
            k = max(2, steps // 6)
            head, tail = sum(losses[:k]) / k, sum(losses[-k:]) / k
            peak = max_memory_allocated(ctx.device)
            fig[name] = {
                "losses": losses,
                "seconds": seconds,
                "step_time": sorted(r["step_time"] for r in rows)[len(rows) // 2],
                "peak_gib": peak / 2**30 if peak is not None else None,
                "skipped_steps": trainer.state["skipped_steps"],
            }
            del trainer
            free(ctx)
            shutil.rmtree(run_dir)
            if (
                len(losses) != steps
                or not all(map(math.isfinite, losses))
                or fig[name]["skipped_steps"]
            ):
                bad.append(f"{name}: non-finite or skipped steps {losses}")
            elif tail > head - 0.05 * abs(head):  # at least 5% lower over the run
                bad.append(f"{name}: loss did not fall ({head:.3f} -> {tail:.3f})")
            first.setdefault(precision, losses[0])
            rtol = 1e-4 if precision == "fp32" else 2e-2
            if compiled and abs(losses[0] - first[precision]) > rtol * abs(first[precision]):
                bad.append(f"{name}: first loss {losses[0]:.6f} vs eager {first[precision]:.6f}")
    if bad:
        raise AssertionError("; ".join(bad))
    shape = "tiny-neox (--quick)" if ctx.quick else "Pythia-160m shape, 8 x 1024 tokens"
    runs = ", ".join(
        f"{n} {v['losses'][0]:.2f}->{v['losses'][-1]:.2f}"
        + (
            f" ({1e3 * v['step_time']:.0f} ms/step, {v['peak_gib']:.1f} GiB)"
            if v["peak_gib"] is not None
            else ""
        )
        for n, v in fig.items()
    )
    return f"{shape}, {steps} steps: {runs}; compiled ({ctx.compile_backend}) step 1 = eager", fig


def short_run(ctx: Context) -> tuple[Path, list[dict], list[str]]:
    """A finished run with a checkpoint at its middle and its export (the tokenizer in it when
    there is one): (run folder, metrics rows, its overrides but run_dir)."""

    def make():
        steps = 8 if ctx.quick else 12
        try:  # tiny-neox's 1000 tokens cannot hold the tokenizer's
            tok = [f"data.tokenizer={tokenizer_file(ctx)}", "model.vocab_size=50304"]
        except Skip:
            tok = []
        run_dir = ctx.tmp / "short-run"
        args = overrides(
            ctx,
            run_dir,
            steps,
            "trainer.precision=fp32",
            f"checkpoint.every_n_steps={steps // 2}",
            "checkpoint.save_top_k=-1",
            "checkpoint.convert_to_hf=true",
            *tok,
            big=False,
        )
        trainer, rows = train(ctx, args)
        del trainer
        free(ctx)
        return run_dir, rows, [a for a in args if not a.startswith("run_dir=")]

    return ctx.once("short_run", make)


@check
def check_resume(ctx: Context) -> tuple[str, dict]:
    whole, rows, args = short_run(ctx)
    cut = ctx.tmp / "resumed"
    shutil.copytree(whole, cut, ignore=shutil.ignore_patterns("hf", "model"))
    checkpoints = sorted((cut / "checkpoints").glob("step-*"))
    middle = len(rows) // 2
    assert [p.name for p in checkpoints] == [f"step-{middle:08d}", f"step-{len(rows):08d}"], (
        checkpoints
    )
    shutil.rmtree(checkpoints[-1])  # as if the run had been killed after its middle checkpoint
    trainer, resumed = train(ctx, [*args, f"run_dir={cut}", "checkpoint.convert_to_hf=false"])
    assert trainer.state["step"] == len(rows)
    del trainer
    free(ctx)
    assert [r["step"] for r in resumed] == [r["step"] for r in rows], (
        "the resumed run's steps differ"
    )
    diff = max(
        abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(resumed[middle:], rows[middle:])
    )
    exact = all(
        a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] for a, b in zip(resumed, rows)
    )
    # The CPU is bit exact (tests/train/test_resume.py); CUDA kernels may sum in another order
    # (atomics).
    assert diff <= (0 if ctx.device.type == "cpu" else 1e-4), (
        f"resumed losses differ by {diff:.2e} (relative)"
    )
    return (
        f"restarted from its step-{middle} checkpoint: steps {middle + 1}-{len(rows)} = the uninterrupted run's "
        f"{'bit for bit' if exact else f'within {diff:.1e} (relative)'}"
    ), {"max_rel_diff": diff, "exact": exact}


@check
def check_export(ctx: Context) -> tuple[str, dict]:
    import transformers as tf

    from lmforge.models import load_pretrained

    run_dir, _, _ = short_run(ctx)
    ref, info = tf.AutoModelForCausalLM.from_pretrained(
        run_dir / "hf", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ref = ref.to(ctx.device).eval()
    ours = load_pretrained(run_dir / "model", device=ctx.device)
    ids = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(3)).to(ctx.device)
    with torch.no_grad():
        expected = ref(ids).logits
        diff = (ours(ids) - expected).abs().max().item()
    assert diff <= ctx.fp32_tol * max(1.0, expected.abs().max().item()), (
        f"logits of the export differ by {diff:.2e}"
    )
    return f"{type(ref).__name__} on {ctx.device}: logits max |diff| {diff:.1e} vs lmforge", {
        "max_abs_diff": diff
    }


@check
def check_text(ctx: Context) -> tuple[str, dict]:
    import transformers as tf

    from lmforge.inference import generate_text
    from lmforge.inference.engine import Engine, EngineConfig, RequestParams
    from lmforge.inference.sampling import SamplingParams
    from lmforge.models import load_pretrained
    from lmforge.tokenizers import load_tokenizer

    tokenizer_file(ctx)  # skips without one
    run_dir, _, _ = short_run(ctx)
    texts = ["The quick brown fox", "def main():\n    return 0", "Ünïcödé, emoji 🙂 and\ttabs"]
    ours_tok = load_tokenizer(run_dir / "model")
    hf_tok = tf.AutoTokenizer.from_pretrained(run_dir / "hf")
    assert all(hf_tok(t)["input_ids"] == ours_tok.encode(t) for t in texts), (
        "the exported tokenizer encodes otherwise"
    )
    model = load_pretrained(run_dir / "model", device=ctx.device)
    new = 8 if ctx.quick else 24
    expected = generate_text(model, ours_tok, texts, new, do_sample=False)
    engine = Engine(model, ours_tok, EngineConfig(max_batch=2, max_context=256))
    streamed = {i: [] for i in range(len(texts))}
    for i, t in enumerate(texts):
        engine.submit(
            ours_tok.encode(t),
            RequestParams(new, SamplingParams(temperature=0)),
            lambda e, i=i: streamed[i].append(e.text),
        )
    while engine.step():
        pass
    served = ["".join(streamed[i]) for i in range(len(texts))]
    assert served == expected, f"served text {served} != generate_text {expected}"
    return (
        f"export's tokenizer = AutoTokenizer's on {len(texts)} texts; streamed text of {len(texts)} requests "
        f"= generate_text"
    ), {"served": served}


@check
def check_two_ranks(ctx: Context) -> tuple[str, dict]:
    steps = 6
    _, alone = train(
        ctx, overrides(ctx, ctx.tmp / "one-rank", steps, "trainer.precision=fp32", big=False)
    )
    free(ctx)
    # Two processes on one GPU: trainer.device holds an index (cuda:0), which wins over each rank's
    # LOCAL_RANK; NCCL refuses two ranks on one device, so the group is gloo, which takes CUDA
    # tensors too.
    device = str(ctx.device)
    backend = ["trainer.dist_backend=gloo"] if ctx.device.type != "cpu" else []
    run_dir = ctx.tmp / "two-ranks"
    args = overrides(ctx, run_dir, steps, "trainer.precision=fp32", *backend, big=False)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "lmforge.cli",
        "pretrain",
        os.devnull,
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise AssertionError(f"torchrun exited {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    diff = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(rows, alone))
    assert len(rows) == steps and diff <= ctx.fp32_tol, (
        f"2 ranks vs 1 process: losses differ by {diff:.2e}"
    )
    how = f"trainer.device={device}" + (
        ", trainer.dist_backend=gloo: NCCL refuses 2 ranks on 1 GPU" if backend else ""
    )
    return (
        f"torchrun 2 processes on one device ({how}): DDP losses = 1 process within {diff:.1e}",
        {"max_rel_diff": diff, "device": device, "backend": "gloo"},
    )
