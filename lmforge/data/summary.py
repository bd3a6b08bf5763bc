"""`lmforge data inspect`: what a `.bin/.idx` pair holds, read from its index without loading the
tokens.

Counts (documents, empty documents, sequences, tokens), the dtype and file sizes, the token length
of documents (min, mean, max and a histogram in power-of-two buckets), and the first documents' ids,
decoded when a tokenizer is given. The index is read in blocks, so memory stays bounded on indexes
of any size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from glob import escape, glob
from pathlib import Path

import numpy as np

from lmforge.data.fingerprint import describe, read_fingerprint, tokenizer_fingerprint, verdict
from lmforge.data.indexed import IndexedDataset, bin_path, idx_path
from lmforge.errors import UserError
from lmforge.tokenizers import Tokenizer, load_tokenizer

BLOCK = 1 << 22  # documents per step over the index


@dataclass
class Bucket:
    low: int  # token counts in [low, high]
    high: int
    documents: int


@dataclass
class DatasetSummary:
    prefix: str
    dtype: str
    documents: int
    empty_documents: int
    sequences: int
    tokens: int
    bin_bytes: int
    idx_bytes: int
    min_tokens: int  # per document
    max_tokens: int
    mean_tokens: float
    # of non-empty documents, power-of-two buckets
    histogram: list[Bucket] = field(default_factory=list)
    first_documents: list[list[int]] = field(default_factory=list)  # their ids
    decoded: list[str] | None = None  # their text, when a tokenizer was given
    tokenizer: str | None = None
    # why the data looks made by another tokenizer (its record, foreign_end_marker)
    mismatch: str | None = None
    # the tokenizer its PREFIX.tokenizer.json names (lmforge.data.fingerprint)
    made_by: str | None = None


def end_marker(ds: IndexedDataset) -> int | None:
    """The token nearly all of a dataset's documents end in and never hold elsewhere (an
    end-of-document marker appended by its tokenizer), or None: no such token, or too few
    documents to tell one from their last words. (A period ends most articles too, but not only
    there.) Up to 256 documents' last 2,048 tokens are read."""
    if ds.num_documents < 8:
        return None
    picks = np.unique(
        np.linspace(0, ds.num_documents - 1, min(ds.num_documents, 256)).astype(np.int64)
    )
    tails = [tail for tail in (ds.document(int(d))[-2048:] for d in picks) if len(tail)]
    if not tails:
        return None
    values, counts = np.unique([int(tail[-1]) for tail in tails], return_counts=True)
    marker = int(values[counts.argmax()])
    inside = sum(bool((tail[:-1] == marker).any()) for tail in tails)
    if counts.max() < 0.9 * len(tails) or inside > 0.02 * len(tails):
        return None
    return marker


def foreign_end_marker(ds: IndexedDataset, tokenizer: Tokenizer) -> str | None:
    """Why a dataset looks made by another tokenizer, or None: its documents end in a marker
    (end_marker) that is not the tokenizer's end of document (GPT-2's 50256 read by a Pythia
    model, whose id 50256 is a rare added token). Its ids are in range, so nothing else notices."""
    if tokenizer.eod_id is None or (marker := end_marker(ds)) is None or marker == tokenizer.eod_id:
        return None
    picks = np.unique(
        np.linspace(0, ds.num_documents - 1, min(ds.num_documents, 256)).astype(np.int64)
    )
    tails = [int(tail[-1]) for tail in (ds.document(int(d))[-2048:] for d in picks) if len(tail)]
    return (
        f"data prefix '{ds.prefix}': {tails.count(marker)} of {len(tails)} documents sampled end in token "
        f"{marker} ({tokenizer.decode([marker])!r} to this tokenizer) and hold it nowhere else, but this "
        f"tokenizer's end of document is {tokenizer.eod_id}: was it preprocessed with another tokenizer? "
        "Preprocess it with the model's (data.tokenizer / the one beside model.init_from)"
    )


