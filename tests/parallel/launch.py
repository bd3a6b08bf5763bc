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


def run_ranks(world: int, args: list[str], timeout: float = 240.0, script: Path = WORKER) -> list[Rank]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
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
