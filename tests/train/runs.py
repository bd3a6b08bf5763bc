"""Real runs as processes, for the tests that signal or kill them: the command, torchrun, waiting
on a run's metrics, and whether a process is still alive (a zombie is not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def pretrain_args(corpus, run_dir, *extra: str) -> list[str]:
    """`lmforge pretrain` of tiny-neox on the tiny corpus: 8 steps, validation at 4 and 8,
    dropout on."""
    return [
        "pretrain",
        os.devnull,
        "model.preset=tiny-neox",
        f"data.paths=[{corpus}]",
        "data.seq_length=32",
        "trainer.max_steps=8",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        "trainer.val_check_interval=4",
        "trainer.val_batches=1",
        "trainer.precision=fp32",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "model.dropout=0.1",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
        f"run_dir={run_dir}",
        *extra,
    ]


def lmforge(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "lmforge.cli", *args],
        env=env or ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def torchrun(args: list[str], env: dict | None = None, nproc: int = 2) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "lmforge.cli",
            *args,
        ],
        env=env or ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def metrics_steps(run_dir: Path) -> list[int]:
    """The steps of the run's metrics.jsonl rows (whole rows only)."""
    path = Path(run_dir) / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):  # a row being written
            pass
    return steps


def wait_for(
    condition: Callable[[], object], proc: subprocess.Popen, timeout: float = 300.0
) -> object:
    """Poll `condition` until it holds, while `proc` runs; fail where `proc` ended first or time
    ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := condition():
            return got
        if proc.poll() is not None:
            raise AssertionError(
                f"the run ended (exit {proc.returncode}) first: {proc.stderr.read()[-3000:]}"
            )
        time.sleep(0.05)
    raise AssertionError(f"waited {timeout} s")


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie waiting to be reaped does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stop(proc: subprocess.Popen) -> None:
    """Kill `proc` if it still runs, and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
