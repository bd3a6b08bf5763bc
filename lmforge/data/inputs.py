"""What `preprocess` reads: input files found, cut into N deterministic slices, and read as records.

Kinds of input, each streamed (a bounded amount in memory whatever the file size):

* JSON lines: `.jsonl`, `.json`, `.ndjson`, plain or compressed (`.gz`, `.zst`). One document per line.
* plain text: `.txt` (also `.gz`, `.zst`). A whole file is one document, read at once.
* Parquet: `.parquet`, read a record batch at a time with pyarrow (never a whole file); each row is one
  document and `--json-keys` names the columns (string, or list of strings for sentences).
* a Hugging Face `datasets` folder written by `save_to_disk` (`state.json` beside `data-*.arrow`): its Arrow
  files in `state.json`'s order, read a record batch at a time, without `datasets` and without a download.
* a folder: every file of those kinds below it (and `datasets` folders as units), in sorted path order,
  hidden names skipped; a glob pattern (`'data/*.parquet'`, quoted so the shell leaves it) the same.

Documents over a size limit (`max_bytes`: a JSON line's bytes, a plain-text file's, a row's UTF-8 bytes of its
`--json-keys` columns, counted by Arrow before any Python string is made) are never read whole: the reader
yields a `TooLarge` in their place, and reads past them in blocks, so memory stays bounded by the limit even for
a line of many GB without a newline. A JSON line's bytes bound its text's (escapes only shrink), so no text
over the limit reaches a tokenizer.

Slices (`--shard I/N`): the inputs, in order, lie end to end on one axis of bytes; it is cut at N equal
points, and each unit of work belongs to the slice in which it starts. A unit is a line of an uncompressed
JSON-lines file (so one file can be spread over several slices, cut at line starts), a Parquet row group, or
a whole file for everything else (compressed files cannot be entered in the middle; `datasets` writes its
Arrow files at most 500 MB each). Slices are contiguous in input order, so their outputs, concatenated,
are the whole input's; a slice may hold nothing (fewer units than slices), which makes an empty shard.
The cut depends only on the file list, sizes and Parquet metadata: every shard job computes the same one.
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import io
import json
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from glob import glob, has_magic
from itertools import accumulate
from pathlib import Path

import numpy as np

from lmforge.errors import UserError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt",)
PARQUET_SUFFIXES = (".parquet",)
COMPRESSIONS = {".gz": "gz", ".zst": "zst"}
KINDS_HINT = ("give .jsonl/.json/.ndjson or .txt files (optionally .gz or .zst), .parquet files, Hugging Face "
              "datasets folders (save_to_disk), or folders or glob patterns of them")
DATA_EXTRA = "pip install 'lmforge[data]'"
PARQUET_BATCH_ROWS = 256  # rows per record batch read from Parquet: a few MB of long documents, cheap per batch
READ_BLOCK = 1 << 20  # bytes read from a compressed file at a time

# A record: (where, kind, payload, size). `where` is (file, base, index): for JSON lines, the byte offset at
# which this slice's reading started in the file and the 1-based line within the slice; for rows, the row's
# index in the file. `kind` is "json" (payload: a raw line), "text" (the file's bytes) or "row" (a tuple of
# the --json-keys columns' values), or a TooLarge in place of any of them. `size` is about the payload's bytes,
# for chunking.
Where = tuple[str, int, int]
Record = tuple[Where, str, object, int]


@dataclass(frozen=True)
class TooLarge:
    """A record's payload in place of a document over the size limit, which was read past, never held."""

    size: int  # the document's bytes (a JSON line's without its newline)
    limit: int

    def reason(self, kind: str) -> str:
        """What is wrong, for `describe(where): reason` messages."""
        over = f"more than the --max-document-bytes limit of {self.limit:,}"
        if kind == "text":
            return (f"{self.size:,} bytes, {over} (a plain-text file is one document): split it into JSON lines, "
                    "or raise the limit")
        what = "a line" if kind == "json" else "a row of text"
        return f"{what} of {self.size:,} bytes, {over}: raise the limit to tokenize it"


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
    stop: int | None  # JSON lines: ... and before this byte; Parquet: past the last row group; None: to the end
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
        raise UserError(f"cannot read {folder / 'state.json'} as a datasets state ({e}): save the dataset "
                        "again with save_to_disk") from e
    if state.get("_indices_data_files"):
        raise UserError(f"{folder} holds an indices mapping (an old datasets release): load it and save_to_disk "
                        "again, which writes the rows themselves")
    if not names:
        raise UserError(f"input {folder} is a datasets folder with no data files: save the dataset again")
    if missing := next((n for n in names if not (folder / n).is_file()), None):
        raise UserError(f"datasets folder {folder} lists {missing}, which is not there: copy the whole folder, or "
                        "save the dataset again")
    return [_source(folder / name, "arrow") for name in names]


