"""BERT masked-language-model samples from a Megatron indexed dataset.

Samples. The dataset's tokens are read as one stream, sequence after sequence in file order
(documents keep whatever separator `preprocess --append-eod` gave them), and cut into chunks of
`seq_length - 2`; sample = [CLS] chunk [SEP], the last one right-padded with `pad_id`
(attention_mask 0 there). Every token is used once per epoch and no sample is longer than
`seq_length`. This is RoBERTa's FULL-SENTENCES input, without BERT's next-sentence pairs.

Masking (BERT, Devlin et al. 2019, section 3.1; Google's create_pretraining_data.py): of the
positions that hold no special token, round(15%) (at least one) are chosen; of those, 80% become
[MASK], 10% a random token, 10% stay as they are, decided per position. `labels` hold the original
token at chosen positions and IGNORE_INDEX (-100) elsewhere. Special tokens ([CLS], [SEP], [MASK],
pad and `special_ids`, e.g. [UNK] or an eod) are never chosen and never drawn as random tokens.

Determinism: sample i's masking comes from a generator seeded with (seed, i) alone, so sample i is
the same in any process, in any order and after a resume. With `num_epochs` > 1, sample i reads
chunk i % num_chunks: a later epoch sees the same text masked afresh (RoBERTa's dynamic masking).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lmforge.data.collate import IGNORE_INDEX, PadCollator
from lmforge.data.indexed import IndexedDataset
from lmforge.errors import UserError

logger = logging.getLogger(__name__)


class MLMDataset(Dataset):
    """Masked [CLS] ... [SEP] samples of `seq_length` tokens; items: input_ids, labels,
    attention_mask."""

    def __init__(
        self,
        data: IndexedDataset | str | Path,
        seq_length: int,
        vocab_size: int,
        cls_id: int,
        sep_id: int,
        mask_id: int,
        pad_id: int = 0,
        special_ids: Sequence[int] = (),
        seed: int = 1234,
        mask_prob: float = 0.15,
        num_epochs: int = 1,
    ):
        self.data = data if isinstance(data, IndexedDataset) else IndexedDataset(data)
        if seq_length < 3:
            raise UserError(
                f"seq_length must be at least 3 ([CLS], a token, [SEP]), not {seq_length}"
            )
        if not 0 < mask_prob < 1:
            raise UserError(f"mask_prob must be between 0 and 1, not {mask_prob}")
        if seed < 0 or num_epochs < 1:
            raise UserError(f"seed must be >= 0 and num_epochs >= 1, not {seed} and {num_epochs}")
        self.seq_length, self.vocab_size, self.seed, self.mask_prob = (
            seq_length,
            vocab_size,
            seed,
            mask_prob,
        )
        self.cls_id, self.sep_id, self.mask_id, self.pad_id = cls_id, sep_id, mask_id, pad_id
        self.special_ids = np.unique([cls_id, sep_id, mask_id, pad_id, *special_ids]).astype(
            np.int64
        )
        if ((self.special_ids < 0) | (self.special_ids >= vocab_size)).any():
            raise UserError(
                f"special ids {self.special_ids.tolist()} must lie in the vocabulary [0, {vocab_size})"
            )
        self.random_pool = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), self.special_ids)
        if not len(self.random_pool):
            raise UserError(
                f"every id of the {vocab_size}-token vocabulary is special: nothing to draw"
            )

        self.chunk = seq_length - 2
        # stream offset after each sequence
        self.seq_ends = np.cumsum(self.data.sequence_lengths, dtype=np.int64)
        self.num_tokens = int(self.seq_ends[-1]) if len(self.seq_ends) else 0
        if self.num_tokens == 0:
            raise UserError(
                f"indexed dataset {self.data.prefix} holds no tokens: re-run preprocess on real text"
            )
        self.num_chunks = -(-self.num_tokens // self.chunk)
        self.num_epochs = num_epochs
        self.collate = PadCollator(pad_id)
        logger.info(
            "MLM over %s: %d tokens -> %d samples of %d per epoch, %d epoch(s)",
            self.data.prefix,
            self.num_tokens,
            self.num_chunks,
            seq_length,
            num_epochs,
        )

    def __len__(self) -> int:
        return self.num_chunks * self.num_epochs

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Stream tokens [start, stop), read across sequence boundaries."""
        parts = []
        s = int(np.searchsorted(self.seq_ends, start, side="right"))
        while start < stop:
            seq_start = int(self.seq_ends[s - 1]) if s else 0
            take = min(stop, int(self.seq_ends[s])) - start
            if take > 0:
                parts.append(self.data.get(s, start - seq_start, take))
            start += max(take, 0)
            s += 1
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        c = i % self.num_chunks
        text = self.tokens(c * self.chunk, min((c + 1) * self.chunk, self.num_tokens))
        n = len(text) + 2
        ids = np.full(self.seq_length, self.pad_id, np.int64)
        ids[0], ids[1 : n - 1], ids[n - 1] = self.cls_id, text, self.sep_id
        labels = np.full(self.seq_length, IGNORE_INDEX, np.int64)

        rng = np.random.default_rng([self.seed, i])
        candidates = np.flatnonzero(~np.isin(ids[:n], self.special_ids))
        if len(candidates):
            k = max(1, round(self.mask_prob * len(candidates)))
            chosen = np.sort(rng.choice(candidates, k, replace=False))
            labels[chosen] = ids[chosen]
            u = rng.random(k)
            ids[chosen[u < 0.8]] = self.mask_id
            rand = chosen[(u >= 0.8) & (u < 0.9)]
            ids[rand] = self.random_pool[rng.integers(len(self.random_pool), size=len(rand))]
        mask = np.zeros(self.seq_length, np.int64)
        mask[:n] = 1
        return {
            "input_ids": torch.from_numpy(ids),
            "labels": torch.from_numpy(labels),
            "attention_mask": torch.from_numpy(mask),
        }
