"""Pretraining (and continued pretraining) on Megatron GPT samples from .bin/.idx prefixes."""

from __future__ import annotations

from lmforge.train.config import RunConfig
from lmforge.train.data import pretrain_datasets
from lmforge.train.tasks.base import Batch, Task, TaskData


class Pretrain(Task):
    name = "pretrain"
    pretraining = True

    def build_data(self, cfg: RunConfig, tokenizer) -> TaskData:
        train, valid = pretrain_datasets(cfg, tokenizer)
        return TaskData(train, valid)

    def inputs(self, batch: Batch):
        return batch["tokens"], batch["labels"], {}

    def validation_samples(self, cfg: RunConfig, valid, unit: int) -> int:
        # The same fixed samples every time, so the validation curve is comparable between runs.
        return cfg.trainer.val_batches * cfg.trainer.global_batch_size
