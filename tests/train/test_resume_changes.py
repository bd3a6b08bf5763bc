"""A resume compares the run's config with its checkpoint's: another model is refused by name,
other changes are one warning and a row of history.jsonl, and a finished run rerun writes
nothing."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
from omegaconf import OmegaConf

from lmforge.cli import main
from lmforge.models.io import write_config
from lmforge.train.config import run_dict
from lmforge.train.optim import lr_at
from lmforge.train.resume import compare, saved_run_config
from tests.train.conftest import run_args, run_config


def _diff(tmp_path, saved_overrides, overrides, saved_run=None):
    old, new = run_config("c", tmp_path, *saved_overrides), run_config("c", tmp_path, *overrides)
    return compare(
        run_dict(old) if saved_run is None else saved_run,
        old.model.resolve(),
        new,
        new.model.resolve(),
    )


@pytest.mark.parametrize(
    "overrides, key, old, new",
    [
        (["model.num_layers=1"], "model.num_layers", 2, 1),
        (["model.rotary_pct=0.5"], "model.rotary_pct", 0.25, 0.5),
        (["data.seq_length=64"], "data.seq_length", 32, 64),
        (["trainer.global_batch_size=16"], "trainer.global_batch_size", 8, 16),
        (
            ["lora.rank=4"],
            "lora",
            None,
            {
                "rank": 4,
                "alpha": 16.0,
                "dropout": 0.0,
                "targets": ["default"],
                "bf16_base": False,
                "base_dtype": "fp32",
            },
        ),
    ],
    ids=["num_layers", "rotary_pct", "seq_length", "global_batch_size", "lora"],
)
def test_another_model_or_step_is_refused(overrides, key, old, new, tmp_path):
    refused, allowed = _diff(tmp_path, [], overrides)
    assert refused == {key: (old, new)} and allowed == {}


def test_other_changes_are_allowed_and_listed(tmp_path):
    refused, allowed = _diff(
        tmp_path,
        [],
        [
            "optim.lr=1e-3",
            "trainer.max_steps=12",
            "trainer.micro_batch_size=8",
            "model.dropout=0.1",
            "model.router_aux_loss_coef=0.01",
            "trainer.val_check_interval=2",
            "parallel.tensor=2",
            f"run_dir={tmp_path / 'elsewhere'}",
        ],
    )
    assert refused == {}
    assert allowed == {
        "model.dropout": (0.0, 0.1),
        "model.router_aux_loss_coef": (0.001, 0.01),
        "optim.lr": (3e-3, 1e-3),
        "trainer.max_steps": (8, 12),
        "trainer.micro_batch_size": (4, 8),
        "trainer.val_check_interval": (4, 2),
        "parallel.tensor": (1, 2),
    }


def test_a_key_added_since_the_checkpoint_is_no_change(tmp_path):
    """A checkpoint written before a setting existed ran with its default: not a change to warn
    about."""
    saved = run_dict(run_config("c", tmp_path))
    del saved["trainer"]["max_minutes"], saved["eval"]
    assert _diff(tmp_path, [], [], saved_run=saved) == ({}, {})


def test_a_checkpoint_without_its_run_config_is_compared_with_config_yaml(tmp_path):
    """Checkpoints written before trainer.json carried the run config: the run folder's
    config.yaml stands in."""
    ckpt = tmp_path / "checkpoints" / "step-00000004"
    ckpt.mkdir(parents=True)
    cfg = run_config("c", tmp_path, "optim.lr=0.01")
    (ckpt / "trainer.json").write_text(json.dumps({"step": 4}))
    write_config(ckpt, cfg.model.resolve())
    assert saved_run_config(ckpt, tmp_path) is None
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(run_dict(cfg))))
    saved = saved_run_config(ckpt, tmp_path)
    new = run_config("c", tmp_path)
    assert compare(saved, cfg.model.resolve(), new, new.model.resolve()) == (
        {},
        {"optim.lr": (0.01, 3e-3)},
    )


# -- through the trainer
# ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def finished(tiny_corpus, tmp_path_factory):
    """A 2-layer run finished at step 2 (max_steps 2), with its Hugging Face export."""
    run = tmp_path_factory.mktemp("finished") / "run"
    assert main(["pretrain", os.devnull, *run_args(tiny_corpus, run, *FINISHED)]) == 0
    return run


FINISHED = ("trainer.max_steps=2", "trainer.val_check_interval=2", "checkpoint.convert_to_hf=true")


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)  # copy2: modification times kept
    return out


def _files(run):
    return {
        str(p.relative_to(run)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(run.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "first, again, line",
    [
        ((), ("model.num_layers=1",), "model.num_layers 2 -> 1"),
        (("model.num_layers=1",), (), "model.num_layers 1 -> 2"),
        ((), ("model.rotary_pct=0.5",), "model.rotary_pct 0.25 -> 0.5"),
        (
            (),
            ("data.seq_length=64", "trainer.global_batch_size=16"),
            "data.seq_length 32 -> 64, trainer.global_batch_size 8 -> 16",
        ),
    ],
    ids=["fewer-layers", "more-layers", "rotary_pct", "seq_length-and-batch"],
)
def test_resuming_another_model_fails_in_one_line_and_writes_nothing(
    first, again, line, finished, tiny_corpus, tmp_path, capsys
):
    run = _copy(finished, tmp_path) if not first else tmp_path / "run"
    if first:
        assert main(["pretrain", os.devnull, *run_args(tiny_corpus, run, *FINISHED, *first)]) == 0
    before = _files(run)
    capsys.readouterr()
    assert (
        main(
            [
                "pretrain",
                os.devnull,
                *run_args(tiny_corpus, run, *FINISHED, "trainer.max_steps=4", *again),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and line in err and "step-00000002" in err, err
    assert ("new run_dir" in err) and ("Set them back" in err or "Set it back" in err)
    assert _files(run) == before


@pytest.mark.slow
def test_allowed_changes_are_warned_recorded_and_written(finished, tiny_corpus, tmp_path, caplog):
    run = _copy(finished, tmp_path)
    with caplog.at_level(logging.WARNING, logger="lmforge"):
        assert (
            main(
                [
                    "pretrain",
                    os.devnull,
                    *run_args(tiny_corpus, run, *FINISHED, "trainer.max_steps=4", "optim.lr=1e-3"),
                ]
            )
            == 0
        )
    warnings = [r.getMessage() for r in caplog.records if r.name == "lmforge.train.resume"]
    assert len(warnings) == 1 and "optim.lr 0.003 -> 0.001, trainer.max_steps 2 -> 4" in warnings[0]
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    assert [(h["step"], h["checkpoint"], h["changes"]) for h in history] == [
        (
            2,
            "step-00000002",
            {"optim.lr": {"old": 0.003, "new": 0.001}, "trainer.max_steps": {"old": 2, "new": 4}},
        )
    ]
    saved = OmegaConf.load(run / "config.yaml")
    assert saved.optim.lr == 1e-3 and saved.trainer.max_steps == 4
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    new = run_config(tiny_corpus, run, *FINISHED, "trainer.max_steps=4", "optim.lr=1e-3")
    # the new schedule from the resumed step on
    assert rows[2]["lr"] == pytest.approx(lr_at(2, new.optim, 4))
    # The checkpoint now carries the new config: resuming it again with the same values is no
    # change.
    assert json.loads((run / "checkpoints" / "step-00000004" / "trainer.json").read_text())[
        "run_config"
    ] == (run_dict(new))


@pytest.mark.slow
def test_a_finished_run_rerun_says_so_and_writes_nothing(finished, tiny_corpus, tmp_path, capsys):
    run = _copy(finished, tmp_path)
    before = _files(run)
    assert any(name.startswith("hf/") for name in before)
    capsys.readouterr()
    assert main(["pretrain", os.devnull, *run_args(tiny_corpus, run, *FINISHED)]) == 0
    # hf/ neither rewritten nor touched; no config.yaml, metrics or history written
    assert _files(run) == before
    out = capsys.readouterr().out.strip()
    assert (
        out.count("\n") == 0 and "at step 2 already (trainer.max_steps=2): nothing to train" in out
    ), out
    # An export cut short (hf/ missing) is written again; more steps continue the run.
    shutil.rmtree(run / "hf")
    assert main(["pretrain", os.devnull, *run_args(tiny_corpus, run, *FINISHED)]) == 0
    assert (run / "hf" / "config.json").is_file()
    assert (
        main(
            ["pretrain", os.devnull, *run_args(tiny_corpus, run, *FINISHED, "trainer.max_steps=3")]
        )
        == 0
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_a_resume_under_another_vocabulary_padding_points_at_init_from():
    """Resuming under tensor parallelism a run padded for fewer ranks
    (make_vocab_size_divisible_by 128 -> 256) is refused; the weights carry over through
    model.init_from, which re-pads, not only through a new model."""
    from pathlib import Path

    from lmforge.train.resume import refusal

    checkpoint = Path("runs/x/checkpoints/step-00000010")
    line = refusal({"model.make_vocab_size_divisible_by": (128, 256)}, Path("runs/x"), checkpoint)
    assert line.endswith(
        f"continue from its weights in a new run_dir with model.init_from={checkpoint} (it re-pads "
        "the vocabulary)"
    ), line


def test_another_starting_model_is_refused_and_a_moved_one_is_noted(tmp_path, monkeypatch):
    """Rerunning a run_dir with model.init_from pointing at another model of the same shape
    resumed the checkpoint's weights and never read the new one, with the change listed as
    allowed. Now: refused, unless the old source is gone (moved: noted), or both name the same
    folder (another spelling: no change)."""
    from lmforge.errors import UserError
    from lmforge.models import build
    from lmforge.models.io import save_model
    from lmforge.models.presets import preset
    from lmforge.train.resume import ConfigDiff

    for name in ("a", "b"):
        save_model(build(preset("tiny-llama"), device="cpu"), tmp_path / name)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000002"
    checkpoint.mkdir(parents=True)
    old = run_config("c", tmp_path / "run", f"model.init_from={tmp_path / 'a'}")
    write_config(checkpoint, old.model.resolve())
    (checkpoint / "trainer.json").write_text(
        json.dumps({"run_config": run_dict(old), "working_dir": str(tmp_path)})
    )

    def diff(source):
        new = run_config("c", tmp_path / "run", f"model.init_from={source}")
        check = ConfigDiff(new, new.model.resolve(), tmp_path / "run")
        check(checkpoint)
        return check.changes

    with pytest.raises(UserError, match=r"model.init_from .*a -> .*b.* new run_dir"):
        diff(tmp_path / "b")
    monkeypatch.chdir(tmp_path)
    assert diff("a") == {}  # relative, the same folder
    (tmp_path / "a").rename(tmp_path / "moved")
    assert diff(tmp_path / "moved") == {
        "model.init_from": (str(tmp_path / "a"), str(tmp_path / "moved"))
    }


def test_another_number_of_processes_is_listed_with_what_it_changes(
    finished, tiny_corpus, tmp_path, caplog
):
    """The checkpoint says how many processes wrote it: resumed by another number, the warning
    lists it (the same global batches, regrouped: not bit for bit), where the config alone
    (parallel.data_parallel: auto) shows nothing."""
    from lmforge.train.resume import ConfigDiff, record_changes

    checkpoint = finished / "checkpoints" / "step-00000002"
    assert json.loads((checkpoint / "trainer.json").read_text())["processes"] == 1
    cfg = run_config(tiny_corpus, finished, *FINISHED)
    diff = ConfigDiff(cfg, cfg.model.resolve(), finished, processes=4)
    diff(checkpoint)
    assert diff.changes == {"processes": (1, 4)}
    same = ConfigDiff(cfg, cfg.model.resolve(), finished, processes=1)
    same(checkpoint)
    assert same.changes == {}
    with caplog.at_level(logging.WARNING, logger="lmforge"):
        record_changes(tmp_path, 2, checkpoint, diff.changes, 16)
    assert (
        "changed settings: processes 1 -> 4; other processes regroup the same global batches"
        in caplog.text
    )
