"""A torchrun worker ends with its launcher.

torchrun starts each worker in a session of its own (so a Ctrl-C reaches the workers through the
launcher, once). The price: when the launcher itself is killed (`kill -9`, an OOM kill, a node
agent), nothing tells its workers, and they train on, writing checkpoints into a run folder that a
rerun is already cleaning up.

How a worker follows its launcher, and why:
- Linux: `prctl(PR_SET_PDEATHSIG, SIGKILL)`. The kernel kills the worker the moment its parent dies,
  even while the worker sits in a C++ collective holding the GIL, which no Python thread could
  interrupt; it costs no thread. SIGKILL rather than SIGTERM: the other ranks die with their
  launcher too, so there is nobody to save a checkpoint with; the last complete one is what the
  rerun resumes from.
- Elsewhere (macOS): a daemon thread polls `os.getppid()` once a second; a new parent (the launcher
  died and the worker was re-parented) kills the process.

Only under torchrun (TORCHELASTIC_RUN_ID set): a run started from a shell that then exits (nohup, a
closed ssh session with `&`) must go on. The watch starts when the CLI starts and again when the
process group is joined (library use); a launcher that dies in the ~0.1 s between the worker's start
and that call is not seen by prctl, but then the worker cannot join the launcher's rendezvous store
either and fails there.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCHDOG_NAME = "lmforge-launcher-watchdog"


def under_torchrun() -> bool:
    """Whether this process is a worker that torchrun (torch.distributed.elastic) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _set_parent_death_signal(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):  # no prctl in this C library
        return False


def _watch_parent(parent: int, period: float) -> None:
    while True:
        time.sleep(period)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)


def end_with_launcher(force: bool = False, period: float = 1.0) -> str | None:
    """Make this process end when its parent (torchrun's agent) dies. Returns how ("pdeathsig" or
    "watchdog"), or None where it is not a torchrun worker (`force`: watch the parent anyway).
    Calling it again does nothing more."""
    if not (force or under_torchrun()) or sys.platform == "win32":
        return None
    if sys.platform.startswith("linux") and _set_parent_death_signal(signal.SIGKILL):
        return "pdeathsig"
    if not any(t.name == WATCHDOG_NAME for t in threading.enumerate()):
        threading.Thread(
            target=_watch_parent, args=(os.getppid(), period), name=WATCHDOG_NAME, daemon=True
        ).start()
    return "watchdog"
