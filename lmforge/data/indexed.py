"""Megatron-LM / NeMo tokenized data: the `MMIDIDX` `.bin` + `.idx` pair, read and written byte for
byte.

`PREFIX.bin` holds every token of every sequence back to back, in one integer dtype. `PREFIX.idx` is
little-endian:

    b"MMIDIDX\\x00\\x00"             9 bytes, magic
    version                       uint64, always 1
    dtype code                    uint8 (megatron.core's DType: 1 uint8, 2 int8, 3 int16, 4 int32,
                                         5 int64, 6 float64, 7 float32, 8 uint16)
    sequence count S              uint64
    document count D + 1          uint64 (the length of the document-indices array)
    sequence_lengths              S x int32, tokens per sequence
    sequence_pointers             S x int64, byte offset of each sequence in .bin
    document_indices              (D + 1) x int64: document d is sequences [di[d], di[d + 1])
    (sequence modes               S x int8, only in multimodal files; read past, never written)

A document made by `preprocess` is one sequence; an empty document (no tokens) has no sequence, so
`document_indices` repeats a value, exactly as Megatron's `preprocess_data.py` writes it.
"""

from __future__ import annotations

import logging
import os
import struct
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from lmforge.errors import UserError
from lmforge.fsutil import LEFTOVER, remove_leftovers

logger = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# magic, version, dtype code, sequence count, document-index count
HEADER = struct.Struct("<9sQBQQ")
# megatron.core.datasets.indexed_dataset.DType, by code.
DTYPES = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODES = {dtype: code for code, dtype in DTYPES.items()}


