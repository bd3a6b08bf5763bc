"""Ctrl-C and SIGTERM save a checkpoint of the step, then exit 128 + the signal; what a killed
export left in a run folder is cleaned up at the next start. Real signals to real runs."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from lmforge.fsutil import atomic_dir, remove_leftovers
from lmforge.train import stopping
from lmforge.train.stopping import StopSignals
from tests.train.runs import ENV, lmforge, metrics_steps, pretrain_args, stop, wait_for


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def test_a_stop_signal_is_noted_and_the_previous_handlers_come_back(monkeypatch):
    import torch

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop_signals:
        assert stop_signals.agree(torch.device("cpu")) == (None, False)
        os.kill(os.getpid(), signal.SIGTERM)
        # within a second: the same request (torchrun passes Ctrl-C on)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop_signals.agree(torch.device("cpu")) == (signal.SIGTERM, False)
        monkeypatch.setattr(stopping, "REPEAT_SECONDS", -1.0)
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C again, later: stop now
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


STOPPING = (
    "SIGINT: stopping after this step with a checkpoint (Ctrl-C again to stop at once, unsaved)"
)


@pytest.mark.parametrize("rank, level", [(0, logging.WARNING), (1, logging.DEBUG)])
def test_under_torchrun_rank_0_alone_warns_of_the_stop(rank, level, caplog):
    """torchrun passes Ctrl-C to every rank, and every rank logs warnings (lmforge.cli): the
    others say it at debug."""
    from types import SimpleNamespace

    from lmforge.parallel.data_parallel import World
    from lmforge.train.trainer import Trainer

    caplog.set_level(logging.DEBUG, logger=stopping.__name__)
    trainer = SimpleNamespace(world=World(rank=rank, size=2), close=lambda: None)
    trainer._fit = lambda stop: os.kill(os.getpid(), signal.SIGINT) or {"signum": stop.signum}
    # the trainer's own StopSignals, told its rank
    assert Trainer.fit(trainer) == {"signum": signal.SIGINT}
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(level, STOPPING)]


def test_leftovers_of_killed_writes_are_removed_or_put_back(tmp_path):
    dead, live = _dead_pid(), os.getpid()
    (tmp_path / f".model.tmp-{dead}").mkdir()
    (tmp_path / f".model.tmp-{dead}" / "model.safetensors").write_bytes(b"half")
    # killed between moving hf/ aside and renaming the new one in
    (tmp_path / f".hf.old-{dead}").mkdir()
    (tmp_path / f".hf.old-{dead}" / "config.json").write_text("{}")
    (tmp_path / f".metrics.jsonl.tmp-{dead}").write_text("torn")
    (tmp_path / f".config.yaml.tmp-{live}").write_text("being written")  # a running process's
    (tmp_path / ".step-00000004.tmp").mkdir()  # not this kind of name
    remove_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f".config.yaml.tmp-{live}",
        ".step-00000004.tmp",
        "hf",
    ]
    assert (tmp_path / "hf" / "config.json").read_text() == "{}"
    remove_leftovers(tmp_path, only_dead=False)  # a held run folder: nobody else writes it
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-00000004.tmp", "hf"]


def test_an_export_cleans_what_a_killed_export_to_the_same_folder_left(tmp_path):
    dead = _dead_pid()
    (tmp_path / f".out.tmp-{dead}").mkdir()
    (tmp_path / f".other.tmp-{dead}").mkdir()  # another output's: not this export's business
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "x").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".other.tmp-{dead}", "out"]


# A pretrain whose export is killed (SIGKILL, what kill -9 sends) once the weights are in
# `.model.tmp-PID`.
KILLED_IN_EXPORT = """
import os, signal, sys
from pathlib import Path
import lmforge.models.io as io

real = io.write_config

def write_config(folder, cfg):
    if Path(folder).name.startswith(".model.tmp-"):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(folder, cfg)

