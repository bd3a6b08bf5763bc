"""One run per run folder (run.lock), and torchrun workers that end with their launcher: real
processes, real signals."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from lmforge.errors import UserError
from lmforge.train.run_lock import LOCK_FILE, RunLock
from tests.train.runs import (
    ENV,
    alive,
    lmforge,
    metrics_steps,
    pretrain_args,
    stop,
    torchrun,
    wait_for,
)

# A process that takes the run folder's lock, says so, then waits (or dies by SIGKILL still holding
# it).
HOLDER = """
import os, signal, sys, time
from lmforge.train.run_lock import RunLock
lock = RunLock(sys.argv[1]).acquire(wait=0)
print("held", flush=True)
if sys.argv[2] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(float(sys.argv[2]))
lock.release()
"""


def _holder(run_dir, how: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), how], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline() == "held\n"
    return p


def test_a_held_folder_is_refused_in_one_line_naming_the_holder(tmp_path):
    holder = _holder(tmp_path / "run", "60")
    try:
        with pytest.raises(UserError) as e:
            RunLock(tmp_path / "run").acquire(wait=0.3)
        line = str(e.value)
        assert "\n" not in line
        assert f"PID {holder.pid} on host {socket.gethostname()}" in line
        assert "trainer.lock_wait" in line and "run_dir" in line
    finally:
        stop(holder)


def test_a_second_run_waits_for_the_first_to_end(tmp_path):
    holder = _holder(tmp_path / "run", "0.5")
    try:
        lock = RunLock(tmp_path / "run").acquire(wait=60)  # the holder lets go after 0.5 s
        assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()
        lock.release()
        holder.wait(timeout=60)
    finally:
        stop(holder)
    # the holder made the folder, the last run let go: nothing is left
    assert not (tmp_path / "run").exists()


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path, caplog):
    holder = _holder(tmp_path / "run", "die")
    holder.wait()
    assert holder.returncode == -signal.SIGKILL
    # its file stays behind
    assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING, logger="lmforge.train.run_lock"):
        lock = RunLock(tmp_path / "run").acquire(wait=0)
    assert f"from PID {holder.pid} on host" in caplog.text
    assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert list((tmp_path / "run").iterdir()) == []


def test_a_trainer_that_fails_to_start_leaves_no_run_folder(tmp_path):
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    cfg = load_run_config(
        None,
        [
            "model.preset=tiny-neox",
            f"data.paths=[{tmp_path / 'missing'}]",
            f"run_dir={tmp_path / 'run'}",
            "trainer.precision=fp32",
            "data.seq_length=32",
        ],
    )
    with pytest.raises(UserError, match="missing"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()
    RunLock(tmp_path / "run").acquire(wait=0).release()  # the lock was let go


@pytest.mark.slow
def test_a_second_run_on_the_same_folder_refuses(tiny_corpus, tmp_path):
    run = tmp_path / "run"
    first = lmforge(pretrain_args(tiny_corpus, run, "trainer.max_steps=100000"))
    try:
        wait_for(lambda: metrics_steps(run), first)
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "lmforge.cli",
                *pretrain_args(tiny_corpus, run, "trainer.lock_wait=1"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=ENV,
        )
        assert second.returncode == 1
        assert (
            second.stderr.strip()
            .splitlines()[-1]
            .startswith(
                f"error: run folder '{run}' is in use by another run, PID {first.pid} on host"
            )
        )
        assert alive(first.pid)  # and the first run is left alone
    finally:
        stop(first)


@pytest.mark.slow
def test_killing_the_torchrun_launcher_ends_its_workers(tiny_corpus, tmp_path):
    """kill -9 of torchrun: its two workers (sessions of their own, so no signal reaches them)
    must not train on into the run folder."""
    import psutil

    run = tmp_path / "run"
    launcher = torchrun(pretrain_args(tiny_corpus, run, "trainer.max_steps=100000"))
    workers = []
    try:
        wait_for(lambda: metrics_steps(run), launcher)
        workers = psutil.Process(launcher.pid).children()
        assert len(workers) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(alive(w.pid) for w in workers):
            time.sleep(0.1)
        assert not any(alive(w.pid) for w in workers), "torchrun's workers outlived it"
        steps = metrics_steps(run)
        time.sleep(2)
        assert metrics_steps(run) == steps  # nobody writes the folder any more
        # and the next run takes the folder over at once (the dead rank 0's lock is stale)
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "lmforge.cli",
                *pretrain_args(tiny_corpus, run, "trainer.max_steps=2", "trainer.lock_wait=0"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=ENV,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert "taking over" in r.stderr
    finally:
        stop(launcher)
        for w in workers:
            if alive(w.pid):
                os.kill(w.pid, signal.SIGKILL)


@pytest.mark.slow
def test_under_torchrun_every_rank_stops_when_the_folder_is_held(tiny_corpus, tmp_path):
    """Rank 0 holds the lock for the run; the other rank learns that it could not and stops with
    it (no rank waits for the other at a collective), the line said once."""
    holder = _holder(tmp_path / "run", "600")
    try:
        launcher = torchrun(pretrain_args(tiny_corpus, tmp_path / "run", "trainer.lock_wait=0.5"))
        _, err = launcher.communicate(timeout=300)
        assert launcher.returncode != 0
        assert err.count(f"is in use by another run, PID {holder.pid} on host") == 1, err[-3000:]
        # Both ranks exit 1 on their own; torchrun then SIGTERMs whichever is still exiting when the
        # first one ends (-15), so the order decides how many 1s it lists. A rank left waiting at a
        # collective would instead die of gloo's "connection closed" error once its peer was gone.
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", err)
        assert "1" in codes and set(codes) <= {"1", "-15"}, err[-3000:]
        assert "Connection closed" not in err and "gloo" not in err.lower(), err[-3000:]
    finally:
        stop(holder)


def test_a_second_trainer_in_the_same_process_takes_the_folder_without_a_warning(tmp_path, caplog):
    """POSIX locks belong to the process: a notebook or test that builds a second Trainer on the
    folder goes on, and is not told that it took the folder over from a dead run (itself)."""
    first = RunLock(tmp_path / "run").acquire(wait=0)
    with caplog.at_level(logging.WARNING, logger="lmforge.train.run_lock"):
        second = RunLock(tmp_path / "run").acquire(wait=0)
    assert "taking over" not in caplog.text
    second.release()
    first.release()


def test_a_run_folder_that_cannot_be_made_is_one_line_naming_it(tmp_path):
    """A file in the path, a folder the system will not let us make: NotADirectoryError /
    PermissionError tracebacks."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(
        UserError,
        match=r"^run_dir '.*afile/sub/run' cannot be created: '.*afile' is a file, not a "
        r"folder: set run_dir to a folder this user can write$",
    ):
        RunLock(tmp_path / "afile" / "sub" / "run").acquire(wait=0)
    if os.path.isdir("/sys/kernel"):  # sysfs: nobody, root included, may make a folder there
        with pytest.raises(
            UserError, match=r"^run_dir '/sys/lmforge-test-run' cannot be created: "
        ):
            RunLock("/sys/lmforge-test-run").acquire(wait=0)


def test_a_read_only_run_folder_is_one_line_and_leaves_no_folders(tmp_path, monkeypatch):
    """A read-only mount (root writes through chmod, so the file system's refusal is simulated):
    an OSError traceback from the lock's mkdir or open; the parents made before the refusal are
    removed."""
    import errno
    import pathlib

    run_dir = tmp_path / "new" / "parents" / "run"
    mkdir = pathlib.Path.mkdir

    def refuse_the_leaf(self, *args, **kwargs):
        if self == run_dir:
            mkdir(self.parent, parents=True, exist_ok=True)
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", refuse_the_leaf)
    with pytest.raises(
        UserError, match=f"^run_dir '{run_dir}' cannot be created: Read-only file system: "
    ):
        RunLock(run_dir).acquire(wait=0)
    assert not (tmp_path / "new").exists()
    monkeypatch.undo()
    run_dir.mkdir(parents=True)
    real_open = os.open

    def refuse_the_lock(path, *args):
        if str(path).endswith(LOCK_FILE):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, *args)

    monkeypatch.setattr(os, "open", refuse_the_lock)
    with pytest.raises(
        UserError, match=f"^run_dir '{run_dir}' cannot be written: Read-only file system: "
    ):
        RunLock(run_dir).acquire(wait=0)
