"""A torchrun worker ends with its launcher, by PR_SET_PDEATHSIG and by the watchdog used where
there is none; a process not started by torchrun outlives its parent (nohup). Real processes: a
launcher stand-in starts a worker, then is killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.train.runs import alive

# The worker: follows its launcher as lmforge does at start (`how` forces the watchdog by playing
# macOS), says how.
WORKER = """
import sys, time
from lmforge import launcher
if sys.argv[1] == "watchdog":
    sys.platform = "darwin"
print(launcher.end_with_launcher(period=0.1), flush=True)
time.sleep(600)
"""
# The launcher stand-in: starts the worker, passes its PID and first line on, then waits to be
# killed.
LAUNCHER = """
import subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True,
                     start_new_session=True)
print(w.pid, w.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


def _worker_of_killed_launcher(how: str, torchrun: bool) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    if torchrun:
        env["TORCHELASTIC_RUN_ID"] = "test"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, WORKER, how], stdout=subprocess.PIPE, text=True, env=env
    )
    pid, said = launcher.stdout.readline().split()
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    return int(pid), said


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.05)
    return not alive(pid)


@pytest.mark.parametrize("how", ["pdeathsig", "watchdog"])
def test_a_torchrun_worker_dies_with_its_launcher(how):
    if how == "pdeathsig" and not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    pid, said = _worker_of_killed_launcher(how, torchrun=True)
    try:
        assert said == how
        assert _gone_within(pid, 30)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_process_not_started_by_torchrun_outlives_its_parent():
    pid, said = _worker_of_killed_launcher("pdeathsig", torchrun=False)
    try:
        assert said == "None"
        time.sleep(0.5)
        assert alive(pid)
    finally:
        os.kill(pid, signal.SIGKILL)
