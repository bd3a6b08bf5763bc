"""What `preprocess` reads: input files found and cut into N deterministic slices
(lmforge.data.reader reads them).

Kinds of input, each streamed (a bounded amount in memory whatever the file size):

* JSON lines: `.jsonl`, `.json`, `.ndjson`, plain or compressed (`.gz`, `.zst`). One document per
  line.
* plain text: `.txt` (also `.gz`, `.zst`). A whole file is one document, read at once.
* Parquet: `.parquet`, read a record batch at a time with pyarrow (never a whole file); each row is
  one document and `--json-keys` names the columns (string, or list of strings for sentences).
* a Hugging Face `datasets` folder written by `save_to_disk` (`state.json` beside `data-*.arrow`):
  its Arrow files in `state.json`'s order, read a record batch at a time, without `datasets` and
  without a download.
* a folder: every file of those kinds below it (and `datasets` folders as units), in sorted path
  order, hidden names skipped; a glob pattern (`'data/*.parquet'`, quoted so the shell leaves it)
  the same.

Slices (`--shard I/N`): the inputs, in order, lie end to end on one axis of bytes; it is cut at N
equal points, and each unit of work belongs to the slice in which it starts. A unit is a line of an
uncompressed JSON-lines file (so one file can be spread over several slices, cut at line starts), a
Parquet row group, or a whole file for everything else (compressed files cannot be entered in the
middle; `datasets` writes its Arrow files at most 500 MB each). Slices are contiguous in input
order, so their outputs, concatenated, are the whole input's; a slice may hold nothing (fewer units
than slices), which makes an empty shard. The cut depends only on the file list, sizes and Parquet
metadata: every shard job computes the same one.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from glob import glob, has_magic
from itertools import accumulate
from pathlib import Path

from lmforge.errors import UserError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt",)
PARQUET_SUFFIXES = (".parquet",)
COMPRESSIONS = {".gz": "gz", ".zst": "zst"}
KINDS_HINT = (
    "give .jsonl/.json/.ndjson or .txt files (optionally .gz or .zst), .parquet files, Hugging Face "
    "datasets folders (save_to_disk), or folders or glob patterns of them"
)
DATA_EXTRA = "pip install 'lmforge[data]'"
READ_BLOCK = 1 << 20  # bytes read from a compressed file at a time

# Where a document is: (file, base, index). For JSON lines, the byte offset at which a slice's
# reading started in the file and the 1-based line within the slice; for rows, the row's index in
# the file (see describe).
Where = tuple[str, int, int]


@dataclass(frozen=True)
class Source:
    """One input file."""

    path: Path
    kind: str  # "json", "text", "parquet" or "arrow"
    compression: str  # "", "gz" or "zst"
    size: int  # bytes on disk


@dataclass(frozen=True)
class Piece:
    """The part of one source that a slice reads."""

    source: Source
    start: int  # JSON lines: lines starting at byte >= start; Parquet: the first row group; else 0
    # JSON lines: ... and before this byte; Parquet: past the last row group; None: to the end
    stop: int | None
    first_row: int  # Parquet: the file's row index of the piece's first row
    whole: bool  # the piece is the whole file


def _suffix_kind(path: Path) -> tuple[str, str] | None:
    name = path.name.lower()
    compression = next((c for s, c in COMPRESSIONS.items() if name.endswith(s)), "")
    if compression:
        name = name[: name.rindex(".")]
    if name.endswith(JSONL_SUFFIXES):
        return "json", compression
    if name.endswith(TEXT_SUFFIXES):
        return "text", compression
    if name.endswith(PARQUET_SUFFIXES) and not compression:
        return "parquet", ""
    return None


def _source(path: Path, kind: str, compression: str = "") -> Source:
    size = path.stat().st_size
    if size == 0:
        raise UserError(f"input {path} is empty: remove it from the input")
    return Source(path, kind, compression, size)


def _dataset_files(folder: Path) -> list[Source]:
    """The Arrow files of a `save_to_disk` folder, in its state.json's order."""
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        names = [f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"cannot read {folder / 'state.json'} as a datasets state ({e}): save the dataset "
            "again with save_to_disk"
        ) from e
    if state.get("_indices_data_files"):
        raise UserError(
            f"{folder} holds an indices mapping (an old datasets release): load it and save_to_disk "
            "again, which writes the rows themselves"
        )
    if not names:
        raise UserError(
            f"input {folder} is a datasets folder with no data files: save the dataset again"
        )
    if missing := next((n for n in names if not (folder / n).is_file()), None):
        raise UserError(
            f"datasets folder {folder} lists {missing}, which is not there: copy the whole folder, or "
            "save the dataset again"
        )
    return [_source(folder / name, "arrow") for name in names]


