"""Correctness of lmforge on an accelerator: the one thing to run on a GPU machine.

    python scripts/gpu_check.py                        # on the GPU; writes gpu_check.json, prints a table
    python scripts/gpu_check.py --only parity,train    # some checks
    python scripts/gpu_check.py --device cpu --quick   # the same checks on the CPU, tiny (how the tests run it)

Needs no network: random weights; transformers models built from tests/conftest.py's hf_tiny_configs
(one per family) with room for 2048 positions and sharpened attention; the GPT-NeoX tokenizer of
../shared/data when present (--shared-data or LMFORGE_SHARED_DATA; without it the `text` check is
skipped, saying so). Each check is independent: a failure is recorded with its message and traceback
in the JSON and the others still run; the exit code is 1 if any failed. The table is what
BENCHMARKS.md shows under "GPU: correctness". The checks live in scripts/gpu_checks/:

  environment  torch/CUDA/transformers versions, the device, which SDPA kernels run on it
  parity       every family's logits vs transformers on the device at positions up to 2047 (2048 tokens;
               --quick: the last 64 positions): fp32 tight, bf16 no worse than transformers' own bf16
  generate     greedy generate, eager, compiled and static-shape under CUDA graphs (compile="reduce-overhead",
               checked not skipped), token for token vs transformers' (long prompts)
  engine       the continuous-batching engine's greedy (requests joining mid-decode) = generate alone
  optimizer    bf16-sr's AdamWSR, compiled (Triton on a GPU) and eager: each value fp32 AdamW's bf16 neighbour;
               step times beside fused fp32 AdamW
  train        a Pythia-160m shape (tiny-neox under --quick) through the Trainer: fp32, bf16-mixed,
               bf16-sr, eager and compiled: loss finite and falling, compiled step 1 = eager's
  resume       a run restarted from its middle checkpoint continues the uninterrupted run's curve
  export       the run's export-hf loads in transformers on the device, with lmforge's logits
  text         the export's tokenizer reads alike in transformers; served text = generate_text
  two_ranks    torchrun, two processes on one device (gloo on a GPU), through the real training path
  moe          a MoE layer (and expert adapters) with its experts looped and through torch's grouped GEMM on the
               device: both against an fp32 reference, and their times (moe.GROUPED_MM lists a device after it)
  plan_memory  lmforge plan's peak memory against the allocator's measured peak of the same 2-step runs: a dense
               model in each activation-checkpointing mode, a mixture of experts, LoRA (CUDA only)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

# a bare checkout
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
from gpu_checks import CHECKS, Context, Result, Skip, free, log  # noqa: E402 (scripts/gpu_checks/)
from gpu_checks.base import ROOT  # noqa: E402

from lmforge.devices import resolve_device  # noqa: E402
from lmforge.errors import UserError  # noqa: E402


def run_check(name: str, ctx: Context) -> Result:
    log(f"== {name}")
    start = time.perf_counter()
    try:
        summary, figures = CHECKS[name](ctx)
        result = Result(name, "pass", summary, 0.0, figures)
    except Skip as e:
        result = Result(name, "skip", str(e), 0.0)
    except Exception as e:  # any failure is recorded, and the other checks still run
        # The message's head (a compiler's error comes first, its log after) and where it was
        # raised.
        message = "".join(traceback.format_exception_only(e))
        frames = "".join(traceback.format_tb(e.__traceback__))
        first = next((line for line in str(e).splitlines() if line.strip()), "")[:300]
        result = Result(
            name,
            "fail",
            f"{type(e).__name__}: {first}",
            0.0,
            error=f"{frames[-3000:]}{message[:3000]}",
        )
    free(ctx)
    result.seconds = time.perf_counter() - start
    log(f"   {result.status} in {result.seconds:.0f} s: {result.summary}")
    return result


def table(results: list[Result]) -> str:
    lines = ["| check | result | figures | seconds |", "| --- | --- | --- | ---: |"]
    for r in results:
        text = r.summary.replace("|", "\\|").replace("\n", " ")
        lines.append(
            f"| {r.name} | {'**fail**' if r.status == 'fail' else r.status} | {text} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device",
        default="cuda",
        help="cuda (default), cuda:1, cpu (the same checks on the CPU) ...",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes and few steps (what the CPU test runs)"
    )
    p.add_argument("--only", default=None, help=f"comma-separated checks, of: {','.join(CHECKS)}")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("gpu_check.json"),
        help="the JSON report (default gpu_check.json)",
    )
    p.add_argument(
        "--compile-backend",
        default=None,
        help="the Trainer's compile backend in the train check "
        "(default inductor; aot_eager under --quick on the CPU, where inductor's C++ builds take minutes)",
    )
    p.add_argument(
        "--shared-data",
        type=Path,
        default=Path(os.environ.get("LMFORGE_SHARED_DATA", ROOT.parent / "shared" / "data")),
        help="folder with tokenizers/ (../shared/data)",
    )
    args = p.parse_args()
    names = (
        list(CHECKS)
        if args.only is None
        else [n.strip() for n in args.only.split(",") if n.strip()]
    )
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise SystemExit(
            f"error: --only {args.only}: unknown check {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(CHECKS)}"
        )
    try:
        device = resolve_device(args.device)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    # tiny shapes on a shared machine: one thread is the fastest
    if args.quick and device.type == "cpu":
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
    backend = args.compile_backend or (
        "aot_eager" if args.quick and device.type == "cpu" else "inductor"
    )
    started, t0 = datetime.datetime.now().isoformat(timespec="seconds"), time.perf_counter()
    command = "python scripts/gpu_check.py" + "".join(f" {a}" for a in sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []

    def write() -> dict:  # after every check: a run killed at its time limit keeps what it found
        failed = [r.name for r in results if r.status == "fail"]
        env = next(
            (r.figures for r in results if r.name == "environment" and r.status == "pass"), {}
        )
        report = {
            "command": command,
            "started": started,
            "seconds": time.perf_counter() - t0,
            "device": str(device),
            "quick": args.quick,
            "passed": not failed,
            "environment": env,
            "checks": [r.__dict__ for r in results],
        }
        args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        return report

    with tempfile.TemporaryDirectory(prefix="lmforge-gpu-check-") as tmp:
        ctx = Context(device, args.quick, Path(tmp), args.shared_data, backend)
        for name in names:
            results.append(run_check(name, ctx))
            report = write()
    failed = [r.name for r in results if r.status == "fail"]
    name = report["environment"].get("name", device.type)
    print(
        f"Command: `{command}`; {name}, torch {torch.__version__}, {datetime.date.today()}; "
        f"{report['seconds']:.0f} s in all.\n\n{table(results)}\n"
    )
    print(
        f"{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}; report in {args.out}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
