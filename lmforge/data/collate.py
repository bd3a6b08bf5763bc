"""What the fine-tuning datasets share: JSON records in (errors name file:line), padded batches
out."""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from lmforge.errors import UserError

# Label value that PyTorch's cross_entropy skips (its default ignore_index), as Hugging Face uses
# it.
IGNORE_INDEX = -100


def open_text(path: Path, newline: str | None = None) -> io.TextIOBase:
    """`path` opened as UTF-8 text (a leading byte-order mark skipped), gunzipped when named .gz."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data file {path} not found: check the path")
    if path.name.lower().endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8-sig", newline=newline)
    return open(path, encoding="utf-8-sig", newline=newline)


def read_json_records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """Yield `(where, record)` from a JSON list file (Alpaca's) or a JSON-lines file, `.gz` allowed.

    The kind is told by the first non-blank character, `[` for a list, not by the suffix: `.json` is
    used for both. `where` is `file:line` for JSON lines and `file: record N` (1-based) for a list.
    Blank lines are skipped; a malformed line, a record that is not an object, or a file without
    records is a UserError.
    """
    path = Path(path)
    count = 0
    try:
        with open_text(path) as f:
            while (first := f.read(1)) and first.isspace():
                pass
            f.seek(0)
            if first == "[":
                try:
                    data = json.load(f)
                except json.JSONDecodeError as e:
                    raise UserError(
                        f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})"
                    ) from None
                for i, rec in enumerate(data, start=1):
                    count += 1
                    yield _object(rec, f"{path}: record {i}")
            else:
                for lineno, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    where = f"{path}:{lineno}"
                    try:
                        rec = json.loads(line.rstrip("\r\n"))  # a column on this line, not the next
                    except json.JSONDecodeError as e:
                        raise UserError(
                            f"{where}: malformed JSON ({e.msg} at column {e.colno})"
                        ) from None
                    count += 1
                    yield _object(rec, where)
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path}: not valid UTF-8 ({e.reason} at byte {e.start}): re-encode the file"
        ) from None
    except (OSError, EOFError) as e:
        raise UserError(f"cannot read {path} ({e}): check the file is intact") from None
    if count == 0:
        raise UserError(f"{path} holds no records: give a JSON list or JSON lines of objects")


def _object(rec, where: str) -> tuple[str, dict]:
    if not isinstance(rec, dict):
        raise UserError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    return where, rec


@dataclass(frozen=True)
class PadCollator:
    """Stack items (dicts of tensors) into a batch, right-padding 1-D tensors to the longest in the
    batch.

    `input_ids` is padded with `pad_id`, `labels` with IGNORE_INDEX, every other 1-D tensor
    (`attention_mask`, `position_ids`, `segment_ids`) with 0; 0-D tensors (a class `label`) are
    stacked. `pad_to_multiple_of` rounds the padded length up, so torch.compile sees few distinct
    shapes, but never past `max_length` (the run's seq_length) when the longest item fits in it. A
    dataclass, not a closure, so DataLoader workers can pickle it.
    """

    pad_id: int
    pad_to_multiple_of: int = 1
    max_length: int | None = None

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = {}
        for key in items[0]:
            values = [item[key] for item in items]
            if values[0].dim() == 0:
                batch[key] = torch.stack(values)
                continue
            longest = max(v.numel() for v in values)
            length = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
            if self.max_length is not None and longest <= self.max_length:
                length = min(length, self.max_length)
            fill = self.pad_id if key == "input_ids" else IGNORE_INDEX if key == "labels" else 0
            out = torch.full((len(values), length), fill, dtype=values[0].dtype)
            for row, v in zip(out, values):
                row[: v.numel()] = v
            batch[key] = out
        return batch