def _check_not_dataset_dict(folder: Path) -> None:
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))[
                "splits"
            ]
        except (OSError, ValueError, KeyError, TypeError):
            splits = ["?"]
        raise UserError(
            f"input {folder} is a DatasetDict with splits {', '.join(map(str, splits))}: give one "
            f"split's folder, e.g. {folder / str(splits[0])}"
        )


def _walk(folder: Path) -> list[Source]:
    _check_not_dataset_dict(folder)
    if (folder / "state.json").is_file():
        return _dataset_files(folder)
    found = []
    # children sorted, depth first: the order of sorted full paths
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            found += _walk(entry)
        elif entry.is_file() and (kind := _suffix_kind(entry)):
            found.append(_source(entry, *kind))
    return found


def find_inputs(inputs: str | Path | Iterable[str | Path]) -> list[Source]:
    """Expand files, folders and glob patterns into sources, in the order documents are written."""
    inputs = [Path(p) for p in ([inputs] if isinstance(inputs, str | Path) else inputs)]
    if not inputs:
        raise UserError(f"no input given: {KINDS_HINT}")
    found: list[Source] = []
    for given in inputs:
        paths, pattern = [given], not given.exists() and has_magic(str(given))
        if pattern:
            paths = [Path(p) for p in sorted(glob(str(given), recursive=True))]
            if not paths:
                raise UserError(f"input pattern {given} matches no file: check the pattern")
        for path in paths:
            if not path.exists():
                raise UserError(f"input {path} does not exist: check the path")
            if path.is_dir():
                files = _walk(path)
                if not files:
                    raise UserError(f"input folder {path} holds no data files: {KINDS_HINT}")
                found += files
            elif kind := _suffix_kind(path):
                found.append(_source(path, *kind))
            # a pattern's matches of other kinds (a README beside the data) are passed
            # over
            elif not pattern:
                raise UserError(f"input {path} is of an unknown kind: {KINDS_HINT}")
    if not found:
        raise UserError(f"inputs {' '.join(map(str, inputs))} hold no data files: {KINDS_HINT}")
    return found


def inputs_digest(sources: Sequence[Source]) -> str:
    """A digest of the input list (paths, kinds, sizes): shards cut from other inputs do not
    merge."""
    h = hashlib.sha256()
    for s in sources:
        h.update(f"{s.path.resolve()}\0{s.kind}\0{s.compression}\0{s.size}\n".encode())
    return h.hexdigest()


