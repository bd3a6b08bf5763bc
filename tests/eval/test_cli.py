"""`lmforge eval`: the results table and JSON, a training checkpoint read directly (equal to its
export), and bad input as one line with exit != 0."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lmforge.cli import main

pytest.importorskip("lm_eval")


def _eval(*args: str) -> int:
    return main(["eval", *args, "--device", "cpu"])


def _results(path) -> dict:
    return {
        task: {k: v for k, v in m.items() if "stderr" not in k and k != "alias"}
        for task, m in json.loads(path.read_text())["results"].items()
    }


@pytest.mark.slow
def test_prints_the_table_and_writes_the_results_json(eval_models, shared_data, tmp_path, capsys):
    out = tmp_path / "results" / "sst2.json"
    assert (
        _eval(
            str(eval_models["gpt_neox"][1]),
            "--tasks",
            "sst2_local",
            "--data-dir",
            str(shared_data),
            "--limit",
            "10",
            "--num-fewshot",
            "2",
            "--output-path",
            str(out),
        )
        == 0
    )
    table = capsys.readouterr().out
    results = json.loads(out.read_text())
    acc = results["results"]["sst2_local"]["acc,none"]
    assert results["n-shot"]["sst2_local"] == 2 and results["config"]["model"] == "lmforge"
    row = next(line for line in table.splitlines() if line.startswith("|sst2_local"))
    assert float(row.split("|")[7]) == pytest.approx(acc, abs=1e-4)  # the Value column
    assert not list(out.parent.glob(".*"))  # written in one piece


def test_missing_task_data_names_the_file_and_the_fix(eval_models, tmp_path, capsys):
    assert (
        _eval(str(eval_models["gpt_neox"][1]), "--tasks", "sst2_local", "--data-dir", str(tmp_path))
        == 1
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert (
        "task sst2_local" in err and "classification/sst-2/train.tsv" in err and "--data-dir" in err
    )


def test_lm_eval_not_installed_says_the_pip_command(eval_models, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    assert _eval(str(eval_models["gpt_neox"][1]), "--tasks", "sst2_local") == 1
    assert (
        capsys.readouterr().err.strip()
        == 'error: lm-eval is not installed: pip install -e ".[eval]" (or pip '
        'install "lm-eval>=0.4.13")'
    )


def test_bad_paths_and_numbers_are_one_line_errors(eval_models, shared_data, tmp_path, capsys):
    model = str(eval_models["gpt_neox"][1])
    # a run folder where a checkpoint was meant: the latest checkpoint is named
    run = tmp_path / "run"
    for step in ("step-00000002", "step-00000010"):
        (run / "checkpoints" / step).mkdir(parents=True)
        (run / "checkpoints" / step / "trainer.json").write_text("{}")
    (tmp_path / "file.jsonl").write_text("{}\n")
    bare = tmp_path / "bare"  # the weights without a tokenizer (import-hf of a weights-only folder)
    shutil.copytree(
        model,
        bare,
        ignore=shutil.ignore_patterns(
            "tokenizer*", "vocab.json", "merges.txt", "special_tokens_map.json"
        ),
    )
    cases = [
        (
            [str(bare), "--tasks", "sst2_local", "--data-dir", str(shared_data)],
            f"no single tokenizer file found in {bare}: pass --tokenizer PATH, or copy the model's tokenizer files",
        ),
        ([str(tmp_path / "nope"), "--tasks", "sst2_local"], "does not exist"),
        (
            [str(tmp_path / "file.jsonl"), "--tasks", "sst2_local"],
            "is a file: give the model folder that holds it",
        ),
        (
            [str(run), "--tasks", "sst2_local"],
            f"nor a training checkpoint (trainer.json): give "
            f"'{run / 'checkpoints' / 'step-00000010'}'",
        ),
        (
            [model, "--tasks", "sst2_local", "--include-path", str(tmp_path / "none")],
            "is not a folder",
        ),
        ([model, "--tasks", " , "], "no tasks given"),
        ([model, "--tasks", "sst2_local", "--output-path", str(tmp_path)], "is a folder"),
    ]
    for args, message in cases:
        assert _eval(*args) == 1, args
        err = capsys.readouterr().err.strip()
        assert message in err and err.count("\n") == 0, err


@pytest.mark.slow
def test_unknown_task_and_hub_only_task_through_the_console_script(eval_models):
    """lm-eval's own tasks are indexed only for a name lmforge's do not have: the closest names
    come from all."""

    def run(*args):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "lmforge.cli",
                "eval",
                str(eval_models["gpt_neox"][1]),
                "--device",
                "cpu",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )

    r = run("--tasks", "hellaswg")
    assert r.returncode == 1 and r.stdout == ""
    line = r.stderr.strip().splitlines()[-1]
    assert (
        line.startswith("error: unknown task 'hellaswg' (closest: hellaswag")
        and "--include-path" in line
    )
    r = run("--tasks", "sst2")  # lm-eval's GLUE task reads nyu-mll/glue from the Hub
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1
    assert (
        line.startswith(
            "error: task sst2 needs the Hugging Face dataset 'nyu-mll/glue' (sst2), which is not "
            "on this machine"
        )
        and "lmforge.eval.data.local_dataset" in line
    )


@pytest.mark.slow
def test_a_training_checkpoint_evaluates_as_its_export(eval_models, shared_data, tmp_path):
    """Train a few steps from the imported NeoX, then: the checkpoint read directly == the run's
    HF export, by lmforge eval and by lm-eval's hf backend alike."""
    from lm_eval.models.huggingface import HFLM

    from lmforge.data.indexed import IndexedDatasetWriter
    from lmforge.eval.harness import evaluate, load_tasks
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    hf_dir, lm_dir = eval_models["gpt_neox"]
    corpus = tmp_path / "corpus" / "text_document"
    corpus.parent.mkdir()
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(corpus, np.uint16) as writer:
        for _ in range(64):
            writer.add_document(rng.integers(1, 300, int(rng.integers(20, 80))))
    run = tmp_path / "run"
    cfg = load_run_config(
        None,
        [
            f"model.init_from={lm_dir}",
            f"data.paths=[{corpus}]",
            f"data.tokenizer={lm_dir}",
            "data.seq_length=32",
            "trainer.max_steps=3",
            "trainer.global_batch_size=4",
            "trainer.micro_batch_size=4",
            "trainer.val_check_interval=0",
            "trainer.progress_bar=false",
            "trainer.precision=fp32",
            "trainer.device=cpu",
            "optim.lr=1e-2",
            "optim.warmup_steps=1",
            "checkpoint.convert_to_hf=true",
            f"run_dir={run}",
            "cost.peak_flops=1e11",
        ],
    )
    Trainer(cfg).fit()
    checkpoint = run / "checkpoints" / "step-00000003"
    assert checkpoint.is_dir() and (run / "hf" / "config.json").is_file()

    args = ["--tasks", "sst2_local,wikitext2_local", "--data-dir", str(shared_data), "--limit", "2"]
    assert _eval(str(checkpoint), *args, "--output-path", str(tmp_path / "ckpt.json")) == 0
    assert _eval(str(run / "hf"), *args, "--output-path", str(tmp_path / "export.json")) == 0
    direct, exported = _results(tmp_path / "ckpt.json"), _results(tmp_path / "export.json")
    assert direct == exported
    assert direct != _results_of_untrained(lm_dir, args, tmp_path)  # training moved the numbers
    reference = evaluate(
        HFLM(pretrained=str(run / "hf"), batch_size=4, device="cpu"),
        load_tasks(["sst2_local", "wikitext2_local"], data_dir=shared_data),
        limit=2,
    )["results"]
    for task, metrics in direct.items():
        for key, value in metrics.items():
            # a string ("N/A") where lm-eval computes none: approx refuses it
            expected = reference[task][key]
            assert value == (
                expected if isinstance(expected, str) else pytest.approx(expected, rel=1e-5)
            ), (task, key)


