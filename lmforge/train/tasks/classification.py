"""Sequence classification: text + label rows, a score/classifier head on the model."""

from __future__ import annotations

import torch

from lmforge.models.decoder import Decoder
from lmforge.parallel.data_parallel import unwrap
from lmforge.train.config import RunConfig
from lmforge.train.loss import IGNORE_INDEX
from lmforge.train.tasks.base import (
    Batch,
    Epochs,
    Task,
    TaskData,
    data_files,
    logits_loss,
    total_samples,
    with_padding,
)


class Classification(Task):
    name = "classification"

    def build_data(self, cfg: RunConfig, tokenizer) -> TaskData:
        from lmforge.data.classification import ClassificationDataset

        d = cfg.data
        train_file, valid_file = data_files(cfg)
        special = [tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]")]
        prefix, suffix = ([special[0]], [special[1]]) if None not in special else ([], [])
        # Both files must be labelled: one without the label column would read as unlabelled (for
        # prediction) and the run would build a head of no classes, then fail at its first step.
        columns = {"text_key": d.text_key, "label_key": d.label_key}
        train = ClassificationDataset(
            train_file,
            tokenizer,
            d.seq_length,
            **columns,
            prefix_ids=prefix,
            suffix_ids=suffix,
            require_labels=True,
        )
        valid = (
            ClassificationDataset(
                valid_file,
                tokenizer,
                d.seq_length,
                **columns,
                label_names=train.label_names,
                prefix_ids=prefix,
                suffix_ids=suffix,
                require_labels=True,
            )
            if valid_file
            else None
        )
        data = TaskData(
            Epochs(train, total_samples(cfg), cfg.trainer.seed),
            valid,
            train.collate,
            train.num_labels,
            train.label_names,
        )
        return with_padding(data, cfg)

    def inputs(self, batch: Batch):
        return batch["input_ids"], batch["label"], {"attention_mask": batch["attention_mask"]}

    def count(self, batch: Batch) -> int:
        # examples, not tokens (blanks not counted)
        return int((batch["label"] != IGNORE_INDEX).sum())

    def blank(self, example: Batch) -> Batch:
        return {**example, "label": torch.tensor(IGNORE_INDEX)}

    def loss(
        self, model: torch.nn.Module, batch: Batch, fused: bool = True
    ) -> tuple[torch.Tensor, ...]:
        input_ids, labels, inputs = self.inputs(batch)
        # the collator pads on the right: causal attention needs no mask
        if isinstance(unwrap(model), Decoder):
            inputs = {**inputs, "right_padded": True}
        logits = model(input_ids, **inputs).float()
        # The counts as device scalars: read once per step with the rest (count() reads the host
        # batch).
        return (
            logits_loss(logits, labels),
            (labels != IGNORE_INDEX).sum(),
            self.correct(logits, labels),
        )

    def correct(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # a blank's label (IGNORE_INDEX) is never a class
        return (logits.argmax(-1) == labels).sum()

    def metrics(self, loss_sum: float, count: float, correct: float) -> dict[str, float]:
        return {"val_loss": loss_sum / count, "val_accuracy": correct / count}
