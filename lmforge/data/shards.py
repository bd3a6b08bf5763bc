"""Sharded preprocessing: shard names, what each shard records about how it was made, and the merge.

`lmforge preprocess --shard I/N` writes `PREFIX_<key>_document.shard-I-of-N.bin/.idx` (I from 0),
and beside them `...shard-I-of-N.json`: the tokenizer (sha256 of its files), dtype, `--append-eod`,
`--parse-special-tokens`, a digest of the input list, and token counts of the files it read only
part of.

`merge` concatenates shards 0..N-1 into `PREFIX_<key>_document.bin/.idx`: the `.bin` files back to
back, the `.idx` arrays one after another with sequence pointers shifted by the bytes before them
and document indices by the sequences before them (what Megatron's `tools/merge_datasets.py` does).
Slices are contiguous in input order, so the result is byte for byte what preprocessing the whole
input at once writes. Shards that were made differently (another tokenizer, dtype, option or input
list) are refused with one line, before anything is written; the merged pair gets the
`PREFIX.tokenizer.json` a one-shot run writes (lmforge.data.fingerprint). Everything is streamed:
memory stays bounded whatever the corpus size. The shards are left as they are; delete them once the
merged pair is in place.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from glob import escape, glob
from pathlib import Path

import numpy as np

from lmforge.data.fingerprint import fingerprint_path, write_fingerprint
from lmforge.data.indexed import (
    CODES,
    HEADER,
    MAGIC,
    VERSION,
    IndexedDataset,
    bin_path,
    idx_path,
    remove_stale_temporaries,
)
from lmforge.errors import UserError
from lmforge.fsutil import atomic_write

logger = logging.getLogger(__name__)

SHARD_SUFFIX = re.compile(r"\.shard-(\d+)-of-(\d+)$")
FORMAT = "lmforge-shard/1"
COPY_ITEMS = 1 << 22  # index entries copied per step: bounded memory on indexes of any size
# What must agree between the shards of one dataset, in the order differences are reported.
SAME = ("key", "dtype", "tokenizer", "append_eod", "parse_special_tokens", "inputs")


def parse_shard(text: str | tuple[int, int]) -> tuple[int, int]:
    """'3/8' -> (3, 8): the 4th of 8 slices (I counts from 0, as Slurm array task ids do)."""
    if isinstance(text, tuple):
        i, n = text
    else:
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
        if not m:
            raise UserError(f"--shard {text!r} is not I/N: give e.g. 0/8 for the first of 8 shards")
        i, n = int(m.group(1)), int(m.group(2))
    if not 0 <= i < n:
        raise UserError(
            f"--shard {i}/{n}: I counts from 0 and must be below N (0/{max(n, 1)} to "
            f"{max(n, 1) - 1}/{max(n, 1)})"
        )
    return i, n


def shard_prefix(prefix: str | Path, shard: int, num_shards: int) -> str:
    """`prefix.shard-I-of-N`, I padded to N's width (shard-03-of-64): sorted names are in shard
    order, as Megatron's tools/merge_datasets.py, which merges a folder's pairs by sorted name,
    needs them."""
    return f"{prefix}.shard-{shard:0{len(str(num_shards))}d}-of-{num_shards}"


def record_path(prefix: str | Path) -> Path:
    """The `.json` a shard writes beside its `.bin/.idx`."""
    return Path(f"{prefix}.json")


def write_record(prefix: str, record: dict) -> None:
    atomic_write(record_path(prefix), json.dumps({"format": FORMAT, **record}, indent=1) + "\n")


@dataclass
class MergeStats:
    prefix: str  # the merged PREFIX.bin/.idx
    shards: int
    documents: int
    sequences: int
    tokens: int
    seconds: float


def find_datasets(prefix: str | Path) -> list[str]:
    """The dataset prefixes with shards under `prefix`: `prefix` itself (a dataset prefix such as
    data/wiki_text_document), or each `prefix_<key>_document` (the --output-prefix given to
    preprocess)."""
    prefix = str(prefix)
    if glob(escape(prefix) + ".shard-*-of-*.idx"):
        return [prefix]
    found = sorted(
        {
            SHARD_SUFFIX.sub("", p[: -len(".idx")])
            for p in glob(escape(prefix) + "_*_document.shard-*-of-*.idx")
            if SHARD_SUFFIX.search(p[: -len(".idx")])
        }
    )
    if not found:
        raise UserError(
            f"no shards {prefix}.shard-I-of-N.bin/.idx (nor {prefix}_<key>_document.shard-I-of-N) "
            "found: run lmforge preprocess with --shard I/N first"
        )
    return found


def _shards(prefix: str) -> list[str]:
    """Shards 0..N-1 of dataset `prefix`, every one present, all of one N."""
    by_count: dict[int, set[int]] = {}
    for p in glob(escape(prefix) + ".shard-*-of-*.idx"):
        if m := SHARD_SUFFIX.search(p[: -len(".idx")]):
            by_count.setdefault(int(m.group(2)), set()).add(int(m.group(1)))
    if not by_count:
        raise UserError(
            f"no shards {prefix}.shard-I-of-N.bin/.idx found: run lmforge preprocess with --shard first"
        )
    if len(by_count) > 1:
        counts = " and ".join(f"of {n}" for n in sorted(by_count))
        raise UserError(f"{prefix} has shards {counts}: delete the stale set, then merge again")
    ((n, have),) = by_count.items()
    missing = sorted(set(range(n)) - have)
    if missing:
        listed = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise UserError(
            f"{prefix} lacks shard(s) {listed} of {n}: run lmforge preprocess --shard {missing[0]}/{n} "
            "(and the others) first"
        )
    return [shard_prefix(prefix, i, n) for i in range(n)]


def _read_record(shard: str) -> dict:
    path = record_path(shard)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(
            f"{path} is missing: that shard's preprocess did not finish, run it again"
        ) from None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} ({e}): run that shard's preprocess again") from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise UserError(f"{path} is not a {FORMAT} record: run that shard's preprocess again")
    return record


def _describe(field: str, value) -> str:
    if field == "tokenizer":
        return f"tokenizer {', '.join(Path(f).name for f in value['files'])} (sha256 {value['sha256'][:12]})"
    if field == "inputs":
        return f"inputs with digest {value['sha256'][:12]} ({value['files']} files)"
    return f"{field}={value}"


def first_difference(a: dict, b: dict) -> str | None:
    """The first field of SAME in which two shard records differ, if any."""
    return next((f for f in SAME if a.get(f) != b.get(f)), None)


def _check_same(prefix: str, records: Sequence[dict], expect: dict | None) -> None:
    first = records[0]
    for i, record in enumerate(records[1:], start=1):
        if field := first_difference(first, record):
            hint = " (different tokenizers)" if field == "dtype" else ""
            fix = "the same --input" if field == "inputs" else "one tokenizer and the same options"
            raise UserError(
                f"cannot merge {prefix}: shard {i} has {_describe(field, record.get(field))} but shard 0 "
                f"has {_describe(field, first.get(field))}{hint}: make them again with {fix}"
            )
    if expect is not None and (field := first_difference(expect, first)):
        raise UserError(
            f"cannot merge {prefix}: this command has {_describe(field, expect.get(field))} but the "
            f"shards have {_describe(field, first.get(field))}: give --merge the arguments the shards "
            "were made with"
        )


def _check_partial_files(prefix: str, records: Sequence[dict]) -> None:
    """A file cut between shards, whose every part is without text: the one-shot run fails on it,
    so must this."""
    totals: dict[str, int] = {}
    for record in records:
        for path, tokens in record.get("partial_files", {}).items():
            totals[path] = totals.get(path, 0) + tokens
    empty = [path for path, tokens in totals.items() if tokens == 0]
    if empty:
        raise UserError(
            f"cannot merge {prefix}: input {empty[0]} has no text (every document in it is empty): "
            "remove it from the input (or check --json-keys) and make the shards again"
        )


def _copy_shifted(out, arrays: Sequence[np.ndarray], shifts: Sequence[int]) -> None:
    for array, shift in zip(arrays, shifts):
        for start in range(0, len(array), COPY_ITEMS):
            part = array[start : start + COPY_ITEMS]
            out.write((part + np.int64(shift)).tobytes() if shift else part.tobytes())


def _write_merged(prefix: str, shards: Sequence[IndexedDataset]) -> None:
    final_bin, final_idx = bin_path(prefix), idx_path(prefix)
    final_bin.parent.mkdir(parents=True, exist_ok=True)
    tag = f".tmp-{os.getpid()}"
    tmp_bin, tmp_idx = (p.with_name(f".{p.name}{tag}") for p in (final_bin, final_idx))
    try:
        bin_sizes = []
        with open(tmp_bin, "wb") as out:
            for ds in shards:
                with open(bin_path(ds.prefix), "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 23)
                bin_sizes.append(bin_path(ds.prefix).stat().st_size)
        sequences = [len(ds) for ds in shards]
        with open(tmp_idx, "wb") as out:
            out.write(
                HEADER.pack(
                    MAGIC,
                    VERSION,
                    CODES[shards[0].dtype],
                    sum(sequences),
                    sum(ds.num_documents for ds in shards) + 1,
                )
            )
            _copy_shifted(out, [ds.sequence_lengths for ds in shards], [0] * len(shards))
            _copy_shifted(
                out,
                [ds.sequence_pointers for ds in shards],
                np.cumsum([0, *bin_sizes[:-1]]).tolist(),
            )
            # each shard's leading 0 is the previous shard's end
            out.write(np.zeros(1, np.int64).tobytes())
            _copy_shifted(
                out,
                [ds.document_indices[1:] for ds in shards],
                np.cumsum([0, *sequences[:-1]]).tolist(),
            )
        # As IndexedDatasetWriter: an older .idx goes, then .bin, then .idx; a crash between leaves
        # a .bin without its index (refused in one line), never an old index beside new tokens.
        final_idx.unlink(missing_ok=True)
        os.replace(tmp_bin, final_bin)
        os.replace(tmp_idx, final_idx)
    except BaseException:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
        raise


def merge(prefix: str | Path, expect: dict | None = None) -> MergeStats:
    """Merge dataset `prefix`'s shards into `prefix.bin/.idx` (see the module docstring).

    `expect` (the fields of SAME, as a shard of this run would record them) checks the shards
    against the arguments of the preprocess command that asked for the merge.
    """
    prefix, start = str(prefix), time.perf_counter()
    shards = _shards(prefix)
    records = [_read_record(s) for s in shards]
    names = [f"shard {i}" for i in range(len(shards))]
    datasets = [IndexedDataset(s) for s in shards]
    for record, ds, name in zip(records, datasets, names):
        if record.get("dtype") != ds.dtype.name:
            raise UserError(
                f"cannot merge {prefix}: {name}'s record says {record.get('dtype')} but its .idx holds "
                f"{ds.dtype.name}: run that shard again"
            )
    _check_same(prefix, records, expect)
    _check_partial_files(prefix, records)
    # what a killed merge (or preprocess) left
    remove_stale_temporaries(prefix, also=[fingerprint_path(prefix)])
    _write_merged(prefix, datasets)
    made_by = records[0]["tokenizer"]
    write_fingerprint(
        prefix,
        {
            "tokenizer": made_by["files"][0],
            "files": made_by["files"],
            "sha256": made_by["sha256"],
            "vocab_sha256": records[0].get("tokenizer_vocab_sha256"),
            "vocab_size": made_by["vocab_size"],
            "eod_id": made_by["eod_id"],
        },
    )
    stats = MergeStats(
        prefix,
        len(shards),
        sum(ds.num_documents for ds in datasets),
        sum(map(len, datasets)),
        sum(int(ds.sequence_lengths.sum(dtype=np.int64)) for ds in datasets),
        time.perf_counter() - start,
    )
    logger.debug(
        "merged %d shards into %s.bin/.idx: %d documents, %d tokens in %.1f s",
        stats.shards,
        prefix,
        stats.documents,
        stats.tokens,
        stats.seconds,
    )
    return stats
