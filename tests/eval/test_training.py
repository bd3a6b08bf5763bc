"""Downstream evals inside training (eval.tasks, eval.every_n_steps): logged where the other
metrics go, equal to `lmforge eval` on the checkpoint of that step, and without changing what the
run trains."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lmforge.cli import main
from lmforge.errors import UserError
from tests.parallel.launch import torchrun

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from lmforge.data.indexed import IndexedDatasetWriter

    prefix = tmp_path_factory.mktemp("corpus") / "text_document"
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(64):
            writer.add_document(rng.integers(1, 300, int(rng.integers(20, 80))))
    return prefix


def _config(lm_dir, corpus, run_dir, *overrides):
    from lmforge.train.config import load_run_config

    return load_run_config(
        None,
        [
            f"model.init_from={lm_dir}",
            f"data.paths=[{corpus}]",
            f"data.tokenizer={lm_dir}",
            "data.seq_length=32",
            "trainer.max_steps=4",
            "trainer.global_batch_size=4",
            "trainer.micro_batch_size=2",
            "trainer.val_check_interval=0",
            "trainer.progress_bar=false",
            "trainer.precision=fp32",
            "trainer.device=cpu",
            "optim.lr=1e-2",
            "optim.warmup_steps=1",
            "checkpoint.every_n_steps=2",
            "checkpoint.save_top_k=-1",
            "trainer.log_every_n_steps=3",
            f"run_dir={run_dir}",
            "cost.peak_flops=1e11",
            # dropout draws from the RNG every step: evals must leave it as it was
            "model.dropout=0.1",
            *overrides,
        ],
    )


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_evals_are_logged_and_equal_lmforge_eval_on_the_checkpoint(
    eval_models, corpus, shared_data, tmp_path, capfd
):
    from lmforge.train.trainer import Trainer

    lm_dir = eval_models["gpt_neox"][1]
    evals = [
        "eval.tasks=[sst2_local,wikitext2_local]",
        "eval.every_n_steps=2",
        "eval.limit=3",
        f"eval.data_dir={shared_data}",
        "eval.num_fewshot=1",
    ]
    capfd.readouterr()
    Trainer(_config(lm_dir, corpus, tmp_path / "with", *evals)).fit()
    # no progress bars (lm-eval's or lmforge's) among the training lines
    assert "%|" not in capfd.readouterr().err
    Trainer(_config(lm_dir, corpus, tmp_path / "without", "trainer.log_every_n_steps=1")).fit()
    rows = _rows(tmp_path / "with")
    logged = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in rows}
    # every 2 steps, logged even off log_every_n_steps
    assert sorted(s for s, m in logged.items() if m) == [2, 4]
    assert set(logged[2]) == {
        "eval/sst2_local/acc",
        "eval/wikitext2_local/word_perplexity",
        "eval/wikitext2_local/byte_perplexity",
        "eval/wikitext2_local/bits_per_byte",
    }
    # Training is untouched by the evals (lm-eval seeds every RNG; the run's states are put back).
    plain = {r["step"]: r["loss"] for r in _rows(tmp_path / "without")}
    # log_every_n_steps=3: steps 3 and the run's first and last, and those with evals.
    assert {r["step"]: r["loss"] for r in rows} == {s: plain[s] for s in (1, 2, 3, 4)}
    # Each logged figure is what `lmforge eval` gives on the checkpoint of that step.
    for step in (2, 4):
        out = tmp_path / f"step{step}.json"
        checkpoint = tmp_path / "with" / "checkpoints" / f"step-{step:08d}"
        assert (
            main(
                [
                    "eval",
                    str(checkpoint),
                    "--tasks",
                    "sst2_local,wikitext2_local",
                    "--data-dir",
                    str(shared_data),
                    "--limit",
                    "3",
                    "--num-fewshot",
                    "1",
                    "--device",
                    "cpu",
                    "--output-path",
                    str(out),
                ]
            )
            == 0
        )
        results = json.loads(out.read_text())["results"]
        for key, value in logged[step].items():
            _, task, metric = key.split("/")
            assert value == pytest.approx(results[task][f"{metric},none"], rel=1e-6), (step, key)
    events = list((tmp_path / "with" / "tensorboard").glob("events.*"))
    assert events and b"eval/sst2_local/acc" in events[0].read_bytes()
    # lmforge compare draws them: a panel per metric holding the logged points, the last ones in the
    # table.
    from lmforge.report import compare, plots
    from lmforge.report.compare import table_rows

    report = compare(
        [tmp_path / "with", tmp_path / "without"], tmp_path / "report", labels=["with", "without"]
    )
    assert report.files["downstream"].is_file()
    panels = {
        ax.get_title(): ax.lines for ax in plots.downstream_figure(report.runs).axes if ax.axison
    }
    assert set(panels) == {key.removeprefix("eval/").replace("/", " ") for key in logged[2]}
    for key in logged[2]:
        # the run without evals draws nothing
        (line,) = panels[key.removeprefix("eval/").replace("/", " ")]
        assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [
            logged[2][key],
            logged[4][key],
        ]
    header, with_row, without_row = table_rows(report.runs)
    cells = dict(zip(header, with_row))
    assert cells["sst2_local acc"] == f"{logged[4]['eval/sst2_local/acc']:.4g}"
    assert without_row[-len(logged[4]) :] == ["-"] * len(logged[4])


def test_a_missing_task_file_fails_before_any_compute(eval_models, corpus, tmp_path):
    from lmforge.train.trainer import Trainer

    cfg = _config(
        eval_models["gpt_neox"][1],
        corpus,
        tmp_path / "run",
        "eval.tasks=[sst2_local]",
        f"eval.data_dir={tmp_path}",
    )
    with pytest.raises(
        UserError,
        match="task sst2_local: task data file 'classification/sst-2/train.tsv' not found",
    ):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("eval.every_n_steps=-1", "eval.every_n_steps must be >= 0"),
        ("eval.limit=0", "eval.limit must be > 0"),
        ("eval.tasks=sst2_local", "eval.tasks: expected a list"),
    ],
)
def test_bad_eval_settings_are_one_line_errors(override, message, eval_models, corpus, tmp_path):
    from lmforge.train.trainer import Trainer

    with pytest.raises(UserError, match=message):
        Trainer(
            _config(
                eval_models["gpt_neox"][1],
                corpus,
                tmp_path / "run",
                "eval.tasks=[sst2_local]",
                override,
            )
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["trainer.data_parallel=fsdp"],
        # the padded vocabulary splits in two
        ["parallel.tensor=2", "model.make_vocab_size_divisible_by=256"],
        ["parallel.pipeline=2"],
    ],
    ids=["fsdp2", "tensor2", "pipeline2"],
)
def test_evals_of_a_sharded_model_equal_lmforge_eval_in_one_process(
    layout, eval_models, corpus, shared_data, tmp_path
):
    """Two ranks hold the model in shards; rank 0 gathers it whole for the evals. What it logs
    equals `lmforge eval` of the checkpoint of that step in this one process: a gather that mixed
    up shards would score another model."""
    import os

    lm_dir, run = eval_models["gpt_neox"][1], tmp_path / "run"
    tasks = ["--tasks", "sst2_local,wikitext2_local", "--limit", "2", "--num-fewshot", "1"]
    args = [
        f"model.init_from={lm_dir}",
        f"data.paths=[{corpus}]",
        f"data.tokenizer={lm_dir}",
        "data.seq_length=32",
        "trainer.max_steps=2",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=2",
        "trainer.val_check_interval=0",
        "trainer.progress_bar=false",
        "trainer.precision=fp32",
        "trainer.device=cpu",
        "optim.lr=1e-2",
        "optim.warmup_steps=1",
        "checkpoint.every_n_steps=2",
        "cost.peak_flops=1e11",
        f"run_dir={run}",
        "eval.tasks=[sst2_local,wikitext2_local]",
        "eval.limit=2",
        "eval.num_fewshot=1",
        f"eval.data_dir={shared_data}",
        *layout,
    ]
    r = torchrun(2, ["-m", "lmforge.cli", "pretrain", os.devnull, *args], timeout=420)
    assert r.returncode == 0, r.stderr[-4000:]
    logged = {k: v for k, v in _rows(run)[-1].items() if k.startswith("eval/")}
    assert len(logged) == 4
    out = tmp_path / "one.json"
    assert (
        main(
            [
                "eval",
                str(run / "checkpoints" / "step-00000002"),
                *tasks,
                "--data-dir",
                str(shared_data),
                "--device",
                "cpu",
                "--output-path",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())["results"]
    for key, value in logged.items():
        _, task, metric = key.split("/")
        assert value == pytest.approx(results[task][f"{metric},none"], rel=1e-6), key
    # Not the model the run started from: the gathered weights are the trained ones.
    assert (
        main(
            [
                "eval",
                str(lm_dir),
                *tasks,
                "--data-dir",
                str(shared_data),
                "--device",
                "cpu",
                "--output-path",
                str(tmp_path / "start.json"),
            ]
        )
        == 0
    )
    start = json.loads((tmp_path / "start.json").read_text())["results"]["wikitext2_local"][
        "word_perplexity,none"
    ]
    assert start != pytest.approx(logged["eval/wikitext2_local/word_perplexity"], rel=1e-6)