def _results_of_untrained(lm_dir, args, tmp_path) -> dict:
    assert _eval(str(lm_dir), *args, "--output-path", str(tmp_path / "untrained.json")) == 0
    return _results(tmp_path / "untrained.json")


def _no_evaluation(monkeypatch):
    """Make loading the model fail loudly: a check that must come first is reached before it, or
    the test fails."""
    import lmforge.eval.lm

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(lmforge.eval.lm, "LMForgeLM", refuse)


def test_an_output_path_under_a_file_is_refused_before_the_evaluation(
    eval_models, shared_data, tmp_path, monkeypatch, capsys
):
    """It once evaluated every task, then failed making the folder with a FileExistsError
    traceback."""
    import lmforge.eval.harness

    _no_evaluation(monkeypatch)
    blocker = tmp_path / "ro_file"
    blocker.write_text("mine\n")
    model, args = (
        str(eval_models["gpt_neox"][1]),
        ["--tasks", "sst2_local", "--data-dir", str(shared_data)],
    )
    for output in (blocker / "r.json", blocker / "a" / "b" / "r.json"):
        assert _eval(model, *args, "--limit", "4", "--output-path", str(output)) == 1
        err = capsys.readouterr().err.strip()
        assert err == (
            f"error: --output-path {output} cannot be written: '{blocker}' is a file, not a folder: give "
            "a path in another folder (or move that file away)"
        )
    assert blocker.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "ro_file"
    ]

    # a folder this user cannot write (root writes any: pretend)
    real = lmforge.eval.harness.os.access
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(
        lmforge.eval.harness.os,
        "access",
        lambda p, mode, **kw: False if Path(p) == locked else real(p, mode, **kw),
    )
    assert _eval(model, *args, "--output-path", str(locked / "new" / "r.json")) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err.count("\n") == 0
        and f"this user cannot write in '{locked}' (to make {locked / 'new'})" in err
    )
    assert not list(locked.iterdir())


