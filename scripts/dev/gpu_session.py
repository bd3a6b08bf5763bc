"""One device call that does a GPU session's work in priority order, inside a time budget.

A session lent a GPU has ~15 minutes of device time in all, the machine's start and every call
included, and a fresh machine holds none of lmforge's own dependencies. So: `bash
scripts/gpu_prepare.sh` here first (wheels and the tokenizer into .gpu/), then one call:

    run(command="python3 scripts/gpu_session.py --budget 480", carry=[".gpu"], timeout_s=540)

It installs .gpu/whl into /tmp/site, then runs the stages below one after another, each in its own
process with a time limit (its own, or what is left of --budget), and after each copies what it
wrote into $OUT, so a stage killed at its limit still returns the others' results:

    check     scripts/gpu_check.py: correctness on the device (every family's parity, generate and CUDA graphs,
              training in each precision, resume, export, serving, two ranks)  ->  gpu_check.json
    train     benchmarks/train.py --write: Pythia-1B, seq 2048, bf16: transformers eager and compiled vs lmforge
              bf16-mixed eager and compiled, bf16-sr compiled (the MFU, 1.3x and bf16-sr goals), and a kernel
              profile of one step of each compiled side (where the device time goes, how long it sat idle)
    generate  benchmarks/generate.py --write: Pythia-1B bf16 greedy decode, batch 1, lmforge eager /
              compiled / CUDA graphs vs transformers' dynamic and compiled static cache (the 2x batch-1 goal)
    moe       benchmarks/moe.py --device cuda --write: MoE layers (Mixtral's width, Qwen3-30B-A3B's 128 experts), bf16,
              lmforge's experts looped and through the grouped GEMM vs transformers' grouped_mm (the 2x goal)
    optim     benchmarks/optim.py --device cuda --write: AdamWSR vs fused AdamW at Pythia-1B's shapes
    lora      benchmarks/lora.py --device cuda --write: LoRA fine-tuning of Pythia-410M (batch 8 x 1024), a bf16 base:
              lmforge vs PEFT + transformers (the 1.2x tokens/s goal), and lmforge's QLoRA (NF4 base) row
    fp8       benchmarks/train.py --write at Pythia-1.4B: bf16-mixed vs Float8, both compiled (the 1.2x goal)
    eval      benchmarks/eval.py --device cuda --write: lmforge eval vs lm-eval's hf backend, fp32 (needs
              gpu_prepare.sh --eval: lm-eval's wheels, SST-2 and WikiText-2)

Back in $OUT: session.json (each stage's exit code, seconds, whether it hit its limit), session.log
(everything the stages printed), gpu_check.json and BENCHMARKS.md (the benchmarks' --write blocks
for the device): copy the latter over the checkout's after reading the diff. `--stages` picks and
orders stages; `--dry-run` prints the commands. Nothing here needs a GPU to be tested: `--device cpu
--quick` runs the same flow on tiny shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITE = Path("/tmp/site")


def stages(device: str, quick: bool, only: str | None = None) -> dict[str, tuple[list[str], int]]:
    """name -> (command, its own time limit in seconds); `only`: the check stage's checks
    (gpu_check.py --only)."""
    py = sys.executable
    q = ["--quick"] if quick else []
    write = [] if quick else ["--write"]
    return {
        "check": (
            [
                py,
                "scripts/gpu_check.py",
                "--device",
                device,
                "--out",
                "{out}/gpu_check.json",
                *q,
                *(["--only", only] if only else []),
            ],
            300,
        ),
        # The goals' sides only (fp8 is a stage of its own), 5 steps each: one device call must also
        # hold the check.
        "train": (
            [
                py,
                "benchmarks/train.py",
                "--device",
                device,
                *q,
                *write,
                "--repeats",
                "1" if quick else "5",
                "--sides",
                "hf,hf-compile,bf16-mixed,bf16-mixed-compile,bf16-sr-compile",
            ],
            300,
        ),
        "generate": (
            [
                py,
                "benchmarks/generate.py",
                "--device",
                device,
                *q,
                *write,
                # Batch 1 alone (the goal's): the H200's first calls took 17-22 s a side, and batch
                # 8 with its own compilations did not fit the limit. Rows are written as they
                # finish.
                *(
                    []
                    if quick
                    else [
                        "--shape",
                        "pythia-1b",
                        "--dtype",
                        "bfloat16",
                        "--batch",
                        "1",
                        "--repeats",
                        "3",
                    ]
                ),
            ],
            240,
        ),
        "moe": (
            [
                py,
                "benchmarks/moe.py",
                "--device",
                device,
                *write,
                *(["--tokens", "256", "--seq", "128", "--repeats", "1"] if quick else []),
            ],
            150,
        ),
        "optim": (
            [
                py,
                "benchmarks/optim.py",
                "--device",
                device,
                *write,
                "--model",
                "tiny-neox" if quick else "pythia-1b",
                "--repeats",
                "1" if quick else "10",
            ],
            120,
        ),
        # bf16, the one-GPU recipe, with the QLoRA row. One round of 10 steps: three processes, each
        # starting Python, loading Pythia-410M and taking a warm-up step (~20 s each, estimated: not
        # yet timed on a GPU).
        "lora": (
            [
                py,
                "benchmarks/lora.py",
                "--device",
                device,
                *q,
                *write,
                "--precision",
                "bf16",
                "--qlora",
                *(
                    []
                    if quick
                    else [
                        "--shape",
                        "pythia-410m",
                        "--batch",
                        "8",
                        "--seq",
                        "1024",
                        "--steps",
                        "10",
                        "--rounds",
                        "1",
                    ]
                ),
            ],
            150,
        ),
        "eval": (
            [
                py,
                "benchmarks/eval.py",
                "--device",
                device,
                *write,
                "--repeats",
                "1" if quick else "3",
                *(["--quick"] if quick else []),
            ],
            240,
        ),
        "fp8": (
            [
                py,
                "benchmarks/train.py",
                "--device",
                device,
                *q,
                *write,
                "--shape",
                "pythia-1.4b",
                "--precisions",
                "bf16",
                "--sides",
                "hf,bf16-mixed-compile,fp8,fp8-rowwise",
            ],
            240,
        ),
    }


def install_wheels(log) -> dict[str, str]:
    """Install .gpu/whl into /tmp/site (no index, no dependencies: the wheels are the closed set
    gpu_prepare.sh fetched) and return the environment the stages run in."""
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TORCHINDUCTOR_CACHE_DIR="/tmp/lmforge-inductor",
    )
    wheels = sorted((ROOT / ".gpu" / "whl").glob("*.whl"))
    if wheels and sys.version_info[:2] != (3, 12):
        log(
            f"the wheels in .gpu/whl are for CPython 3.12 (the GPU machine's); this is {sys.version.split()[0]}: "
            "not installed (this machine is expected to hold lmforge's needs already)"
        )
        wheels = []
    if wheels:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(SITE),
            *map(str, wheels),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        log(
            f"installed {len(wheels)} wheels into {SITE}: exit {r.returncode}\n{r.stdout}{r.stderr}"
        )
        env["PYTHONPATH"] = os.pathsep.join(
            [str(SITE), str(ROOT), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
    else:
        log(
            "no .gpu/whl: run scripts/gpu_prepare.sh and carry .gpu (lmforge's own needs may be missing here)"
        )
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    data = ROOT / ".gpu" / "data"
    if (data / "tokenizers").is_dir():
        env["LMFORGE_SHARED_DATA"] = str(data)
    return env


def run_stage(cmd: list[str], env: dict, log_file, limit: float) -> tuple[int | None, bool]:
    """(exit code, timed out): the stage in a session of its own, so that at its limit it is
    killed together with what it started (Inductor's compile workers, torchrun's ranks)."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        return proc.wait(timeout=limit), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--budget", type=float, default=480, help="seconds for all stages together (default 480)"
    )
    p.add_argument(
        "--stages",
        default="check,train,generate,moe,optim,lora,fp8,eval",
        help="comma-separated, in order",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--quick", action="store_true", help="tiny shapes (a dry run of the flow on the CPU)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", "gpu-session")),
        help="where results go (default $OUT, the device tool's folder)",
    )
    p.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="STAGE=SECONDS",
        help="a stage's own time limit instead of its default (repeatable), e.g. --limit train=420",
    )
    p.add_argument(
        "--only",
        default=None,
        metavar="CHECKS",
        help="the check stage's checks, comma-separated (a "
        "rerun of those that failed; default all)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = p.parse_args()
    table = stages(args.device, args.quick, args.only)
    for item in args.limit:
        name, _, seconds = item.partition("=")
        if name not in table or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--limit {item}: give STAGE=SECONDS with a stage of {', '.join(table)}")
        table[name] = (table[name][0], float(seconds))
    names = [n.strip() for n in args.stages.split(",") if n.strip()]
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(table)}")
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "session.log"
    if args.dry_run:
        for n in names:
            print(n, " ".join(table[n][0]).format(out=args.out), f"(limit {table[n][1]} s)")
        return 0
    start = time.perf_counter()
    with log_path.open("a") as log_file:

        def log(msg: str) -> None:
            print(msg, flush=True)
            log_file.write(msg + "\n")
            log_file.flush()

        env = install_wheels(log)
        report = {"device": args.device, "budget_s": args.budget, "stages": []}
        for name in names:
            left = args.budget - (time.perf_counter() - start)
            if left < 30:
                report["stages"].append(
                    {"name": name, "skipped": f"budget spent ({max(left, 0):.0f} s left)"}
                )
                log(f"== {name}: skipped, {max(left, 0):.0f} s of the budget left")
                continue
            cmd, own = table[name]
            cmd = [c.format(out=args.out) for c in cmd]
            limit = min(own, left)
            log(f"== {name} (limit {limit:.0f} s): {' '.join(cmd)}")
            t0 = time.perf_counter()
            rc, timed_out = run_stage(cmd, env, log_file, limit)
            seconds = time.perf_counter() - t0
            report["stages"].append(
                {"name": name, "rc": rc, "seconds": round(seconds, 1), "timed_out": timed_out}
            )
            log(f"== {name}: {'timed out' if timed_out else f'exit {rc}'} after {seconds:.0f} s")
            if (ROOT / "BENCHMARKS.md").exists():
                shutil.copy(ROOT / "BENCHMARKS.md", args.out / "BENCHMARKS.md")
            (args.out / "session.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "session.json").write_text(json.dumps(report, indent=1) + "\n")
    failed = [
        s["name"] + (" (skipped)" if "skipped" in s else "")
        for s in report["stages"]
        if s.get("rc") != 0 or s.get("timed_out")
    ]
    print(f"stages not passed: {', '.join(failed)}" if failed else "every stage passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
