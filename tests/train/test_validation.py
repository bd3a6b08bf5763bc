"""Fine-tuning validation scores every example of the validation file exactly once, on one
process and on ranks that the examples do not divide evenly (the last step filled up with blanks
that count nowhere)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from lmforge.cli import main
from lmforge.data.classification import ClassificationDataset
from lmforge.models.io import materialize
from lmforge.models.source import load_pretrained
from lmforge.tokenizers import load_tokenizer
from lmforge.train.config import load_run_config
from lmforge.train.tasks import get_task
from lmforge.train.tasks.base import Blanks
from lmforge.train.trainer import Trainer
from tests.parallel.launch import torchrun


def _sst2(shared_data, tmp_path, rows):
    """The first `rows` sentences of SST-2's dev set."""
    lines = (shared_data / "classification" / "sst-2" / "dev.tsv").read_text().splitlines()
    path = tmp_path / f"dev-{rows}.tsv"
    path.write_text("\n".join(lines[: rows + 1]) + "\n")
    return path


def _args(model, train, valid, run_dir, *extra):
    return [
        f"model.init_from={model}",
        "data.task=classification",
        f"data.train_file={train}",
        f"data.valid_file={valid}",
        "data.seq_length=64",
        "trainer.precision=fp32",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
        "optim.lr=2e-3",
        f"run_dir={run_dir}",
        *extra,
    ]


def _direct(model, valid, tokenizer_dir) -> tuple[float, float, int]:
    """(mean loss, accuracy, examples) of `model` run on each example of `valid` by itself: no
    batch, no padding."""
    data = ClassificationDataset(valid, load_tokenizer(tokenizer_dir), 64)
    model = model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(len(data)):
            item = data[i]
            logits = model(
                item["input_ids"][None], attention_mask=item["attention_mask"][None]
            ).float()
            loss += float(F.cross_entropy(logits, item["label"][None], reduction="sum"))
            correct += int(logits.argmax(-1).item() == int(item["label"]))
    return loss / len(data), correct / len(data), len(data)


def test_blanks_fill_up_the_last_step_without_a_label():
    rows = [{"input_ids": torch.tensor([i, i]), "label": torch.tensor(i % 2)} for i in range(5)]
    blank = Blanks(rows, 8, lambda x: {**x, "label": torch.tensor(-100)})
    assert len(blank) == 8 and [int(blank[i]["label"]) for i in range(8)] == [
        0,
        1,
        0,
        1,
        0,
        -100,
        -100,
        -100,
    ]
    # a real example's shape, run and not counted
    assert torch.equal(blank[6]["input_ids"], rows[1]["input_ids"])


@pytest.mark.parametrize("task", ["sft", "mlm"])
def test_a_blank_language_model_row_has_nothing_to_score(task):
    item = {
        "input_ids": torch.arange(6),
        "labels": torch.tensor([-100, -100, 3, 4, 5, -100]),
        "attention_mask": torch.ones(6, dtype=torch.int64),
    }
    blank = get_task(task).blank(item)
    assert (blank["labels"] == -100).all() and torch.equal(blank["input_ids"], item["input_ids"])
    batch = {k: torch.stack([item[k], blank[k]]) for k in item}
    assert get_task(task).count(batch) == get_task(task).count({k: v[:1] for k, v in batch.items()})


@pytest.mark.slow
def test_every_sst2_example_is_scored_once_on_one_process(tiny_gpt2, shared_data, tmp_path):
    """37 sentences in micro-batches of 8: 4 full batches and 5 sentences (the last 5 had been
    skipped)."""
    valid = _sst2(shared_data, tmp_path, 37)
    cfg = load_run_config(
        None,
        _args(
            tiny_gpt2,
            valid,
            valid,
            tmp_path / "run",
            "trainer.micro_batch_size=8",
            "trainer.global_batch_size=8",
        ),
    )
    trainer = Trainer(cfg)
    seen = []
    metrics = trainer.task.metrics
    trainer.task.metrics = lambda *sums: seen.append(sums) or metrics(*sums)
    got = trainer.validate()
    model = materialize(trainer.mcfg, trainer.training.full_state_dict().items())
    loss, accuracy, n = _direct(model, valid, tiny_gpt2)
    assert n == 37 and seen[0][1] == 37  # every example counted, none twice
    assert got["val_accuracy"] == accuracy
    assert got["val_loss"] == pytest.approx(loss, rel=1e-5)


# A classifier under tensor parallelism: no sequence parallelism (it needs an LM head), the
# vocabulary padded for TP.
TENSOR = [
    "parallel.tensor=2",
    "parallel.sequence_parallel=false",
    "model.make_vocab_size_divisible_by=256",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["trainer.data_parallel=fsdp"], TENSOR, ["parallel.pipeline=2"]],
    ids=["fsdp", "tensor", "pipeline"],
)
def test_every_example_is_scored_once_on_two_ranks(layout, tiny_gpt2, shared_data, tmp_path):
    """33 sentences over 2 ranks in micro-batches of 4: the last step is rows 32..39, rank 0 with
    one sentence and three blanks, rank 1 (under FSDP) all blanks, yet in every collective; under
    tensor parallelism (one data rank) rows 32..35 are one sentence and three blanks; under a
    pipeline (two stages, the classifier on the second) rows 32..39 are the step's two
    microbatches. The logged validation equals the step's checkpoint run on each sentence by
    itself."""
    valid = _sst2(shared_data, tmp_path, 33)
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = torchrun(
        2,
        [
            "-m",
            "lmforge.cli",
            "finetune",
            os.devnull,
            *_args(
                tiny_gpt2,
                valid,
                valid,
                run,
                "trainer.max_steps=1",
                "trainer.val_check_interval=1",
                "trainer.micro_batch_size=4",
                "trainer.global_batch_size=8",
                *layout,
            ),
        ],
        env=env,
        timeout=400,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    loss, accuracy, n = _direct(
        load_pretrained(run / "checkpoints" / "step-00000001"), valid, tiny_gpt2
    )
    assert n == 33
    assert row["val_accuracy"] == accuracy
    assert row["val_loss"] == pytest.approx(loss, rel=1e-5)


@pytest.mark.slow
def test_a_validation_file_smaller_than_one_step_is_scored_whole(tiny_gpt2, shared_data, tmp_path):
    """3 sentences and micro-batches of 8: one step of 3 sentences and 5 blanks (this was an
    error)."""
    valid = _sst2(shared_data, tmp_path, 3)
    run = tmp_path / "run"
    assert (
        main(
            [
                "finetune",
                os.devnull,
                *_args(
                    tiny_gpt2,
                    valid,
                    valid,
                    run,
                    "trainer.max_steps=1",
                    "trainer.val_check_interval=1",
                    "trainer.micro_batch_size=8",
                    "trainer.global_batch_size=8",
                ),
            ]
        )
        == 0
    )
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    loss, accuracy, _ = _direct(
        load_pretrained(run / "checkpoints" / "step-00000001"), valid, tiny_gpt2
    )
    assert row["val_accuracy"] == accuracy and row["val_loss"] == pytest.approx(loss, rel=1e-5)