def test_results_are_written_whole_through_a_link_and_a_late_failure_is_one_line(tmp_path):
    from lmforge.errors import UserError
    from lmforge.eval.harness import check_results_path, write_results

    target = tmp_path / "target.json"
    target.write_text("old\n")
    (tmp_path / "link.json").symlink_to(target)
    path = check_results_path(tmp_path / "link.json")
    write_results(path, {"results": {"t": {"acc,none": 0.5}}, "samples": {"t": []}})
    assert (tmp_path / "link.json").is_symlink()  # the file it points to is written, the link kept
    # samples left out
    assert json.loads(target.read_text()) == {"results": {"t": {"acc,none": 0.5}}}
    # no temporary left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target.json"]

    late = check_results_path(tmp_path / "later" / "r.json")
    (tmp_path / "later").write_text("made by someone else during the evaluation\n")
    with pytest.raises(
        UserError,
        match=r"^--output-path .*r.json cannot be written \(.*\): give a path in a folder",
    ):
        write_results(late, {"results": {}})


def test_max_length_past_the_models_positions_is_refused(
    eval_models, shared_data, monkeypatch, capsys
):
    """A rotary model ran on past its 128 positions without a word, and its perplexity changed."""
    from lmforge.errors import UserError
    from lmforge.eval.lm import LMForgeLM

    lm_dir = eval_models["gpt_neox"][1]
    with pytest.raises(
        UserError,
        match=r"^this model's context is 128 tokens .* max_length is 129: give max_length "
        r"128 or less, or omit it",
    ):
        LMForgeLM(str(lm_dir), device="cpu", max_length=129)
    assert LMForgeLM(str(lm_dir), device="cpu", max_length="128").max_length == 128
    assert LMForgeLM(str(lm_dir), device="cpu").max_length == 128

    _no_evaluation(monkeypatch)  # the CLI refuses before reading the tasks' data or the weights
    args = ["--tasks", "wikitext2_local", "--data-dir", str(shared_data), "--limit", "1"]
    for model in (lm_dir, eval_models["gpt_neox"][0]):  # an lmforge folder, a Hugging Face one
        assert _eval(str(model), *args, "--max-length", "1000") == 1
        assert capsys.readouterr().err.strip() == (
            "error: this model's context is 128 tokens "
            "(max_position_embeddings) and --max-length is 1000: give "
            "--max-length 128 or less, or omit it to use the model's"
        )
    assert _eval(str(lm_dir), *args, "--max-length", "0") == 1
    assert capsys.readouterr().err.strip() == "error: --max-length must be >= 1, got 0"


def test_missing_data_of_a_packaged_task_advises_data_dir_or_a_copy_not_editing_the_package(
    eval_models, shared_data, tmp_path, capsys
):
    from lmforge.eval.harness import TASKS_DIR

    model = str(eval_models["gpt_neox"][1])
    # no --data-dir: the files are not beside the packaged YAML
    assert _eval(model, "--tasks", "sst2_local") == 1
    err = capsys.readouterr().err.strip()
    packaged = TASKS_DIR / "sst2_local.yaml"
    assert err == (
        "error: task sst2_local: task data file 'classification/sst-2/train.tsv' not found (no --data-dir "
        "given): pass --data-dir DIR, the folder holding classification/sst-2/train.tsv and "
        f"classification/sst-2/dev.tsv, or copy {packaged} to a folder of your own, edit its "
        "dataset_kwargs.data_files there and pass --include-path THAT_FOLDER"
    )
    # The advice works: the copy, edited, overrides the packaged task of the same name.
    mine = tmp_path / "my_tasks"
    mine.mkdir()
    text = packaged.read_text().replace(
        "classification/sst-2/", f"{shared_data}/classification/sst-2/"
    )
    (mine / "sst2_local.yaml").write_text(text)
    out = tmp_path / "r.json"
    assert (
        _eval(
            model,
            "--tasks",
            "sst2_local",
            "--include-path",
            str(mine),
            "--limit",
            "2",
            "--output-path",
            str(out),
        )
        == 0
    )
    assert json.loads(out.read_text())["n-samples"]["sst2_local"]["effective"] == 2
