"""Pretraining (and continued pretraining) on Megatron GPT samples from .bin/.idx prefixes."""

from __future__ import annotations

import torch

from lmforge.train.config import RunConfig
from lmforge.train.data import pretrain_datasets
from lmforge.train.tasks.base import Batch, Task, TaskData


class Pretrain(Task):
    name = "pretrain"
    pretraining = True
    data_keys = frozenset({"paths", "split", "valid_paths", "cache_dir"})
    instead = {
        "train_file": "pretraining reads Megatron .bin/.idx prefixes, data.paths (lmforge preprocess makes them)",
        "valid_file": "pretraining validates on data.valid_paths (held-out prefixes) or on data.split's validation "
                      "part",
        "split": "with data.valid_paths, data.paths trains whole and data.valid_paths validates (Megatron's "
                 "--train-data-path and --valid-data-path): unset data.split, or unset data.valid_paths to cut "
                 "data.paths by the split",
        "pad_to_multiple_of": "pretraining samples are data.seq_length tokens each, never padded",
    }

    def reads(self, data) -> frozenset[str]:
        return self.data_keys - {"split"} if data.valid_paths else self.data_keys

    def build_data(self, cfg: RunConfig, tokenizer) -> TaskData:
        train, valid = pretrain_datasets(cfg, tokenizer)
        return TaskData(train, valid)

    def inputs(self, batch: Batch):
        return batch["tokens"], batch["labels"], {}

    def example_batch(self, rows: int, length: int, vocab_size: int, device: torch.device) -> Batch:
        tokens = torch.randint(0, vocab_size, (rows, length), device=device)
        return {"tokens": tokens, "labels": tokens.clone()}

    def validation_samples(self, cfg: RunConfig, valid, unit: int) -> int:
        # The same fixed samples every time, so the validation curve is comparable between runs.
        return cfg.trainer.val_batches * cfg.trainer.global_batch_size
