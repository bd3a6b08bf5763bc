"""The documents of the pieces `lmforge.data.inputs.plan` cut, read as records, in order, each
streamed: a JSON line at a time, a plain-text file whole (it is one document), Parquet and Arrow a
record batch at a time.

Documents over a size limit (`max_bytes`: a JSON line's bytes, a plain-text file's, a row's UTF-8
bytes of its `--json-keys` columns, counted by Arrow before any Python string is made) are never
read whole: the reader yields a `TooLarge` in their place, and reads past them in blocks, so memory
stays bounded by the limit even for a line of many GB without a newline. A JSON line's bytes bound
its text's (escapes only shrink), so no text over the limit reaches a tokenizer.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from lmforge.data.inputs import READ_BLOCK, Piece, Source, Where, need, parquet_file, text_columns
from lmforge.errors import UserError

# rows per record batch read from Parquet: a few MB of long documents, cheap per batch
PARQUET_BATCH_ROWS = 256

# A record: (where, kind, payload, size). `where` is inputs.Where. `kind` is "json" (payload: a raw
# line), "text" (the file's bytes) or "row" (a tuple of the --json-keys columns' values); the
# payload is a TooLarge in place of any of them. `size` is about the payload's bytes, for chunking.
Record = tuple[Where, str, object, int]


@dataclass(frozen=True)
class TooLarge:
    """A record's payload in place of a document over the size limit, which was read past, never
    held."""

    size: int  # the document's bytes (a JSON line's without its newline)
    limit: int

    def reason(self, kind: str) -> str:
        """What is wrong, for `describe(where): reason` messages."""
        over = f"more than the --max-document-bytes limit of {self.limit:,}"
        if kind == "text":
            return (
                f"{self.size:,} bytes, {over} (a plain-text file is one document): split it into JSON lines, "
                "or raise the limit"
            )
        what = "a line" if kind == "json" else "a row of text"
        return f"{what} of {self.size:,} bytes, {over}: raise the limit to tokenize it"


class _ZstdRaw(io.RawIOBase):
    """A zstd file's decompressed bytes, frame after frame; a truncated last frame is an error,
    not an end (zstandard's stream_reader stops there silently)."""

    def __init__(self, f):
        zstd = need("zstandard", "reading .zst files")
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
    """Read to the end of the current line a block at a time: (bytes read, whether a newline
    ended them)."""
    n = 0
    while block := f.readline(READ_BLOCK):
        n += len(block)
        if block.endswith(b"\n"):
            return n, True
    return n, False


def _json_records(piece: Piece, max_bytes: int | None = None) -> Iterator[Record]:
    path, stop = str(piece.source.path), piece.stop
    # A line of max_bytes bytes and its newline is read whole; one more byte without a newline means
    # it is over.
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
    """The UTF-8 bytes of each value of a string (or list of strings) column, nulls 0: from
    Arrow's offsets."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        values = _text_bytes(pc.list_flatten(array))
        parents = pc.list_parent_indices(array).to_numpy()
        return np.bincount(parents, weights=values, minlength=len(array)).astype(np.int64)
    if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
        array = array.cast(pa.large_string())  # string_view, which binary_length does not take
    return pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def _batch_records(
    path: str, batches, keys: Sequence[str], row: int, max_bytes: int | None = None
) -> Iterator[Record]:
    import pyarrow as pa

    for batch in batches:
        # Python strings for PARQUET_BATCH_ROWS rows at a time: an Arrow file's batches can be far
        # larger.
        for start in range(0, batch.num_rows, PARQUET_BATCH_ROWS):
            part = batch.slice(start, PARQUET_BATCH_ROWS)
            sizes = sum(_text_bytes(part.column(k)) for k in keys)
            over = sizes > max_bytes if max_bytes is not None else np.zeros(len(sizes), bool)
            # rows over it never become strings
            kept = part.filter(pa.array(~over)) if over.any() else part
            values = zip(*(kept.column(k).to_pylist() for k in keys))
            for i, (size, too_large) in enumerate(zip(sizes.tolist(), over.tolist())):
                payload = TooLarge(size, max_bytes) if too_large else next(values)
                yield (path, 0, row + i), "row", payload, 0 if too_large else size
            row += part.num_rows


def _parquet_records(
    piece: Piece, keys: Sequence[str], max_bytes: int | None = None
) -> Iterator[Record]:
    pa = need("pyarrow", "reading Parquet files")
    pf = parquet_file(piece.source.path, keys)
    batches = pf.iter_batches(
        batch_size=PARQUET_BATCH_ROWS, row_groups=range(piece.start, piece.stop), columns=list(keys)
    )
    try:
        yield from _batch_records(str(piece.source.path), batches, keys, piece.first_row, max_bytes)
    except pa.ArrowException as e:
        raise UserError(
            f"cannot read {piece.source.path} as Parquet ({e}): check the file is intact"
        ) from e
    finally:
        pf.close()


def _arrow_records(
    piece: Piece, keys: Sequence[str], max_bytes: int | None = None
) -> Iterator[Record]:
    pa = need("pyarrow", "reading datasets folders")
    import pyarrow.ipc

    path = piece.source.path
    # A file handle, not a memory map, whose pages would count in resident memory up to the file's
    # size. datasets writes the stream format; the file format (Feather v2) starts with ARROW1.
    with pa.OSFile(str(path)) as f:
        try:
            if f.read(6) == b"ARROW1":
                reader = pyarrow.ipc.open_file(f)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                f.seek(0)
                reader = pyarrow.ipc.open_stream(f)
                batches = iter(reader)
            text_columns(path, reader.schema, keys)
            yield from _batch_records(str(path), batches, keys, 0, max_bytes)
        except pa.ArrowException as e:
            raise UserError(f"cannot read {path} as Arrow ({e}): check the file is intact") from e


def records(
    pieces: Iterable[Piece], keys: Sequence[str], max_bytes: int | None = None
) -> Iterator[Record]:
    """Every document of the pieces, in order; one over `max_bytes` as a TooLarge (see the module
    docstring)."""
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