def _check_not_dataset_dict(folder: Path) -> None:
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            splits = ["?"]
        raise UserError(f"input {folder} is a DatasetDict with splits {', '.join(map(str, splits))}: give one "
                        f"split's folder, e.g. {folder / str(splits[0])}")


def _walk(folder: Path) -> list[Source]:
    _check_not_dataset_dict(folder)
    if (folder / "state.json").is_file():
        return _dataset_files(folder)
    found = []
    for entry in sorted(folder.iterdir()):  # children sorted, depth first: the order of sorted full paths
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
            elif not pattern:  # a pattern's matches of other kinds (a README beside the data) are passed over
                raise UserError(f"input {path} is of an unknown kind: {KINDS_HINT}")
    if not found:
        raise UserError(f"inputs {' '.join(map(str, inputs))} hold no data files: {KINDS_HINT}")
    return found


def inputs_digest(sources: Sequence[Source]) -> str:
    """A digest of the input list (paths, kinds, sizes): shards cut from other inputs do not merge."""
    h = hashlib.sha256()
    for s in sources:
        h.update(f"{s.path.resolve()}\0{s.kind}\0{s.compression}\0{s.size}\n".encode())
    return h.hexdigest()


def _need(module: str, what: str):
    """Import an optional dependency, or fail with the one command that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{what} needs {module.split('.')[0]}, which is not installed: {DATA_EXTRA}") from None


def _text_columns(path: Path, schema, keys: Sequence[str]) -> None:
    pa = _need("pyarrow", "reading Parquet and Arrow files")
    names = schema.names
    for key in keys:
        if key not in names:
            raise UserError(f"input {path} has no column {key!r} (columns: {', '.join(map(repr, names))}): "
                            "check --json-keys")
        t = schema.field(key).type
        textual = (pa.types.is_string, pa.types.is_large_string, getattr(pa.types, "is_string_view", lambda _: False))
        is_text = any(f(t) for f in textual)
        if not is_text and (pa.types.is_list(t) or pa.types.is_large_list(t)):
            is_text = any(f(t.value_type) for f in textual)
        if not is_text:
            raise UserError(f"column {key!r} of {path} holds {t}, not text (a string, or a list of strings): "
                            "check --json-keys")


def _parquet_file(path: Path, keys: Sequence[str]):
    pq = _need("pyarrow.parquet", "reading Parquet files")
    pa = _need("pyarrow", "reading Parquet files")
    try:
        # Streamed reads through a small buffer instead of pyarrow's default of fetching each row group's column
        # chunks whole first: memory then follows the batch, not the row group (which some writers make 1 GB).
        pf = pq.ParquetFile(path, buffer_size=READ_BLOCK, pre_buffer=False)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"cannot read {path} as Parquet ({e}): check the file is intact") from e
    _text_columns(path, pf.schema_arrow, keys)
    return pf


def _units(source: Source, keys: Sequence[str]) -> list[tuple[int, int]]:
    """(weight in bytes, first row) of each unit of a source that cannot be split further."""
    if source.kind != "parquet":
        return [(source.size, 0)]
    meta = _parquet_file(source.path, keys).metadata
    if meta.num_rows == 0:
        raise UserError(f"input {source.path} has no rows: remove it from the input")
    units, row = [], 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        units.append((sum(group.column(c).total_compressed_size for c in range(group.num_columns)), row))
        row += group.num_rows
    return units


def plan(sources: Sequence[Source], keys: Sequence[str], shard: int = 0, num_shards: int = 1) -> list[Piece]:
    """The pieces of `sources` in slice `shard` of `num_shards` (see the module docstring)."""
    layout = [(s, _units(s, keys)) for s in sources]  # every source is checked, whichever slice reads it
    total = sum(w for _, units in layout for w, _ in units)
    cuts = [total * i // num_shards for i in range(num_shards + 1)]
    lo, hi = cuts[shard], cuts[shard + 1]

    def slice_of(offset: int) -> int:
        return min(bisect.bisect_right(cuts, offset) - 1, num_shards - 1)

    pieces, offset = [], 0
    for source, units in layout:
        if source.kind == "json" and not source.compression:  # cut at line starts: lines starting in [a, b)
            a, b = max(lo - offset, 0), min(hi - offset, source.size)
            if a < b:
                pieces.append(Piece(source, a, b, 0, whole=(a, b) == (0, source.size)))
        elif source.kind == "parquet":
            starts = list(accumulate((w for w, _ in units), initial=offset))
            groups = [g for g in range(len(units)) if slice_of(starts[g]) == shard]
            if groups:
                first, last = groups[0], groups[-1] + 1
                pieces.append(Piece(source, first, last, units[first][1], whole=(first, last) == (0, len(units))))
        elif slice_of(offset) == shard:
            pieces.append(Piece(source, 0, None, 0, whole=True))
        offset += sum(w for w, _ in units)
    return pieces


class _ZstdRaw(io.RawIOBase):
    """A zstd file's decompressed bytes, frame after frame; a truncated last frame is an error, not an end
    (zstandard's stream_reader stops there silently)."""

    def __init__(self, f):
        zstd = _need("zstandard", "reading .zst files")
        self._f, self._new = f, zstd.ZstdDecompressor().decompressobj
        self._d, self._pending, self._in_frame = self._new(), b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._pending:
            block = self._f.read(READ_BLOCK)
            if not block:
                if self._in_frame:
                    raise EOFError("the file ends inside a zstd frame: it is truncated")
                return 0
            while block:
                out = self._d.decompress(block)
                self._pending += out
                self._in_frame = not self._d.eof
                block = self._d.unused_data if self._d.eof else b""
                if self._d.eof:
                    self._d = self._new()
        n = min(len(buf), len(self._pending))
        buf[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def open_binary(source: Source):
    """The source's (decompressed) bytes as a binary file object."""
    if source.compression == "gz":
        return gzip.open(source.path, "rb")
    if source.compression == "zst":
        raw = _ZstdRaw(open(source.path, "rb"))
        return io.BufferedReader(raw, READ_BLOCK)
    return open(source.path, "rb")


def _read_past_line(f) -> tuple[int, bool]:
    """Read to the end of the current line a block at a time: (bytes read, whether a newline ended them)."""
    n = 0
    while block := f.readline(READ_BLOCK):
        n += len(block)
        if block.endswith(b"\n"):
            return n, True
    return n, False


def _json_records(piece: Piece, max_bytes: int | None = None) -> Iterator[Record]:
    path, stop = str(piece.source.path), piece.stop
    # A line of max_bytes bytes and its newline is read whole; one more byte without a newline means it is over.
    read = -1 if max_bytes is None else max_bytes + 1
    with open_binary(piece.source) as f:
        base = 0
        if piece.start:  # begin at the first line that starts at or after `start`
            f.seek(piece.start - 1)
            if f.read(1) != b"\n":
                _read_past_line(f)
            base = f.tell()
        pos, n = base, 0
        while stop is None or pos < stop:
            line = f.readline(read)
            if not line:
                break
            n += 1
            pos += len(line)
            if len(line) == read and not line.endswith(b"\n"):
                rest, newline = _read_past_line(f)
                pos += rest
                yield (path, base, n), "json", TooLarge(len(line) + rest - newline, max_bytes), 0
            elif line.strip():
                yield (path, base, n), "json", line, len(line)


def _text_record(source: Source, max_bytes: int | None) -> Record:
    where = (str(source.path), 0, 0)
    with open_binary(source) as f:
        data = f.read(-1 if max_bytes is None else max_bytes + 1)
        if max_bytes is None or len(data) <= max_bytes:
            return where, "text", data, len(data)
        size = len(data)
        del data
        if source.compression:  # its size is known only once read through
            while block := f.read(READ_BLOCK):
                size += len(block)
        else:
            size = source.size
    return where, "text", TooLarge(size, max_bytes), 0


def _text_bytes(array) -> np.ndarray:
    """The UTF-8 bytes of each value of a string (or list of strings) column, nulls 0: from Arrow's offsets."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        values = _text_bytes(pc.list_flatten(array))
        parents = pc.list_parent_indices(array).to_numpy()
        return np.bincount(parents, weights=values, minlength=len(array)).astype(np.int64)
    if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
        array = array.cast(pa.large_string())  # string_view, which binary_length does not take
    return pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def _batch_records(path: str, batches, keys: Sequence[str], row: int, max_bytes: int | None = None
                   ) -> Iterator[Record]:
    import pyarrow as pa

    for batch in batches:
        # Python strings for PARQUET_BATCH_ROWS rows at a time: an Arrow file's batches can be far larger.
        for start in range(0, batch.num_rows, PARQUET_BATCH_ROWS):
            part = batch.slice(start, PARQUET_BATCH_ROWS)
            sizes = sum(_text_bytes(part.column(k)) for k in keys)
            over = sizes > max_bytes if max_bytes is not None else np.zeros(len(sizes), bool)
            kept = part.filter(pa.array(~over)) if over.any() else part  # rows over it never become strings
            values = zip(*(kept.column(k).to_pylist() for k in keys))
            for i, (size, too_large) in enumerate(zip(sizes.tolist(), over.tolist())):
                payload = TooLarge(size, max_bytes) if too_large else next(values)
                yield (path, 0, row + i), "row", payload, 0 if too_large else size
            row += part.num_rows


def _parquet_records(piece: Piece, keys: Sequence[str], max_bytes: int | None = None) -> Iterator[Record]:
    pa = _need("pyarrow", "reading Parquet files")
    pf = _parquet_file(piece.source.path, keys)
    batches = pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=range(piece.start, piece.stop),
                              columns=list(keys))
    try:
        yield from _batch_records(str(piece.source.path), batches, keys, piece.first_row, max_bytes)
    except pa.ArrowException as e:
        raise UserError(f"cannot read {piece.source.path} as Parquet ({e}): check the file is intact") from e
    finally:
        pf.close()


def _arrow_records(piece: Piece, keys: Sequence[str], max_bytes: int | None = None) -> Iterator[Record]:
    pa = _need("pyarrow", "reading datasets folders")
    import pyarrow.ipc

    path = piece.source.path
    # Read through a file handle, not a memory map: mapped pages would count in resident memory up to the
    # file's size. datasets writes the stream format; the file format (Feather v2) starts with ARROW1.
    with pa.OSFile(str(path)) as f:
        try:
            if f.read(6) == b"ARROW1":
                reader = pyarrow.ipc.open_file(f)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                f.seek(0)
                reader = pyarrow.ipc.open_stream(f)
                batches = iter(reader)
            _text_columns(path, reader.schema, keys)
            yield from _batch_records(str(path), batches, keys, 0, max_bytes)
        except pa.ArrowException as e:
            raise UserError(f"cannot read {path} as Arrow ({e}): check the file is intact") from e


def records(pieces: Iterable[Piece], keys: Sequence[str], max_bytes: int | None = None) -> Iterator[Record]:
    """Every document of the pieces, in order; one over `max_bytes` as a TooLarge (see the module docstring)."""
    for piece in pieces:
        source = piece.source
        try:
            if source.kind == "json":
                yield from _json_records(piece, max_bytes)
            elif source.kind == "text":
                yield _text_record(source, max_bytes)
            elif source.kind == "parquet":
                yield from _parquet_records(piece, keys, max_bytes)
            else:
                yield from _arrow_records(piece, keys, max_bytes)
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise UserError(f"cannot read {source.path} ({e}): check the file is intact") from e
        except UserError:
            raise
        except Exception as e:  # zstandard.ZstdError, which is no OSError
            if type(e).__name__ != "ZstdError":
                raise
            raise UserError(f"cannot read {source.path} ({e}): check the file is intact") from e


def describe(where: Where, kind: str, lines: dict | None = None) -> str:
    """`file:line` (JSON lines), `file row N` (Parquet, Arrow) or `file` (plain text), for messages.

    A slice that starts inside a file knows only its own line numbers; the file's are counted from the
    start on demand (errors only), once per slice when `lines` (a cache) is given.
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