io.write_config = write_config
from lmforge.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_what_a_kill_during_export_left_is_cleaned_at_the_next_start(tiny_corpus, tmp_path):
    run = tmp_path / "run"
    args = pretrain_args(tiny_corpus, run, "trainer.max_steps=2", "checkpoint.convert_to_hf=true")
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_IN_EXPORT, *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    leftovers = [p.name for p in run.iterdir() if p.name.startswith(".model.tmp-")]
    assert len(leftovers) == 1 and (run / leftovers[0] / "model.safetensors").exists()
    rerun = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"cleaned up {run / leftovers[0]}" in rerun.stderr
    assert [p.name for p in run.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


def _curve(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r.get("val_loss")) for r in rows]


STEPS = ("trainer.max_steps=24", "checkpoint.every_n_steps=4", "checkpoint.save_top_k=-1")


@pytest.fixture(scope="module")
def whole_run(tiny_corpus, tmp_path_factory):
    run = tmp_path_factory.mktemp("whole") / "run"
    subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *pretrain_args(tiny_corpus, run, *STEPS)],
        env=ENV,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return run


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_the_step_exits_128_plus_it_and_the_rerun_continues_bit_exactly(
    sig, whole_run, tiny_corpus, tmp_path
):
    run = tmp_path / "run"
    proc = lmforge(pretrain_args(tiny_corpus, run, *STEPS))
    try:
        wait_for(lambda: any(s >= 5 for s in metrics_steps(run)), proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    finally:
        stop(proc)
    assert proc.returncode == 128 + sig, err[-3000:]
    latest = sorted(run.glob("checkpoints/step-*"))[-1]
    step = json.loads((latest / "trainer.json").read_text())["step"]
    assert 5 <= step < 24
    # the checkpoint is of the step it stopped at
    assert metrics_steps(run) == list(range(1, step + 1))
    assert err.strip().splitlines()[-1] == (
        f"interrupted: stopped by {sig.name} at step {step}: saved checkpoint "
        f"{latest}; run the same command again to resume"
    )
    rerun = subprocess.run(
        [sys.executable, "-m", "lmforge.cli", *pretrain_args(tiny_corpus, run, *STEPS)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _curve(run) == _curve(whole_run)  # exact float equality, one row per step


@pytest.mark.slow
def test_ctrl_c_to_torchrun_saves_the_step_on_every_rank_and_stops_them(tiny_corpus, tmp_path):
    """torchrun passes Ctrl-C on to its workers (sessions of their own): they agree on the step,
    save it, and end; torchrun's own exit and traceback are torchrun's."""
    import psutil

    from tests.train.runs import alive, torchrun

    run = tmp_path / "run"
    launcher = torchrun(pretrain_args(tiny_corpus, run, "trainer.max_steps=100000"))
    try:
        wait_for(lambda: any(s >= 3 for s in metrics_steps(run)), launcher)
        workers = [p.pid for p in psutil.Process(launcher.pid).children()]
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=300)
    finally:
        stop(launcher)
    assert not any(alive(pid) for pid in workers)
    step = metrics_steps(run)[-1]
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step-{step:08d}"]
    assert err.count(f"interrupted: stopped by SIGINT at step {step}: saved checkpoint") == 1, err[
        -3000:
    ]
    assert err.count(STOPPING) == 1, err[-3000:]  # rank 0's; rank 1 says it at debug
    assert metrics_steps(run) == list(range(1, step + 1))


AGREE = """
import torch, torch.distributed as dist
from lmforge.train.stopping import StopSignals
dist.init_process_group("gloo")
rank = dist.get_rank()
stop = StopSignals()
print(stop.agree(torch.device("cpu"), out_of_time=False))
print(stop.agree(torch.device("cpu"), out_of_time=rank == 1))
if rank == 0:
    stop.signum = 15
print(stop.agree(torch.device("cpu")))
dist.destroy_process_group()
"""


def test_every_rank_stops_on_time_when_any_ranks_clock_says_so():
    """trainer.max_minutes is read off each rank's clock, a few milliseconds apart: were each
    rank to decide alone, one could stop while the others wait in the next step's collectives.
    The ranks agree with the signals' all-reduce."""
    from tests.parallel.launch import torchrun

    r = torchrun(2, ["-c", AGREE], timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["(None, False)", "(None, True)", "(15, False)"] * 2
