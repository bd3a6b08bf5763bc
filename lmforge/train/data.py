"""Training and validation data for a run: Megatron GPT samples from .bin/.idx prefixes."""

from __future__ import annotations

import json
import logging
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
from lmforge.fsutil import atomic_write
from lmforge.train.config import RunConfig

log = logging.getLogger(__name__)

CHUNK_TOKENS = 1 << 26  # tokens per numpy reduction when scanning a .bin (128 MiB of uint16)


def token_id_range(indexed: IndexedDataset, cache_dir: str | Path | None = None) -> tuple[int, int]:
    """(smallest, largest) token id in a prefix's .bin, (0, -1) when it has none. The scan reads
    the file once, in chunks over a memory map; the answer is cached in `cache_dir` (default:
    `cache/` beside the data, where the sample indices go) under the .bin's size and modification
    time."""
    path = bin_path(indexed.prefix)
    stat = path.stat()
    cache = Path(cache_dir) if cache_dir is not None else path.parent / "cache"
    cache_file = cache / f"{path.stem}-token-range.json"
    stamp = {"bin_bytes": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns}
    try:
        known = json.loads(cache_file.read_text())
        if {k: known.get(k) for k in stamp} == stamp:
            return int(known["min"]), int(known["max"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    low, high = 0, -1
    if stat.st_size:
        tokens = np.memmap(path, dtype=indexed.dtype, mode="r")
        lows, highs = [], []
        for start in range(0, len(tokens), CHUNK_TOKENS):
            chunk = tokens[start : start + CHUNK_TOKENS]
            lows.append(int(chunk.min()))
            highs.append(int(chunk.max()))
        low, high = min(lows), max(highs)
        del tokens
    try:
        cache.mkdir(parents=True, exist_ok=True)
        atomic_write(cache_file, json.dumps({**stamp, "min": low, "max": high}))
    except OSError as e:  # a read-only data folder: scan again next time
        log.debug("token range of %s not cached: %s", path, e)
    return low, high


def check_token_ids(
    indexed: list[IndexedDataset],
    vocab_size: int,
    cache_dir: str | Path | None = None,
    fixed_vocab: bool = False,
) -> None:
    """Every token id of every prefix is a row of the model's embedding: one UserError naming the
    prefix, the id and the vocabulary otherwise (an id past it fails deep in the first step's
    embedding lookup)."""
    for ds in indexed:
        info = np.iinfo(ds.dtype) if ds.dtype.kind in "iu" else None
        if info is not None and info.min >= 0 and info.max < vocab_size:
            # the file's dtype cannot hold an id past the vocabulary (uint16 data,
            # 65,536+ ids)
            continue
        low, high = token_id_range(ds, cache_dir)
        if high >= vocab_size:
            other = (
                ""
                if fixed_vocab
                else f", or use a model whose vocabulary holds it (model.vocab_size > {high})"
            )
            raise UserError(
                f"data prefix '{ds.prefix}' has token id {high} but the model's vocab_size is "
                f"{vocab_size}: preprocess the data with the model's tokenizer{other}"
            )
        if low < 0:
            raise UserError(
                f"data prefix '{ds.prefix}' has a negative token id ({low}): the file is corrupt or "
                "was not written by a tokenizer; preprocess the data again"
            )


def check_document_ends(indexed: list[IndexedDataset], tokenizer) -> None:
    """A warning for each prefix that looks made by another tokenizer
    (lmforge.data.summary.foreign_end_marker)."""
    from lmforge.data.summary import foreign_end_marker

    for ds in indexed if tokenizer is not None else []:
        if (line := foreign_end_marker(ds, tokenizer)) is not None:
            log.warning("%s", line)


def check_tokenizer_holds(
    indexed: list[IndexedDataset], tokenizer, cache_dir: str | Path | None = None
) -> None:
    """A UserError where a prefix holds an id past the run's tokenizer: the data was made by
    another one (NeoX data, ids up to 50,276, read with Llama's 32,000-id tokenizer), certainly,
    not just likely (check_document_ends)."""
    if tokenizer is None:
        return
    for ds in indexed:
        info = np.iinfo(ds.dtype) if ds.dtype.kind in "iu" else None
        if info is not None and info.max < tokenizer.vocab_size:
            continue
        high = token_id_range(ds, cache_dir)[1]
        if high >= tokenizer.vocab_size:
            raise UserError(
                f"data prefix '{ds.prefix}' has token id {high} but the tokenizer {tokenizer.files[0]} has "
                f"{tokenizer.vocab_size} ids: the data was made with another tokenizer: preprocess it with "
                "this one, or set data.tokenizer to the one that made it"
            )


def check_data_tokenizer(indexed: list[IndexedDataset], tokenizer) -> None:
    """Each prefix's tokenizer record (PREFIX.tokenizer.json, lmforge.data.fingerprint) against
    the run's tokenizer: a UserError naming both where another made the data. A prefix without a
    record (older data, Megatron's own) whose documents end in the run's end-of-document id
    passes; a foreign end marker is check_document_ends' warning; the others, which nothing here
    can tell, are named in one warning."""
    if tokenizer is None:
        return
    from lmforge.data.fingerprint import describe, read_fingerprint, tokenizer_fingerprint, verdict
    from lmforge.data.summary import end_marker

    run, unknown = None, []
    for ds in {ds.prefix: ds for ds in indexed}.values():
        record = read_fingerprint(ds.prefix)
        if record is None:
            if tokenizer.eod_id is None or end_marker(ds) is None:
                unknown.append(ds.prefix)
            continue
        run = run or tokenizer_fingerprint(tokenizer)
        found = verdict(record, run)
        if found == "other":
            raise UserError(
                f"data prefix '{ds.prefix}' was tokenized with {describe(record)}, but this run's "
                f"tokenizer is {describe(run)}: preprocess the data again with the run's tokenizer "
                f"(lmforge preprocess --tokenizer {run['tokenizer']}), or set "
                f"data.tokenizer={record.get('tokenizer')}"
            )
        if found == "unknown":
            unknown.append(ds.prefix)
    if unknown:
        named = ", ".join(f"'{p}'" for p in unknown[:3]) + (
            f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        )
        log.warning(
            "nothing shows that data prefix %s %s made with this run's tokenizer %s: no PREFIX.tokenizer.json "
            "beside %s (lmforge preprocess writes it) and no end-of-document id at the documents' ends; only "
            "their ids' range is checked (preprocess with the run's tokenizer to have it checked)",
            named,
            "was" if len(unknown) == 1 else "were",
            tokenizer.files[0],
            "it" if len(unknown) == 1 else "them",
        )


def _prefix_near(prefix: str) -> str | None:
    """What a user most likely meant by a prefix that is not one: the file's name without
    .bin/.idx, or the single `PREFIX_<key>_document` that preprocess wrote for an
    --output-prefix."""
    path = Path(prefix)
    if path.suffix in (".bin", ".idx") and Path(idx_path(path.with_suffix(""))).is_file():
        return str(path.with_suffix(""))
    found = (
        sorted(p.with_suffix("") for p in path.parent.glob(f"{path.name}_*_document.idx"))
        if path.parent.is_dir()
        else []
    )
    return str(found[0]) if len(found) == 1 else None


def open_prefixes(paths: list, key: str = "data.paths") -> tuple[list[IndexedDataset], list[float]]:
    if not paths:
        raise UserError(
            f"{key} is empty: give the .bin/.idx prefix(es) made by `lmforge preprocess`"
        )
    prefixes, weights = parse_blend(paths)
    for prefix in prefixes:
        for path in (idx_path(prefix), bin_path(prefix)):
            if not Path(path).is_file():
                raise UserError(
                    f"data prefix '{prefix}' has no {Path(path).name}: "
                    + (
                        f"give '{near}'"
                        if (near := _prefix_near(prefix))
                        else f"run `lmforge preprocess` or fix {key}"
                    )
                )
    return [IndexedDataset(p) for p in prefixes], weights


def _split_dataset(
    indexed: list[IndexedDataset],
    weights: list[float],
    split: int | None,
    num_samples: int,
    cfg: RunConfig,
) -> torch.utils.data.Dataset:
    """One split (0 train, 1 valid; None: every sequence of each prefix) drawing `num_samples`
    samples, blended when several prefixes."""
    sizes, total = (
        blend_sizes(weights, num_samples) if len(indexed) > 1 else ([num_samples], num_samples)
    )
    parts = []
    for ds, size in zip(indexed, sizes):
        # Over sequences, as megatron-core's GPT datasets
        start, end = (
            parse_split(cfg.data.split, len(ds))[split] if split is not None else (0, len(ds))
        )
        parts.append(
            GPTDataset(
                ds,
                np.arange(start, end),
                size,
                cfg.data.seq_length,
                cfg.trainer.seed,
                cfg.data.cache_dir,
            )
        )
    return parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, total)


def pretrain_datasets(
    cfg: RunConfig, tokenizer=None
) -> tuple[torch.utils.data.Dataset, torch.utils.data.Dataset | None]:
    """(train, valid): data.paths cut by data.split, or, with data.valid_paths, data.paths whole
    to train on and data.valid_paths whole to validate on (Megatron's --train-data-path and
    --valid-data-path)."""
    t, d = cfg.trainer, cfg.data
    indexed, weights = open_prefixes(d.paths)
    held, held_weights = (
        open_prefixes(d.valid_paths, "data.valid_paths") if d.valid_paths else ([], [])
    )
    check_token_ids(
        indexed + held,
        cfg.model.resolve().vocab_size,
        d.cache_dir,
        fixed_vocab=bool(cfg.model.init_from),
    )
    check_document_ends(indexed + held, tokenizer)
    check_tokenizer_holds(indexed + held, tokenizer, d.cache_dir)
    check_data_tokenizer(indexed + held, tokenizer)
    held_out = bool(d.valid_paths)
    train = _split_dataset(
        indexed, weights, None if held_out else 0, t.max_steps * t.global_batch_size, cfg
    )
    valid = None
    if t.val_check_interval and t.val_batches:
        if held_out:
            return train, _split_dataset(
                held, held_weights, None, t.val_batches * t.global_batch_size, cfg
            )
        try:
            valid = _split_dataset(indexed, weights, 1, t.val_batches * t.global_batch_size, cfg)
        except UserError:
            raise UserError(
                f"validation is on but split '{d.split}' leaves no validation sequences: "
                "give the split a valid part, data.valid_paths, or set trainer.val_check_interval=0"
            ) from None
    return train, valid


def loader_workers(num_workers: int | None, device: torch.device) -> int:
    """data.num_workers, or its default for `device`: 2 on an accelerator, 0 on the CPU (whose
    cores the step uses)."""
    if num_workers is not None:
        return num_workers
    return 0 if device.type == "cpu" else 2


def micro_batches(
    dataset,
    consumed: int,
    total: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int,
    collate=None,
    pin_memory: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches from sample `consumed` on. `pin_memory` (CUDA):
    the loader puts each batch in page-locked memory, from which the copy to the device does not
    block the host."""
    sampler = PretrainingSampler(total, consumed, micro_batch_size, dp_rank, dp_size)
    # A private generator: creating a loader iterator draws a worker seed, and drawing it from the
    # global RNG would shift dropout noise between a resumed run and an uninterrupted one.
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(0),
        pin_memory=pin_memory,
    )
    return iter(loader)
