"""The kill -9 soak: torchrun with two ranks, its launcher killed before, during and after a
checkpoint write and during retention, the same command rerun after each kill. At the end: the curve
of the uninterrupted run bit for bit, one metrics row per step, no process of any killed run left,
no temporary file or folder.

Kills are aimed with the checkpoint code's test hook (lmforge/checkpoint/hold.py): rank 0 stops at
the moment named, says so in a file, and the launcher is killed there.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.train.runs import ENV, alive, metrics_steps, pretrain_args, stop, torchrun, wait_for

# A checkpoint every 2 steps and only the newest kept: every save after the first runs retention.
ARGS = ("trainer.max_steps=14", "checkpoint.every_n_steps=2", "checkpoint.save_top_k=0")
# Where each kill lands, in order, and what it leaves in checkpoints/; the reruns resume from 2, 4,
# 8, then 10.
KILLS = {
    "save:4": ["step-00000002"],  # before: checkpoint 4 not begun
    # during: written, not yet checksummed nor renamed
    "written:6": [".step-00000006.tmp", "step-00000004"],
    # after: 8 in place, retention has not removed 6 yet
    "renamed:8": ["step-00000006", "step-00000008"],
    "retention:8": [".step-00000008.deleting", "step-00000010"],  # during retention, as 10 is saved
}


def _curve(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r.get("val_loss")) for r in rows]


@pytest.mark.slow
def test_kill_9_of_torchrun_at_every_moment_of_a_checkpoint(tiny_corpus, tmp_path):
    import psutil

    whole = tmp_path / "whole"
    launcher = torchrun(pretrain_args(tiny_corpus, whole, *ARGS))
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-3000:]

    run, hold = tmp_path / "run", tmp_path / "hold"
    workers: list[int] = []
    for point, left in KILLS.items():
        launcher = torchrun(
            pretrain_args(tiny_corpus, run, *ARGS),
            env={**ENV, "LMFORGE_TEST_HOLD": point, "LMFORGE_TEST_HOLD_FILE": str(hold)},
        )
        try:
            wait_for(hold.exists, launcher)
            mine = [p.pid for p in psutil.Process(launcher.pid).children()]
            assert len(mine) == 2
            workers += mine
            launcher.send_signal(signal.SIGKILL)
            launcher.wait()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(alive(pid) for pid in mine):
                time.sleep(0.1)
            assert not any(alive(pid) for pid in mine), (
                f"workers outlived their launcher killed at {point}"
            )
            assert sorted(p.name for p in (run / "checkpoints").iterdir()) == left
        finally:
            stop(launcher)
            hold.unlink(missing_ok=True)
    launcher = torchrun(pretrain_args(tiny_corpus, run, *ARGS))
    _, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-3000:]

    assert _curve(run) == _curve(whole)  # exact float equality
    assert metrics_steps(run) == list(range(1, 15))  # one row per step
    assert not any(alive(pid) for pid in workers)
    # Our temporary names are hidden (.step-N.tmp, .step-N.deleting, .NAME.tmp-PID); DCP's .metadata
    # is no temporary.
    left = [
        p.relative_to(run)
        for p in run.rglob("*")
        if p.name.startswith(".") and p.name != ".metadata"
    ]
    assert left == [] and not (run / "run.lock").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000014"]
