"""GPT pretraining samples drawn the way Megatron-core draws them, in numpy only.

A split is a set of sequence ids of an `IndexedDataset` (Megatron calls them "documents"; after
`lmforge preprocess` each JSON line is one). Three indices turn it into fixed-length samples:

* document index: the split's ids repeated once per epoch and shuffled with
  `numpy.random.RandomState(seed)`. When the last epoch contributes fewer than 80% of an epoch's
  samples it is shuffled on its own, so a short tail epoch does not spread its few documents
  over the whole run ("separate final epoch").
* sample index: the shuffled documents laid end to end form one token stream; sample i covers
  stream positions [i * seq_length, (i + 1) * seq_length], i.e. seq_length + 1 tokens, the last
  token shared with the next sample so that inputs and labels both have seq_length tokens.
  Row i holds (position in the document index, token offset) of the sample's first token.
* shuffle index: a permutation of the sample ids (again with the final epoch kept apart).

All three are bit-identical to megatron-core 0.16 (`GPTDataset`, `helpers.build_sample_idx`),
so a run started there resumes here on the same samples. They are cached as `.npy` files named
by a hash of every setting they depend on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from lmforge.errors import UserError

logger = logging.getLogger(__name__)

# Megatron separates the final epoch when it yields fewer than this fraction of an epoch's samples.
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
CACHE_VERSION = 1


def parse_split(split: str, num_sequences: int) -> list[tuple[int, int]]:
    """Train/valid/test sequence ranges [start, end) for a split string such as "969,30,1".

    A GPT dataset splits its IndexedDataset by sequence (megatron-core's numel_low_level_dataset),
    not by document: an empty document has no sequence, a document of several sentences has several.
    The weights are normalised and turned into boundaries exactly as Megatron does (float64 running
    sums, Python's round-half-even), so the same string selects the same sequences. Missing trailing
    weights count as 0; an empty split gives an empty range.
    """
    if not re.fullmatch(r"\s*[0-9.]+\s*(?:[,/]\s*[0-9.]+\s*)*", split or ""):
        raise UserError(
            f"split '{split}' is not a list of non-negative numbers: write e.g. '969,30,1'"
        )
    try:
        weights = [float(w) for w in re.findall(r"[.0-9]+", split)]
    except ValueError as err:
        raise UserError(f"split '{split}' has a malformed number: write e.g. '969,30,1'") from err
    if len(weights) > 3:
        raise UserError(
            f"split '{split}' has {len(weights)} parts: give at most three (train, valid, test)"
        )
    weights += [0.0] * (3 - len(weights))
    w = np.array(weights, dtype=np.float64)
    if not w.sum() > 0:
        raise UserError(f"split '{split}' sums to zero: give at least one positive weight")
    bounds = [0.0]
    for fraction in (w / w.sum()).tolist():
        bounds.append(bounds[-1] + fraction)
    ranges = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        start = int(round(lo * float(num_sequences)))
        end = int(round(hi * float(num_sequences))) if hi > lo else start
        ranges.append((start, end))
    return ranges


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Fewest passes over the split that hold `num_samples` samples of seq_length + 1 tokens."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise UserError("the data split has no tokens: check the split string and the data files")
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """`documents` repeated `num_epochs` times and shuffled; a separate final epoch is shuffled
    alone."""
    if separate_final_epoch and num_epochs > 1:
        head = build_document_index(documents, num_epochs - 1, rng, False)
        tail = build_document_index(documents, 1, rng, False)
        return np.concatenate((head, tail))
    index = np.tile(np.asarray(documents).astype(np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
) -> np.ndarray:
    """(document-index position, token offset) of each sample boundary; shape [num_samples + 1, 2].

    Sample boundaries sit at stream positions q = i * seq_length. A boundary is recorded in the
    first document that still has a token at or after q, which is the first document whose end
    lies beyond q (empty documents are skipped over, as in Megatron's walk).
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    lengths = np.asarray(sequence_lengths)
    doc_ends = np.cumsum(lengths[document_index], dtype=np.int64)
    positions = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    docs = np.searchsorted(doc_ends, positions, side="right")
    offsets = positions - (doc_ends[docs] - lengths[document_index[docs]])
    dtype = (
        np.int32
        if max(len(document_index), int(lengths.max())) <= np.iinfo(np.int32).max
        else np.int64
    )
    sample_index = np.zeros((num_samples + 1, 2), dtype=dtype)
    sample_index[1:, 0] = docs
    sample_index[1:, 1] = offsets
    return sample_index


def build_shuffle_index(
    num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
    """A permutation of [0, num_samples) followed by one of [num_samples, total_size)."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    head = np.arange(num_samples, dtype=dtype)
    rng.shuffle(head)
    if num_samples == total_size:
        return head
    tail = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate((head, tail))


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    documents: np.ndarray,
    num_samples: int | None,
    seq_length: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The document, sample and shuffle indices of one split (see the module docstring)."""
    if seq_length < 2:
        raise UserError(f"seq_length must be at least 2, got {seq_length}")
    tokens_per_epoch = int(np.sum(np.asarray(sequence_lengths)[documents], dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    separate_final_epoch = False
    if num_epochs > 1:
        samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final_epoch = num_samples - samples_before_final < int(
            SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch
        )
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    sample_index = build_sample_index(
        sequence_lengths, document_index, seq_length, num_epochs, tokens_per_epoch
    )
    total = len(sample_index) - 1
    shuffle_index = build_shuffle_index(
        samples_before_final if separate_final_epoch else total, total, rng
    )
    return document_index, sample_index, shuffle_index


def _save_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class GPTDataset(torch.utils.data.Dataset):
    """Fixed-length causal-LM samples over one split of an `IndexedDataset`.

    `dataset[i]` is `{"tokens": int64[seq_length], "labels": int64[seq_length]}`, the labels being
    the tokens shifted by one (Megatron's `add_extra_token_to_sequence=True`); `sample(i)` gives
    the raw seq_length + 1 tokens. `len(dataset)` may exceed `num_samples` (whole epochs are
    built). `num_samples=None` builds exactly one epoch. Indices are cached under `cache_dir`
    (default: `<data dir>/cache/`) and reused when every setting matches.
    """

    def __init__(
        self,
        indexed,
        split_documents: np.ndarray,
        num_samples: int | None,
        seq_length: int,
        seed: int,
        cache_dir: str | Path | None = None,
        use_cache: bool = True,
    ):
        self.indexed = indexed
        self.documents = np.asarray(split_documents, dtype=np.int64)
        self.num_samples = num_samples
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        if len(self.documents) == 0:
            raise UserError("this data split has no documents: widen the split or give more data")
        if self.documents.min() < 0 or self.documents.max() >= len(indexed.sequence_lengths):
            raise UserError(
                f"split documents reach outside the {len(indexed.sequence_lengths)} sequences of the data"
            )
        prefix = Path(getattr(indexed, "prefix", "") or "dataset")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else prefix.parent / "cache"
        self.description = json.dumps(
            {
                "class": "GPTDataset",
                "version": CACHE_VERSION,
                "prefix": prefix.name,
                # The indices depend on the data only through the sequence lengths: hash those, so a
                # re-preprocessed corpus never reuses stale indices.
                "sequence_lengths": hashlib.md5(
                    np.ascontiguousarray(indexed.sequence_lengths)
                ).hexdigest(),
                "documents": [
                    len(self.documents),
                    hashlib.md5(self.documents.tobytes()).hexdigest(),
                ],
                "num_samples": num_samples,
                "seq_length": self.seq_length,
                "seed": self.seed,
                "add_extra_token_to_sequence": True,
            },
            indent=2,
        )
        digest = hashlib.md5(self.description.encode()).hexdigest()
        self.cache_paths = {
            name: self.cache_dir / f"{prefix.name}-{digest}-{name}.npy" for name in INDEX_NAMES
        }
        self.description_path = self.cache_dir / f"{prefix.name}-{digest}-description.json"
        self.loaded_from_cache = False
        if (
            use_cache
            and self.description_path.is_file()
            and all(p.is_file() for p in self.cache_paths.values())
        ):
            indices = [np.load(self.cache_paths[name], mmap_mode="r") for name in INDEX_NAMES]
            self.loaded_from_cache = True
        else:
            t0 = time.perf_counter()
            indices = build_gpt_indices(
                indexed.sequence_lengths, self.documents, num_samples, self.seq_length, self.seed
            )
            logger.info(
                "built GPT indices for %s: %d samples in %.2f s",
                prefix.name,
                len(indices[2]),
                time.perf_counter() - t0,
            )
            if use_cache:
                self._write_cache(indices)
        self.document_index, self.sample_index, self.shuffle_index = indices

    def _write_cache(self, indices) -> None:
        # Several ranks may build at once: each writes whole files under temporary names and renames
        # them, the description last, so a reader never sees a partial set.
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            for name, array in zip(INDEX_NAMES, indices):
                _save_atomic(
                    self.cache_paths[name], lambda f, a=array: np.save(f, a, allow_pickle=False)
                )
            _save_atomic(self.description_path, lambda f: f.write(self.description.encode()))
        except OSError as err:
            logger.warning(
                "could not cache GPT indices in %s (%s); they will be rebuilt next time (data.cache_dir "
                "names a writable folder for them)",
                self.cache_dir,
                err,
            )

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample(self, idx: int) -> np.ndarray:
        """The seq_length + 1 tokens of sample `idx` (after shuffling), as int64."""
        i = int(self.shuffle_index[idx])
        (first, first_offset), (last, last_offset) = self.sample_index[i], self.sample_index[i + 1]
        first, first_offset, last, last_offset = (
            int(first),
            int(first_offset),
            int(last),
            int(last_offset),
        )
        if first == last:
            parts = [
                self.indexed.get(
                    int(self.document_index[first]), first_offset, last_offset - first_offset + 1
                )
            ]
        else:
            parts = [self.indexed.get(int(self.document_index[first]), first_offset)]
            parts += [self.indexed.get(int(self.document_index[j])) for j in range(first + 1, last)]
            parts.append(self.indexed.get(int(self.document_index[last]), 0, last_offset + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        text = torch.from_numpy(self.sample(idx))
        return {"tokens": text[:-1], "labels": text[1:]}


def parse_blend(blend: Sequence[str | float]) -> tuple[list[str], list[float]]:
    """Split `[0.7, "prefixA", 0.3, "prefixB"]` into prefixes and weights; one bare prefix has
    weight 1."""
    blend = list(blend)
    if len(blend) == 1 and isinstance(blend[0], str | os.PathLike):
        return [str(blend[0]).strip()], [1.0]
    if not blend or len(blend) % 2:
        raise UserError(
            f"data blend {blend} must alternate weight and prefix, e.g. [0.7, 'a', 0.3, 'b']"
        )
    prefixes, weights = [], []
    for raw_weight, prefix in zip(blend[0::2], blend[1::2]):
        try:
            weight = float(raw_weight)
        except (TypeError, ValueError) as err:
            raise UserError(
                f"data blend weight {raw_weight!r} (before {prefix!r}) is not a number"
            ) from err
        if not math.isfinite(weight) or weight <= 0:
            raise UserError(
                f"data blend weight {raw_weight!r} for {prefix!r} must be a positive number"
            )
        prefixes.append(str(prefix).strip())
        weights.append(weight)
    return prefixes, weights


def normalize_weights(weights: Sequence[float]) -> list[float]:
    w = np.array(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def blend_sizes(
    weights: Sequence[float], size: int, surplus: float = 0.005
) -> tuple[list[int], int]:
    """Samples to build per dataset (with Megatron's 0.5% surplus) and the blended size, as
    Megatron."""
    normalized = normalize_weights(weights)
    targets = [math.ceil(size * w) for w in normalized]
    return [math.ceil(t * (1 + surplus)) for t in targets], sum(targets)


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each global sample: which dataset it comes from and that dataset's sample number.

    Greedy error diffusion: sample s goes to the dataset furthest behind its share, i.e. with the
    largest weight * max(s, 1) - samples_taken (the first such on ties). Same float64 arithmetic
    as Megatron, so the choice is identical.
    """
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    order = range(len(w))
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    for s in range(size):
        s_f = float(max(s, 1))
        best = max(order, key=lambda i: w[i] * s_f - counts[i])
        dataset_index[s] = best
        dataset_sample_index[s] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """`size` samples mixed from `datasets` in proportion to `weights` (Megatron's
    BlendedDataset)."""

    def __init__(
        self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], size: int
    ):
        if len(datasets) != len(weights) or not datasets:
            raise UserError(f"blend has {len(datasets)} datasets but {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise UserError(f"blend weights {list(weights)} must all be positive")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, size)
        taken = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for i, (n, ds) in enumerate(zip(taken, self.datasets)):
            if n > len(ds):
                raise UserError(
                    f"the blend draws {n} samples from dataset {i}, which has only {len(ds)}: "
                    "build the datasets with more samples (see blend_sizes)"
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict:
        d = int(self.dataset_index[idx])
        return {"dataset_id": d, **self.datasets[d][int(self.dataset_sample_index[idx])]}


class PretrainingSampler:
    """Micro-batches of global sample ids for one data-parallel rank, resumable at
    `consumed_samples`.

    Megatron's `MegatronPretrainingSampler`: consecutive runs of micro_batch_size * dp_size ids form
    one step across ranks, rank r taking slice [r * mbs, (r + 1) * mbs). Starting at
    consumed_samples (a multiple of that run) continues the uninterrupted stream exactly.
    Use as `DataLoader(dataset, batch_sampler=PretrainingSampler(...))`.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        drop_last: bool = True,
    ):
        if not 0 <= data_parallel_rank < data_parallel_size or micro_batch_size < 1:
            raise UserError(
                f"bad sampler layout: rank {data_parallel_rank} of {data_parallel_size}, "
                f"micro batch {micro_batch_size}"
            )
        if not 0 <= consumed_samples <= total_samples:
            raise UserError(
                f"consumed_samples {consumed_samples} is outside the dataset's {total_samples} samples"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.step_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        steps, rest = divmod(self.total_samples - self.consumed_samples, self.step_size)
        return steps + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        start = self.data_parallel_rank * self.micro_batch_size
        for begin in range(self.consumed_samples, self.total_samples, self.step_size):
            step = range(begin, min(begin + self.step_size, self.total_samples))
            if len(step) < self.step_size and self.drop_last:
                return
            yield list(step[start : start + self.micro_batch_size])
