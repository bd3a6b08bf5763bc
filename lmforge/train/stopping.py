"""Ctrl-C (SIGINT) or SIGTERM during training: finish the step, save a checkpoint, then stop.

The first signal only asks: the step under way ends, every rank agrees on stopping (one tiny
all-reduce per step, so no rank saves alone while another trains on), the trainer saves a checkpoint
of that step and raises `Stopped`, which the CLI turns into exit 128 + the signal (130 for Ctrl-C,
143 for SIGTERM). Rerunning the command resumes bit for bit. A second Ctrl-C (a second or more after
the first) stops at once, unsaved, as Ctrl-C did before. SIGTERM is what Slurm sends before it kills
a preempted or requeued job, and what torchrun passes on to its workers when it is stopped itself;
both then wait 30 s before SIGKILL, which a step and a save must fit in (the previous checkpoint
stays intact otherwise).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# torchrun passes a Ctrl-C on to its workers: a copy arriving this soon after the first is the same
# request.
REPEAT_SECONDS = 1.0


class Stopped(KeyboardInterrupt):
    """The run stopped on a signal after saving a checkpoint; `signum` is the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class StopSignals:
    """While entered (in the main thread), SIGINT and SIGTERM ask the run to stop after the
    current step. `is_main`: this process warns of the stop; the others log it at debug (torchrun
    passes Ctrl-C to every rank, and every rank prints its warnings: one line is enough)."""

    def __init__(self, is_main: bool = True) -> None:
        self.is_main = is_main
        self.signum: int | None = None
        self.at = 0.0
        self.owner = os.getpid()
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        # signal handlers live in the main thread only
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        """Put the handlers of before back: signals stop the process as they did (a second call
        does nothing)."""
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}

    def _handle(self, signum: int, frame) -> None:
        if os.getpid() != self.owner:  # a forked DataLoader worker: the run it feeds stops it
            return
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()
            log.log(
                logging.WARNING if self.is_main else logging.DEBUG,
                "%s: stopping after this step with a checkpoint (Ctrl-C again to stop at once, unsaved)",
                signal.Signals(signum).name,
            )
        elif signum == signal.SIGINT and time.monotonic() - self.at > REPEAT_SECONDS:
            raise KeyboardInterrupt

    def agree(self, device: torch.device, out_of_time: bool = False) -> tuple[int | None, bool]:
        """(the signal that asked the run to stop on any rank, or None; whether any rank's clock
        says the run's time is up): one all-reduce, every rank the same answers, so no rank stops
        alone on a clock a millisecond ahead of the others'."""
        mine = [self.signum or 0, int(out_of_time)]
        if dist.is_initialized():
            flags = torch.tensor(mine, dtype=torch.int32, device=device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            mine = flags.tolist()
        return mine[0] or None, bool(mine[1])
