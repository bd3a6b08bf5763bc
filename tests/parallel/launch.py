"""Start N ranks of a script as plain processes with torchrun's environment (RANK, WORLD_SIZE, ...).

Cheaper than torchrun (no elastic agent) and every rank's exit code and stderr are its own, which
the error tests need: one clear line on rank 0, every rank exiting non-zero, no hang.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")


@dataclass
class Rank:
    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    world: int, args: list[str], timeout: float = 240.0, script: Path = WORKER
) -> list[Rank]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append(Rank(p.returncode, stdout, stderr))
    finally:
        for p in procs:  # a hang is a failure; never leave ranks behind
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def torchrun(
    nproc: int, argv: list[str], env: dict | None = None, timeout: float = 600.0, **popen: object
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc python argv` without torchrun: `nproc` plain
    processes of `python argv` (a script and its arguments, or -m lmforge.cli ...) with the
    environment torchrun gives its workers. torchrun's elastic agent (its own torch import,
    rendezvous and monitoring) adds ~2 s to every launch, which the multi-process tests paid ~40
    times; the tests of torchrun itself (killing it, its signals, Slurm) still run it. Returns
    torchrun's answer: the first failing rank's exit code (else 0) and every rank's output, rank
    by rank."""
    port = free_port()
    base = {**(os.environ if env is None else env)}
    base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for more than one process
    procs = []
    for rank in range(nproc):
        rank_env = {
            **base,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "none",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                **popen,
            )
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:  # a hang is a failure; never leave ranks behind
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    return subprocess.CompletedProcess(
        argv,
        next((c for c in codes if c), 0),
        "".join(o for o, _ in outs),
        "".join(e for _, e in outs),
    )
