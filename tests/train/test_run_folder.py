"""What a run leaves in its folder across interruptions and reruns: TensorBoard steps, a finished
run's record."""

from __future__ import annotations

import shutil

import pytest

from lmforge.train.trainer import Trainer
from tests.train.conftest import run_config


def _scalars(run_dir, tag: str) -> list[int]:
    """The steps TensorBoard shows for `tag` (EventAccumulator applies the purges writers
    recorded)."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(
        str(run_dir / "tensorboard"), size_guidance={"scalars": 0}
    )
    events.Reload()
    return [e.step for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def test_tensorboard_shows_every_step_once_after_a_resume(tiny_corpus, tmp_path):
    """A run killed after logging steps 5-6 but before saving step 6 resumes from step 4:
    TensorBoard drops what it logged past step 4, and keeps step 4's own points (its validation
    among them)."""
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    args = (
        "trainer.max_steps=6",
        "checkpoint.every_n_steps=4",
        "trainer.val_check_interval=4",
        "checkpoint.save_top_k=-1",
    )
    Trainer(run_config(tiny_corpus, run, *args)).fit()
    shutil.rmtree(run / "checkpoints" / "step-00000006")  # as if killed before the final save
    resumed = Trainer(run_config(tiny_corpus, run, *args))
    assert resumed.state["step"] == 4
    resumed.fit()
    assert _scalars(run, "train/loss") == [1, 2, 3, 4, 5, 6]
    assert _scalars(run, "val/loss") == [4, 6]


def test_tensorboard_of_a_restart_from_scratch_has_no_duplicates(tiny_corpus, tmp_path):
    """Killed before its first checkpoint, the run starts again at step 0: the first attempt's
    events go."""
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    args = ("trainer.max_steps=3", "trainer.val_check_interval=0")
    Trainer(run_config(tiny_corpus, run, *args)).fit()
    shutil.rmtree(run / "checkpoints")  # as if killed before its first checkpoint
    Trainer(run_config(tiny_corpus, run, *args)).fit()
    assert _scalars(run, "train/loss") == [1, 2, 3]


def test_a_finished_run_whose_last_checkpoint_retention_removed_is_not_trained_again(
    tiny_corpus, tmp_path, capsys
):
    """checkpoint.save_last=false: the final step's checkpoint is not among the top k and goes; a
    rerun resumed from the best one and trained the tail again, every time. Its finished.json
    says where the run ended."""
    run = tmp_path / "run"
    # mode=max keeps the highest val_loss, the first validation's (the loss falls): the final
    # checkpoint is removed.
    args = (
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "checkpoint.every_n_steps=2",
        "checkpoint.save_top_k=1",
        "checkpoint.save_last=false",
        "checkpoint.mode=max",
    )
    Trainer(run_config(tiny_corpus, run, *args)).fit()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000002"]
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    again = Trainer(run_config(tiny_corpus, run, *args))
    assert again.finished and again.fit() == {}
    # nothing written
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before
    assert again.summary({}).startswith(
        "the run is at step 4 already (trainer.max_steps=4): nothing to train"
    )
    # Trained further, it goes on from the checkpoint it has, and says which steps it trains again.
    longer = Trainer(run_config(tiny_corpus, run, *args[:-1], "trainer.max_steps=6"))
    assert not longer.finished and longer.state["step"] == 2
    longer.close()


RETAIN_FIRST = (
    "trainer.max_steps=6",
    "trainer.val_check_interval=2",
    "checkpoint.every_n_steps=2",
    "checkpoint.save_top_k=1",
    "checkpoint.save_last=false",
    "checkpoint.mode=max",
)


def _checkpoints(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def test_a_run_out_of_time_keeps_its_stop_checkpoint_whatever_save_last_says(
    tiny_corpus, tmp_path, monkeypatch
):
    """trainer.max_minutes stops a run at step 3 (its clock here jumps two minutes once step 3 is
    done), validates and saves it. With save_last=false and the top 1 by the highest val_loss
    (the first validation's: the loss falls), retention used to remove that checkpoint at once,
    and the rerun trained steps 3 on again. It stays until a newer checkpoint is written; the
    rerun goes on from it, and from then retention is as configured."""
    import time

    from lmforge.train import trainer as trainer_module

    run = tmp_path / "run"
    trainer = Trainer(run_config(tiny_corpus, run, *RETAIN_FIRST, "trainer.max_minutes=1"))
    real = time.perf_counter

    class Clock:
        def __getattr__(self, name):
            return getattr(time, name)

        def perf_counter(self):
            return real() + (120.0 if trainer.state["step"] >= 3 else 0.0)

    monkeypatch.setattr(trainer_module, "time", Clock())
    last = trainer.fit()
    assert trainer.state["step"] == 3 and "val_loss" in last
    assert _checkpoints(run) == ["step-00000002", "step-00000003"]
    monkeypatch.undo()
    again = Trainer(run_config(tiny_corpus, run, *RETAIN_FIRST))
    assert again.state["step"] == 3
    again.fit()
    # the best (here: highest) val_loss; the run finished at step 6
    assert _checkpoints(run) == ["step-00000002"]
    assert Trainer(run_config(tiny_corpus, run, *RETAIN_FIRST)).finished


def test_a_signal_at_a_periodic_save_keeps_that_checkpoint_whatever_save_last_says(
    tiny_corpus, tmp_path, monkeypatch
):
    """SIGTERM during step 4, when a periodic checkpoint is due anyway: that save is the stop's,
    kept by retention with save_last=false (it would not be among the top 1), and the rerun goes
    on from step 4."""
    import signal

    from lmforge.train.stopping import Stopped, StopSignals

    run = tmp_path / "run"
    trainer = Trainer(run_config(tiny_corpus, run, *RETAIN_FIRST))
    real = StopSignals.agree
    monkeypatch.setattr(
        StopSignals,
        "agree",
        lambda self, device, out_of_time=False: (
            signal.SIGTERM if trainer.state["step"] >= 4 else real(self, device, out_of_time)[0],
            out_of_time,
        ),
    )
    with pytest.raises(
        Stopped, match="stopped by SIGTERM at step 4: saved checkpoint .*step-00000004"
    ):
        trainer.fit()
    assert _checkpoints(run) == ["step-00000002", "step-00000004"]
    monkeypatch.undo()
    assert Trainer(run_config(tiny_corpus, run, *RETAIN_FIRST)).state["step"] == 4