def optimal_dtype(vocab_size: int | None) -> np.dtype:
    """Megatron's `DType.optimal_dtype`: uint16 below 65,500 ids (not 65,536), int32 otherwise."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def remove_stale_temporaries(prefix: str | Path, also: Iterable[Path] = ()) -> list[Path]:
    """Remove the temporaries of `prefix`'s .bin/.idx (and of the files `also` names) that a
    killed writer left: `.NAME.tmp-PID`, the names IndexedDatasetWriter, the shard merge and
    fsutil.atomic_write use, where process PID is no longer running. A live process's are kept:
    another run of the same prefix may be writing them. Each removal is logged; returns what was
    removed."""
    removed = []
    for path in (bin_path(prefix), idx_path(prefix), *also):
        for left in remove_leftovers(path.parent, path.name):
            logger.info(
                "removed %s, which process %s (no longer running) left writing %s",
                left,
                LEFTOVER.match(left.name)["pid"],
                path,
            )
            removed.append(left)
    return removed


class IndexedDataset:
    """Memory-mapped reader: `ds[i]` is sequence i's tokens (a read-only view), found in O(1)."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        self._open()

    def _open(self) -> None:
        idx, bin_ = idx_path(self.prefix), bin_path(self.prefix)
        for path in (idx, bin_):
            if not path.is_file():
                if bin_.is_file():  # what a writer killed between its two renames leaves
                    raise UserError(
                        f"indexed dataset {self.prefix}: {bin_.name} has no {idx.name} beside it (a write "
                        "of it was cut short): write it again (lmforge preprocess)"
                    )
                raise UserError(
                    f"indexed dataset file {path} not found: give the prefix without .bin/.idx"
                )
        idx_size = idx.stat().st_size
        if idx_size < HEADER.size:
            raise UserError(
                f"{idx} is {idx_size} bytes, shorter than the {HEADER.size}-byte header: re-run preprocess"
            )
        with open(idx, "rb") as f:
            magic, version, code, n_seq, n_doc_idx = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC:
            raise UserError(
                f"{idx} is not a Megatron MMIDIDX index (magic {magic!r}): re-run preprocess"
            )
        if version != VERSION:
            raise UserError(
                f"{idx} has index version {version}, only version {VERSION} is known: re-run preprocess"
            )
        if code not in DTYPES:
            raise UserError(
                f"{idx} has unknown dtype code {code} (known: {sorted(DTYPES)}): re-run preprocess"
            )
        self.dtype = DTYPES[code]
        expected = HEADER.size + n_seq * (4 + 8) + n_doc_idx * 8
        # Multimodal Megatron files append one int8 mode per sequence; we read past them.
        if idx_size not in (expected, expected + n_seq):
            raise UserError(
                f"{idx} is {idx_size} bytes but its header ({n_seq} sequences, {n_doc_idx} document indices) "
                f"needs {expected}: the file is truncated or corrupt, re-run preprocess"
            )
        self._idx = np.memmap(idx, dtype=np.uint8, mode="r")
        off = HEADER.size
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, n_seq, off)
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, n_seq, off + 4 * n_seq)
        self.document_indices = np.frombuffer(self._idx, np.int64, n_doc_idx, off + 12 * n_seq)
        if n_doc_idx < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != n_seq:
            raise UserError(
                f"{idx} has document indices that do not span its {n_seq} sequences: the file is corrupt, "
                "re-run preprocess"
            )
        bin_size = bin_.stat().st_size
        need = (
            int(self.sequence_pointers[-1] + self.sequence_lengths[-1] * self.dtype.itemsize)
            if n_seq
            else 0
        )
        if bin_size != need:
            raise UserError(
                f"{bin_} is {bin_size} bytes but {idx} indexes {need} bytes of {self.dtype.name} tokens: "
                "the pair does not match (truncated, or from different runs), re-run preprocess"
            )
        # numpy cannot map an empty file; an empty dataset needs no data anyway.
        self._bin = np.memmap(bin_, dtype=np.uint8, mode="r") if bin_size else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        """The number of sequences (Megatron's `len(IndexedDataset)`)."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset + length` of sequence `i` (to its end when `length` is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.prefix}")
        i = int(i) % n
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {i} of length {size}"
            )
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    def document(self, d: int) -> np.ndarray:
        """All tokens of document `d` (its sequences joined)."""
        first, last = self.document_indices[d], self.document_indices[d + 1]
        if first == last:
            return np.zeros(0, self.dtype)
        start = int(self.sequence_pointers[first])
        count = int(self.sequence_lengths[first:last].sum())
        return np.frombuffer(self._bin, self.dtype, count, start)

    # DataLoader workers get a pickled copy: send the prefix and map the files again there.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, dtype={self.dtype.name}, sequences={len(self)}, "
            f"documents={self.num_documents})"
        )


class IndexedDatasetWriter:
    """Write `PREFIX.bin/.idx` byte-identical to megatron.core's `IndexedDatasetBuilder` for the
    same calls.

    Both files are written under temporary names (`.NAME.bin.tmp-PID`: one writer of a prefix per
    process) and renamed only by `finalize`; `abort` (or leaving a `with` block by an exception)
    deletes them, so a final-named pair is always complete; those a killed process left go with
    `remove_stale_temporaries`. `finalize` removes an older `.idx` of the prefix, then renames
    `.bin`, then `.idx`: a crash between leaves a `.bin` without its index, which the reader refuses
    in one line, never a new `.bin` beside an old `.idx` (whose sizes could agree by chance).
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype | type = np.int32):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise UserError(
                f"dtype {self.dtype} cannot be stored in a Megatron index: use uint16 or int32"
            )
        self._limits = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
        final_bin = bin_path(self.prefix)
        final_bin.parent.mkdir(parents=True, exist_ok=True)
        # Hidden names in fsutil's leftover form: a *.bin glob never sees a file being written, a
        # later run knows whose it is, and a reused PID (a container's) reuses a dead run's name.
        tag = f".tmp-{os.getpid()}"
        self._tmp_bin = final_bin.with_name(f".{final_bin.name}{tag}")
        self._tmp_idx = final_bin.with_name(f".{idx_path(self.prefix).name}{tag}")
        self._bin = open(self._tmp_bin, "wb", buffering=1 << 20)
        # Compact C arrays, not lists of Python ints: 4 or 8 bytes per entry on corpora of 1e8
        # documents.
        self._lengths = array("i")
        self._document_indices = array("q", [0])
        self.num_tokens = 0
        self._done = False

    @property
    def num_documents(self) -> int:
        return len(self._document_indices) - 1

    def add_document(
        self, ids: Sequence[int] | np.ndarray, lengths: Sequence[int] | None = None
    ) -> None:
        """Append one document; `lengths` splits it into sequences (default: one sequence, none if
        empty).

        Megatron's builder takes `lengths` as given: `add_document([], [0])` makes one empty
        sequence, `add_document([], [])` an empty document with no sequence (what
        `preprocess_data.py` writes).
        """
        if self._done:
            raise RuntimeError(f"writer for {self.prefix} is already finalized or aborted")
        arr = np.asarray(ids)
        if arr.size and self._limits is not None:
            if arr.dtype.kind not in "iub":
                raise UserError(f"token ids for {self.prefix} must be integers, got {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._limits.min or hi > self._limits.max:
                raise UserError(
                    f"token id {hi if hi > self._limits.max else lo} does not fit {self.dtype.name} in {self.prefix}: "
                    "the tokenizer's vocab_size is too small for its ids, check the tokenizer"
                )
        arr = arr.astype(self.dtype, copy=False).reshape(-1)
        if lengths is None:
            lengths = [arr.size] if arr.size else []
        if sum(lengths) != arr.size:
            raise ValueError(
                f"sequence lengths {list(lengths)} do not add up to the {arr.size} ids given"
            )
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.extend(lengths)
        self._document_indices.append(len(self._lengths))
        self.num_tokens += arr.size

    def finalize(self) -> None:
        """Write the index, then move both files to their final names."""
        if self._done:
            raise RuntimeError(f"writer for {self.prefix} is already finalized or aborted")
        try:
            self._bin.close()
            lengths = (
                np.frombuffer(self._lengths, np.int32) if self._lengths else np.zeros(0, np.int32)
            )
            pointers = np.zeros(len(lengths), np.int64)
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
            with open(self._tmp_idx, "wb") as f:
                f.write(
                    HEADER.pack(
                        MAGIC, VERSION, CODES[self.dtype], len(lengths), len(self._document_indices)
                    )
                )
                f.write(lengths.tobytes())
                f.write(pointers.tobytes())
                f.write(np.frombuffer(self._document_indices, np.int64).tobytes())
            if not self._tmp_bin.exists():  # before the old index goes
                raise UserError(
                    f"{self._tmp_bin} was removed while it was written (by a run of the same prefix on "
                    "another host, to which this process looked dead?): run one preprocess per output "
                    "prefix at a time"
                )
            # never an old index beside the new tokens
            idx_path(self.prefix).unlink(missing_ok=True)
            os.replace(self._tmp_bin, bin_path(self.prefix))
            os.replace(self._tmp_idx, idx_path(self.prefix))
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        """Drop everything written; the final names are left as they were."""
        self._done = True
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            path.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()
