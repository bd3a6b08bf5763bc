"""`lmforge eval`: the results table and JSON, a training checkpoint read directly (equal to its export), and
bad input as one line with exit != 0."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from lmforge.cli import main

pytest.importorskip("lm_eval")


def _eval(*args: str) -> int:
    return main(["eval", *args, "--device", "cpu"])


def _results(path) -> dict:
    return {task: {k: v for k, v in m.items() if "stderr" not in k and k != "alias"}
            for task, m in json.loads(path.read_text())["results"].items()}


@pytest.mark.slow
def test_prints_the_table_and_writes_the_results_json(eval_models, shared_data, tmp_path, capsys):
    out = tmp_path / "results" / "sst2.json"
    assert _eval(str(eval_models["gpt_neox"][1]), "--tasks", "sst2_local", "--data-dir", str(shared_data),
                 "--limit", "10", "--num-fewshot", "2", "--output-path", str(out)) == 0
    table = capsys.readouterr().out
    results = json.loads(out.read_text())
    acc = results["results"]["sst2_local"]["acc,none"]
    assert results["n-shot"]["sst2_local"] == 2 and results["config"]["model"] == "lmforge"
    row = next(line for line in table.splitlines() if line.startswith("|sst2_local"))
    assert float(row.split("|")[7]) == pytest.approx(acc, abs=1e-4)  # the Value column
    assert not list(out.parent.glob(".*"))  # written in one piece


def test_missing_task_data_names_the_file_and_the_fix(eval_models, tmp_path, capsys):
    assert _eval(str(eval_models["gpt_neox"][1]), "--tasks", "sst2_local", "--data-dir", str(tmp_path)) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "task sst2_local" in err and "classification/sst-2/train.tsv" in err and "--data-dir" in err


def test_lm_eval_not_installed_says_the_pip_command(eval_models, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    assert _eval(str(eval_models["gpt_neox"][1]), "--tasks", "sst2_local") == 1
    assert capsys.readouterr().err.strip() == 'error: lm-eval is not installed: pip install -e ".[eval]" (or pip ' \
                                              'install "lm-eval>=0.4.13")'


def test_bad_paths_and_numbers_are_one_line_errors(eval_models, shared_data, tmp_path, capsys):
    model = str(eval_models["gpt_neox"][1])
    run = tmp_path / "run"  # a run folder where a checkpoint was meant: the latest checkpoint is named
    for step in ("step-00000002", "step-00000010"):
        (run / "checkpoints" / step).mkdir(parents=True)
        (run / "checkpoints" / step / "trainer.json").write_text("{}")
    (tmp_path / "file.jsonl").write_text("{}\n")
    cases = [
        ([str(tmp_path / "nope"), "--tasks", "sst2_local"], "does not exist"),
        ([str(tmp_path / "file.jsonl"), "--tasks", "sst2_local"], "is a file: give the model folder that holds it"),
        ([str(run), "--tasks", "sst2_local"], f"nor a training checkpoint (trainer.json): give "
                                              f"'{run / 'checkpoints' / 'step-00000010'}'"),
        ([model, "--tasks", "sst2_local", "--include-path", str(tmp_path / "none")], "is not a folder"),
        ([model, "--tasks", " , "], "no tasks given"),
        ([model, "--tasks", "sst2_local", "--output-path", str(tmp_path)], "is a folder"),
    ]
    for args, message in cases:
        assert _eval(*args) == 1, args
        err = capsys.readouterr().err.strip()
        assert message in err and err.count("\n") == 0, err


@pytest.mark.slow
def test_unknown_task_and_hub_only_task_through_the_console_script(eval_models):
    """lm-eval's own tasks are indexed only for a name lmforge's do not have: the closest names come from all."""
    def run(*args):
        return subprocess.run([sys.executable, "-m", "lmforge.cli", "eval", str(eval_models["gpt_neox"][1]),
                               "--device", "cpu", *args], capture_output=True, text=True, timeout=300)

    r = run("--tasks", "hellaswg")
    assert r.returncode == 1 and r.stdout == ""
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: unknown task 'hellaswg' (closest: hellaswag") and "--include-path" in line
    r = run("--tasks", "sst2")  # lm-eval's GLUE task reads nyu-mll/glue from the Hub
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1
    assert line.startswith("error: task sst2 needs the Hugging Face dataset 'nyu-mll/glue' (sst2), which is not "
                           "on this machine") and "lmforge.eval.data.local_dataset" in line


@pytest.mark.slow
def test_a_training_checkpoint_evaluates_as_its_export(eval_models, shared_data, tmp_path):
    """Train a few steps from the imported NeoX, then: the checkpoint read directly == the run's HF export, by
    lmforge eval and by lm-eval's hf backend alike."""
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
    cfg = load_run_config(None, [
        f"model.init_from={lm_dir}", f"data.paths=[{corpus}]", f"data.tokenizer={lm_dir}", "data.seq_length=32",
        "trainer.max_steps=3", "trainer.global_batch_size=4", "trainer.micro_batch_size=4",
        "trainer.val_check_interval=0", "trainer.progress_bar=false", "trainer.precision=fp32",
        "trainer.device=cpu", "optim.lr=1e-2", "optim.warmup_steps=1", "checkpoint.convert_to_hf=true",
        f"run_dir={run}", "cost.peak_flops=1e11"])
    Trainer(cfg).fit()
    checkpoint = run / "checkpoints" / "step-00000003"
    assert checkpoint.is_dir() and (run / "hf" / "config.json").is_file()

    args = ["--tasks", "sst2_local,wikitext2_local", "--data-dir", str(shared_data), "--limit", "2"]
    assert _eval(str(checkpoint), *args, "--output-path", str(tmp_path / "ckpt.json")) == 0
    assert _eval(str(run / "hf"), *args, "--output-path", str(tmp_path / "export.json")) == 0
    direct, exported = _results(tmp_path / "ckpt.json"), _results(tmp_path / "export.json")
    assert direct == exported
    assert direct != _results_of_untrained(lm_dir, args, tmp_path)  # training moved the numbers
    reference = evaluate(HFLM(pretrained=str(run / "hf"), batch_size=4, device="cpu"),
                         load_tasks(["sst2_local", "wikitext2_local"], data_dir=shared_data), limit=2)["results"]
    for task, metrics in direct.items():
        for key, value in metrics.items():
            expected = reference[task][key]  # a string ("N/A") where lm-eval computes none: approx refuses it
            assert value == (expected if isinstance(expected, str) else pytest.approx(expected, rel=1e-5)), (task, key)


def _results_of_untrained(lm_dir, args, tmp_path) -> dict:
    assert _eval(str(lm_dir), *args, "--output-path", str(tmp_path / "untrained.json")) == 0
    return _results(tmp_path / "untrained.json")
