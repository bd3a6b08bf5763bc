"""A run's checkpoints stand on their own: a resume, an export or a later phase reads neither
model.init_from's weights nor its tokenizer once they are gone (continued pretraining from a 13
GB import that is then deleted, checkpoints copied to other storage); what a user names that is
missing is said with the key that named it. And the saves a run makes: none that retention would
delete at once, none after a signal that came while one was written."""

from __future__ import annotations

import logging
import shutil
import signal

import pytest
import torch

from lmforge.cli import main
from lmforge.errors import UserError
from lmforge.train.stopping import Stopped, StopSignals
from lmforge.train.trainer import Trainer
from tests.train.conftest import run_config


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.training.full_state_dict().items()}


def _stop_at(monkeypatch, trainer: Trainer, step: int, calls: int = 1) -> None:
    """SIGTERM as the run's `calls`-th agreement at `step` sees it (the second: while that step's
    save was written)."""
    real, seen = StopSignals.agree, []

    def agree(self, device, out_of_time=False):
        if trainer.state["step"] == step:
            seen.append(1)
            if len(seen) >= calls:
                return signal.SIGTERM, out_of_time
        return real(self, device, out_of_time)

    monkeypatch.setattr(StopSignals, "agree", agree)


@pytest.mark.slow
def test_a_resume_and_its_exports_need_neither_the_source_folder_nor_its_tokenizer(
    tiny_llama, tiny_corpus, tmp_path, monkeypatch
):
    source = tmp_path / "imported"
    shutil.copytree(tiny_llama, source)
    common = ("trainer.max_steps=4", "trainer.val_check_interval=0", "checkpoint.every_n_steps=2")
    reference = Trainer(
        run_config(tiny_corpus, tmp_path / "ref", f"model.init_from={tiny_llama}", *common)
    )
    reference.fit()
    run = tmp_path / "run"
    trainer = Trainer(run_config(tiny_corpus, run, f"model.init_from={source}", *common))
    _stop_at(monkeypatch, trainer, 2)
    with pytest.raises(Stopped):
        trainer.fit()
    monkeypatch.undo()
    step2 = run / "checkpoints" / "step-00000002"
    assert (step2 / "tokenizer.json").read_bytes() == (tiny_llama / "tokenizer.json").read_bytes()
    # was: "model folder '.../imported' does not exist", and export-hf had no way round it
    shutil.rmtree(source)
    again = Trainer(run_config(tiny_corpus, run, f"model.init_from={source}", *common))
    assert again.state["step"] == 2 and again.tokenizer.files[0].parent == step2
    again.fit()
    got, want = _weights(again), _weights(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    step4 = run / "checkpoints" / "step-00000004"
    assert main(["export-hf", str(step4), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        tiny_llama / "tokenizer.json"
    ).read_bytes()
    # Another tokenizer on request; one that is not there is one line.
    assert (
        main(["export-hf", str(step4), str(tmp_path / "other"), "--tokenizer", str(tiny_llama)])
        == 0
    )
    with pytest.raises(UserError, match="--tokenizer /nowhere does not exist"):
        main(
            ["--debug", "export-hf", str(step4), str(tmp_path / "none"), "--tokenizer", "/nowhere"]
        )
    assert not (tmp_path / "none").exists()


def test_what_is_missing_is_said_with_the_key_that_named_it(tiny_llama, tiny_corpus, tmp_path):
    from lmforge.train.setup import load_run_tokenizer, stand_in_source

    gone = tmp_path / "gone"
    cfg = run_config(tiny_corpus, tmp_path / "run", f"model.init_from={gone}")
    with pytest.raises(UserError, match=f"^model.init_from: model folder '{gone}' does not exist$"):
        stand_in_source(cfg, None)
    with pytest.raises(UserError, match=f"^model.init_from: model folder '{gone}' does not exist$"):
        cfg.model.resolve()
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    lora = run_config(tiny_corpus, tmp_path / "run", f"model.init_from={gone}", "lora.rank=4")
    with pytest.raises(UserError, match="a LoRA run reads its frozen base from it on every start"):
        stand_in_source(lora, checkpoint)
    assert stand_in_source(cfg, checkpoint) == checkpoint
    typo = run_config(
        tiny_corpus, tmp_path / "run", f"model.init_from={tiny_llama}", f"data.tokenizer={gone}"
    )
    with pytest.raises(
        UserError, match=f"^data.tokenizer: tokenizer path {gone} does not exist: give"
    ):
        load_run_tokenizer(typo, needed=True)


RETAIN_FIRST = (
    "trainer.max_steps=6",
    "trainer.val_check_interval=2",
    "checkpoint.every_n_steps=2",
    "checkpoint.save_top_k=1",
    "checkpoint.save_last=false",
    "checkpoint.mode=max",
)


def test_a_save_retention_would_delete_at_once_is_not_written(
    tiny_corpus, tmp_path, caplog, monkeypatch
):
    """save_top_k=1 by the highest val_loss (the first validation's: the loss falls) and no
    save_last: steps 4 and 6 were written in full, then removed (a 20B model's weights and
    optimizer state, twice)."""
    from lmforge.checkpoint.manager import CheckpointManager

    written = []
    real = CheckpointManager._seal
    monkeypatch.setattr(
        CheckpointManager,
        "_seal",
        lambda self, error, final, *a, **k: (
            written.append(final.name),
            real(self, error, final, *a, **k),
        )[-1],
    )
    with caplog.at_level(logging.INFO, logger="lmforge.checkpoint.manager"):
        Trainer(run_config(tiny_corpus, tmp_path / "run", *RETAIN_FIRST)).fit()
    assert written == ["step-00000002"]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-00000002"]
    lines = [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("step 4 not saved: val_loss ")
    assert lines[0].endswith(
        "is not among the best 1 checkpoint (checkpoint.save_top_k, save_last=false)"
    )


def test_a_signal_while_a_periodic_save_is_written_stops_at_that_step(
    tiny_corpus, tmp_path, monkeypatch
):
    """The signal came while step 2's checkpoint was written: the run trained step 3 and saved
    again before it stopped (under torchrun, inside the 30 s before SIGKILL). It stops at step 2,
    on the checkpoint just written."""
    run = tmp_path / "run"
    trainer = Trainer(
        run_config(
            tiny_corpus,
            run,
            "trainer.max_steps=6",
            "trainer.val_check_interval=0",
            "checkpoint.every_n_steps=2",
        )
    )
    _stop_at(monkeypatch, trainer, 2, calls=2)
    with pytest.raises(
        Stopped, match="stopped by SIGTERM at step 2: saved checkpoint .*step-00000002;"
    ):
        trainer.fit()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002"]


def test_a_finished_runs_rerun_says_so_before_reading_anything(
    tiny_corpus, tmp_path, monkeypatch, capsys
):
    """The rerun of a finished run built its data and model, read model.init_from and checked the
    checkpoint's files (for a 7B run: minutes) to say there was nothing to train. Under the very
    config it finished with, its line comes first; any change goes the whole way (the Trainer
    resumes and compares)."""
    import os

    from tests.train.conftest import run_args

    args = [
        "pretrain",
        os.devnull,
        *run_args(
            tiny_corpus, tmp_path / "run", "trainer.max_steps=2", "trainer.val_check_interval=0"
        ),
    ]
    assert main(args) == 0
    capsys.readouterr()
    monkeypatch.setattr(Trainer, "__init__", lambda *a, **k: pytest.fail("the Trainer was built"))
    assert main(args) == 0
    assert capsys.readouterr().out.startswith(
        "the run is at step 2 already (trainer.max_steps=2): nothing to train"
    )
    monkeypatch.undo()
    # another config: the Trainer says what changed, and trains nothing
    assert main([*args, "optim.lr=1e-3"]) == 0
    assert "nothing to train" in capsys.readouterr().out


def test_the_compile_jobs_steps_leave_no_checkpoint_and_no_folder(
    tiny_corpus, tmp_path, monkeypatch
):
    """`lmforge compile` ran its throwaway steps as a run that saved a full checkpoint at its end
    (neox-20b under bf16-sr: ~165 GB of weights and optimizer state) and then deleted it; a
    failed job left RUN_DIR/.compile-job."""
    import os

    from tests.train.conftest import run_args

    trainer = Trainer(
        run_config(
            tiny_corpus, tmp_path / "job", "trainer.max_steps=2", "trainer.val_check_interval=0"
        )
    )
    trainer.save_at_end = False
    trainer.fit()
    assert not (tmp_path / "job" / "checkpoints").exists() or not any(
        (tmp_path / "job" / "checkpoints").iterdir()
    )

    def fails(self, batches):  # as Inductor failing in the first step
        raise RuntimeError("CppCompileError")

    monkeypatch.setattr(Trainer, "train_step", fails)
    with pytest.raises(RuntimeError, match="CppCompileError"):
        main(["--debug", "compile", os.devnull, *run_args(tiny_corpus, tmp_path / "run")])
    assert (tmp_path / "run").is_dir() and not (tmp_path / "run" / ".compile-job").exists()
