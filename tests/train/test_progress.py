"""Progress off a terminal: plain log lines at an interval, not a bar's carriage returns."""

from __future__ import annotations

import logging

from lmforge.train import progress
from lmforge.train.progress import Progress


def test_off_a_terminal_progress_is_a_plain_line_per_interval(monkeypatch, caplog):
    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    shown = Progress(total=100, initial=40, terminal=False, interval=30.0)
    assert shown.bar is None
    with caplog.at_level(logging.INFO, logger="lmforge.train.progress"):
        for step in range(41, 71):
            # 2 s a step: a line 15 steps after the last one; the first and
            # validations always
            now[0] += 2.0
            shown.update(
                step,
                {
                    "loss": 2.5,
                    "tokens_per_second": 1234.0,
                    **({"val_loss": 2.75} if step == 50 else {}),
                },
            )
        shown.close()  # stopped early (max_minutes): where it stopped is shown
    lines = [r.getMessage() for r in caplog.records]
    first = "step 41/100 (41%), loss 2.5000, 1,234 tokens/s, ETA 1:58 (at the first step's pace, start-up in it)"
    assert lines[0] == first
    assert [line.split(" (")[0] for line in lines] == [
        "step 41/100",
        "step 50/100",
        "step 65/100",
        "step 70/100",
    ]
    assert lines[1] == "step 50/100 (50%), loss 2.5000, val_loss 2.7500, 1,234 tokens/s, ETA 1:40"


def test_on_a_terminal_it_is_a_bar(capsys):
    shown = Progress(total=3, terminal=True)
    for step in (1, 2, 3):
        shown.update(step, {"loss": 1.0, "tokens_per_second": 10.0})
    shown.close()
    assert "3/3" in capsys.readouterr().err


def test_the_eta_of_a_run_with_max_minutes_is_the_sooner_end(monkeypatch, caplog):
    """quickstart --minutes 1 showed the 600-step maximum's ETA (2:18) while the run would stop
    after a minute."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    shown = Progress(total=600, terminal=False, interval=0.0, max_seconds=60.0)
    with caplog.at_level(logging.INFO, logger="lmforge.train.progress"):
        for step in (1, 2):
            now[0] += 0.25
            shown.update(step, {"loss": 2.5, "tokens_per_second": 100.0})
    lines = [r.getMessage() for r in caplog.records]
    # 59.5 s left
    assert lines[-1] == "step 2/600 (0%), loss 2.5000, 100 tokens/s, ETA 1:00 (trainer.max_minutes)"
    # the steps end first
    short = Progress(total=10, terminal=False, interval=0.0, max_seconds=60.0)
    with caplog.at_level(logging.INFO, logger="lmforge.train.progress"):
        now[0] += 1.0
        short.update(1, {"loss": 2.5, "tokens_per_second": 100.0})
    assert (
        caplog.records[-1]
        .getMessage()
        .endswith("ETA 0:09 (at the first step's pace, start-up in it)")
    )


def test_the_eta_leaves_out_the_first_steps_start_up(monkeypatch, caplog):
    """A compiled run's first step holds the compilation: its ETA read 9:08 for a run that took
    44 s. From the second step on the pace is that of the steps after the first; a classifier's
    val_accuracy is shown too."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    shown = Progress(total=100, terminal=False, interval=0.0)
    with caplog.at_level(logging.INFO, logger="lmforge.train.progress"):
        for step, seconds in ((1, 60.0), (2, 0.5), (3, 0.5)):
            now[0] += seconds
            shown.update(
                step,
                {
                    "loss": 2.5,
                    "tokens_per_second": 100.0,
                    **({"val_loss": 0.5, "val_accuracy": 0.75} if step == 3 else {}),
                },
            )
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].endswith("ETA 1:39:00 (at the first step's pace, start-up in it)")
    assert lines[1].endswith("ETA 0:49")
    assert (
        lines[2]
        == "step 3/100 (3%), loss 2.5000, val_loss 0.5000, val_accuracy 0.7500, 100 tokens/s, ETA 0:48"
    )
