"""Training and validation data for a run: Megatron GPT samples from .bin/.idx prefixes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from lmforge.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    PretrainingSampler,
    blend_sizes,
    parse_blend,
    parse_split,
)
from lmforge.data.indexed import IndexedDataset, bin_path, idx_path
from lmforge.errors import UserError
from lmforge.train.config import RunConfig


def open_prefixes(paths: list) -> tuple[list[IndexedDataset], list[float]]:
    if not paths:
        raise UserError("data.paths is empty: give the .bin/.idx prefix(es) made by `lmforge preprocess`")
    prefixes, weights = parse_blend(paths)
    for prefix in prefixes:
        for path in (idx_path(prefix), bin_path(prefix)):
            if not Path(path).is_file():
                raise UserError(f"data prefix '{prefix}' has no {Path(path).name}: run `lmforge preprocess` "
                                "or fix data.paths")
    return [IndexedDataset(p) for p in prefixes], weights


def _split_dataset(indexed: list[IndexedDataset], weights: list[float], split: int, num_samples: int,
                   cfg: RunConfig) -> torch.utils.data.Dataset:
    """One split (0 train, 1 valid) drawing `num_samples` samples, blended when several prefixes."""
    sizes, total = blend_sizes(weights, num_samples) if len(indexed) > 1 else ([num_samples], num_samples)
    parts = []
    for ds, size in zip(indexed, sizes):
        start, end = parse_split(cfg.data.split, ds.num_documents)[split]
        parts.append(GPTDataset(ds, np.arange(start, end), size, cfg.data.seq_length, cfg.trainer.seed,
                                cfg.data.cache_dir))
    return parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, total)


def pretrain_datasets(cfg: RunConfig) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset | None]:
    t = cfg.trainer
    indexed, weights = open_prefixes(cfg.data.paths)
    train = _split_dataset(indexed, weights, 0, t.max_steps * t.global_batch_size, cfg)
    valid = None
    if t.val_check_interval and t.val_batches:
        try:
            valid = _split_dataset(indexed, weights, 1, t.val_batches * t.global_batch_size, cfg)
        except UserError:
            raise UserError(f"validation is on but split '{cfg.data.split}' leaves no validation documents: "
                            "give the split a valid part or set trainer.val_check_interval=0") from None
    return train, valid


def micro_batches(dataset, consumed: int, total: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                  num_workers: int, collate=None) -> Iterator[dict[str, torch.Tensor]]:
    sampler = PretrainingSampler(total, consumed, micro_batch_size, dp_rank, dp_size)
    # A private generator: creating a loader iterator draws a worker seed, and drawing it from the
    # global RNG would shift dropout noise between a resumed run and an uninterrupted one.
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=collate,
                        persistent_workers=num_workers > 0, generator=torch.Generator().manual_seed(0))
    return iter(loader)