def need(module: str, what: str):
    """Import an optional dependency, or fail with the one command that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(
            f"{what} needs {module.split('.')[0]}, which is not installed: {DATA_EXTRA}"
        ) from None


def text_columns(path: Path, schema, keys: Sequence[str]) -> None:
    pa = need("pyarrow", "reading Parquet and Arrow files")
    names = schema.names
    for key in keys:
        if key not in names:
            raise UserError(
                f"input {path} has no column {key!r} (columns: {', '.join(map(repr, names))}): "
                "check --json-keys"
            )
        t = schema.field(key).type
        textual = (
            pa.types.is_string,
            pa.types.is_large_string,
            getattr(pa.types, "is_string_view", lambda _: False),
        )
        is_text = any(f(t) for f in textual)
        if not is_text and (pa.types.is_list(t) or pa.types.is_large_list(t)):
            is_text = any(f(t.value_type) for f in textual)
        if not is_text:
            raise UserError(
                f"column {key!r} of {path} holds {t}, not text (a string, or a list of strings): "
                "check --json-keys"
            )


def parquet_file(path: Path, keys: Sequence[str]):
    pq = need("pyarrow.parquet", "reading Parquet files")
    pa = need("pyarrow", "reading Parquet files")
    try:
        # A small streamed buffer, not pyarrow's default of fetching a row group's column chunks
        # whole: memory follows the batch, not the row group (some writers make it 1 GB).
        pf = pq.ParquetFile(path, buffer_size=READ_BLOCK, pre_buffer=False)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"cannot read {path} as Parquet ({e}): check the file is intact") from e
    text_columns(path, pf.schema_arrow, keys)
    return pf


def _units(source: Source, keys: Sequence[str]) -> list[tuple[int, int]]:
    """(weight in bytes, first row) of each unit of a source that cannot be split further."""
    if source.kind != "parquet":
        return [(source.size, 0)]
    meta = parquet_file(source.path, keys).metadata
    if meta.num_rows == 0:
        raise UserError(f"input {source.path} has no rows: remove it from the input")
    units, row = [], 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        units.append(
            (sum(group.column(c).total_compressed_size for c in range(group.num_columns)), row)
        )
        row += group.num_rows
    return units


def plan(
    sources: Sequence[Source], keys: Sequence[str], shard: int = 0, num_shards: int = 1
) -> list[Piece]:
    """The pieces of `sources` in slice `shard` of `num_shards` (see the module docstring)."""
    # every source is checked, whichever slice reads it
    layout = [(s, _units(s, keys)) for s in sources]
    total = sum(w for _, units in layout for w, _ in units)
    cuts = [total * i // num_shards for i in range(num_shards + 1)]
    lo, hi = cuts[shard], cuts[shard + 1]

    def slice_of(offset: int) -> int:
        return min(bisect.bisect_right(cuts, offset) - 1, num_shards - 1)

    pieces, offset = [], 0
    for source, units in layout:
        # cut at line starts: lines starting in [a, b)
        if source.kind == "json" and not source.compression:
            a, b = max(lo - offset, 0), min(hi - offset, source.size)
            if a < b:
                pieces.append(Piece(source, a, b, 0, whole=(a, b) == (0, source.size)))
        elif source.kind == "parquet":
            starts = list(accumulate((w for w, _ in units), initial=offset))
            groups = [g for g in range(len(units)) if slice_of(starts[g]) == shard]
            if groups:
                first, last = groups[0], groups[-1] + 1
                pieces.append(
                    Piece(
                        source, first, last, units[first][1], whole=(first, last) == (0, len(units))
                    )
                )
        elif slice_of(offset) == shard:
            pieces.append(Piece(source, 0, None, 0, whole=True))
        offset += sum(w for w, _ in units)
    return pieces


def describe(where: Where, kind: str, lines: dict | None = None) -> str:
    """`file:line` (JSON lines), `file row N` (Parquet, Arrow) or `file` (plain text), for messages.

    A slice that starts inside a file knows only its own line numbers; the file's are counted from
    the start on demand (errors only), once per slice when `lines` (a cache) is given.
    """
    path, base, index = where
    if kind == "row":
        return f"{path} row {index}"
    if kind == "text":
        return path
    if base:
        cache = {} if lines is None else lines
        if (path, base) not in cache:
            with open(path, "rb") as f:
                count, left = 0, base
                while left > 0 and (block := f.read(min(left, READ_BLOCK))):
                    count += block.count(b"\n")
                    left -= len(block)
            cache[(path, base)] = count
        index += cache[(path, base)]
    return f"{path}:{index}"