def find_prefixes(prefix: str | Path) -> list[str]:
    """`prefix` itself when its .bin/.idx exist, else each `prefix_<key>_document` (the
    --output-prefix given to preprocess)."""
    prefix = str(prefix).removesuffix(".bin").removesuffix(".idx")
    if idx_path(prefix).is_file():
        return [prefix]
    found = sorted(p[: -len(".idx")] for p in glob(escape(prefix) + "_*_document.idx"))
    if not found:
        raise UserError(
            f"no dataset {prefix}.bin/.idx (nor {prefix}_<key>_document.bin/.idx) found: give the "
            "prefix that preprocess wrote, without .bin/.idx"
        )
    return found


def _bucket(n: np.ndarray) -> np.ndarray:
    """0 for an empty document, k + 1 for a length in [2^k, 2^(k+1))."""
    out = np.zeros(n.shape, np.int64)
    nz = n > 0
    out[nz] = np.floor(np.log2(n[nz])).astype(np.int64) + 1
    return out


def summarize(
    prefix: str | Path, tokenizer: str | Path | Tokenizer | None = None, num_docs: int = 3
) -> DatasetSummary:
    ds = IndexedDataset(prefix)
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str | Path) else tokenizer
    docs, lengths, indices = ds.num_documents, ds.sequence_lengths, ds.document_indices
    counts = np.zeros(64, np.int64)
    tokens, low, high, empty = 0, None, 0, 0
    for start in range(0, docs, BLOCK):
        bounds = np.asarray(indices[start : min(start + BLOCK, docs) + 1], np.int64)
        seq = np.asarray(lengths[bounds[0] : bounds[-1]], np.int64)
        ends = np.concatenate([np.zeros(1, np.int64), np.cumsum(seq)])
        per_doc = ends[bounds[1:] - bounds[0]] - ends[bounds[:-1] - bounds[0]]
        counts += np.bincount(_bucket(per_doc), minlength=64)[:64]
        tokens += int(per_doc.sum())
        empty += int((per_doc == 0).sum())
        low = int(per_doc.min()) if low is None else min(low, int(per_doc.min()))
        high = max(high, int(per_doc.max()))
    # Non-empty documents only (empty ones are counted apart), from the first bucket used to the
    # last.
    histogram = [Bucket(1 << (k - 1), (1 << k) - 1, int(c)) for k, c in enumerate(counts) if k]
    used = [i for i, b in enumerate(histogram) if b.documents]
    histogram = histogram[used[0] : used[-1] + 1] if used else []
    first = [ds.document(d).tolist() for d in range(min(num_docs, docs))]
    record = read_fingerprint(ds.prefix)
    mismatch = foreign_end_marker(ds, tok) if tok else None
    if tok and record and verdict(record, tokenizer_fingerprint(tok)) == "other":
        mismatch = (
            f"data prefix '{ds.prefix}' was tokenized with {describe(record)}, not with {tok.files[0]}: "
            f"decode it with --tokenizer {record.get('tokenizer')}"
        )
    return DatasetSummary(
        prefix=ds.prefix,
        dtype=ds.dtype.name,
        documents=docs,
        empty_documents=empty,
        sequences=len(ds),
        tokens=tokens,
        bin_bytes=bin_path(ds.prefix).stat().st_size,
        idx_bytes=idx_path(ds.prefix).stat().st_size,
        min_tokens=low or 0,
        max_tokens=high,
        mean_tokens=tokens / docs if docs else 0.0,
        histogram=histogram,
        first_documents=first,
        decoded=[tok.decode(ids) for ids in first] if tok else None,
        tokenizer=str(tok.files[0]) if tok else None,
        mismatch=mismatch,
        made_by=describe(record) if record else None,
    )


def summarize_all(
    prefix: str | Path, tokenizer: str | Path | None = None, num_docs: int = 3
) -> Sequence[DatasetSummary]:
    """summarize() for each dataset that `prefix` names (see find_prefixes); the tokenizer is
    loaded once."""
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    return [summarize(p, tok, num_docs) for p in find_prefixes(prefix)]
