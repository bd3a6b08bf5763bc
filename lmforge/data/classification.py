"""Sequence classification data (SST-2 and the like): text + label rows -> token ids + a class id.

Files, by suffix (optionally `.gz`):

* `.tsv` / `.csv` with a header row. GLUE's TSVs are read as GLUE's own processors read them:
  tab-separated, quote characters taken literally (SST-2 sentences contain `"`). `.csv` follows the
  usual CSV quoting.
* `.jsonl` / `.json` / `.ndjson`: JSON lines or a JSON list of objects.

Columns: the text is `text_key`, by default whichever of `sentence` and `text` is present; the label
is `label_key` (`label`). A file without the label column is unlabelled: its items have no `label`,
for prediction (GLUE's test files; their `index` column is kept in `row_ids`); `require_labels`
refuses one instead (a file to train or validate on, whose label column may only be misnamed). The
text is kept as given: GLUE pads every SST-2 sentence with a space before the tab, and transformers'
run_glue reads it too.

Labels: when every label is a non-negative integer (or its string), it is the class id. Otherwise
the distinct strings, sorted, are the class names and their positions the ids. Either way
`label_names` holds the names; pass a training set's `label_names` to its dev/test sets so ids
agree, and store them with the model (`id2label`). Deriving the classes, label_ids warns of labels
that look mistyped: a few non-integer labels among integer ones (or the reverse), and classes of
almost no rows or none.

Tokens: `prefix_ids + text + suffix_ids`, cut to `max_length` by cutting the text, so a BERT's [CLS]
... [SEP] (prefix_ids=[cls], suffix_ids=[sep]) stay in place. The collator right-pads a batch to its
longest.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lmforge.data.collate import PadCollator, open_text, read_json_records
from lmforge.errors import UserError
from lmforge.tokenizers import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

TEXT_KEYS = ("sentence", "text")
ROW_ID_KEYS = ("index", "idx", "id")
SUFFIXES = {".tsv": "tsv", ".csv": "csv", ".jsonl": "json", ".json": "json", ".ndjson": "json"}
ENCODE_CHUNK = 4096  # texts per encode_batch call
# A class with fewer rows than both of these is worth a warning (a typo makes a class of one row).
RARE_CLASS_ROWS, RARE_CLASS_SHARE = 5, 0.01


def read_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """Yield `(where, row)` for each data row of a TSV/CSV (header first) or JSON file."""
    name = path.name.lower().removesuffix(".gz")
    kind = SUFFIXES.get(Path(name).suffix)
    if kind is None:
        raise UserError(
            f"classification file {path} is of an unknown kind: give .tsv, .csv or .jsonl (or .gz)"
        )
    if kind == "json":
        yield from read_json_records(path)
        return
    with open_text(path, newline="") as f:  # csv's own newline handling, for quoted line breaks
        reader = (
            csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            if kind == "tsv"
            else csv.reader(f)
        )
        try:
            header = next(reader, None)
            if not header:
                raise UserError(
                    f"{path} is empty: it needs a header row (e.g. sentence<TAB>label) and data rows"
                )
            for row in reader:
                where = f"{path}:{reader.line_num}"
                if not row:
                    continue
                if len(row) != len(header):
                    raise UserError(
                        f"{where}: {len(row)} columns where the header {header} has {len(header)}"
                    )
                yield where, dict(zip(header, row))
        except csv.Error as e:
            raise UserError(f"{path}:{reader.line_num}: malformed {kind.upper()} ({e})") from None
        except UnicodeDecodeError as e:
            raise UserError(
                f"{path}: not valid UTF-8 ({e.reason} at byte {e.start}): re-encode the file"
            ) from None


def _int_label(v) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    return None


def label_ids(raw: Sequence, wheres: Sequence[str], label_names: Sequence[str] | None = None):
    """Class ids for raw labels and the class names; see the module docstring for the rules."""
    for v, where in zip(raw, wheres):
        if not isinstance(v, str | int) or isinstance(v, bool):
            raise UserError(
                f"{where}: label {v!r} must be a class id (integer) or a class name (string)"
            )
    if label_names is not None:
        names = [str(n) for n in label_names]
        index = {n: i for i, n in enumerate(names)}
        ids = []
        for v, where in zip(raw, wheres):
            i = index.get(str(v).strip())
            if i is None and (n := _int_label(v)) is not None and 0 <= n < len(names):
                i = n
            if i is None:
                raise UserError(f"{where}: label {v!r} is not one of the classes {names}")
            ids.append(i)
        return np.array(ids, np.int64), names
    ints = [_int_label(v) for v in raw]
    if all(i is not None for i in ints):
        for i, v, where in zip(ints, raw, wheres):
            if i < 0:
                raise UserError(f"{where}: label {v!r} is negative: class ids start at 0")
    warn_of_odd_labels(raw, wheres)
    if all(i is not None for i in ints):
        return np.array(ints, np.int64), [str(i) for i in range(max(ints) + 1)]
    names = sorted({str(v).strip() for v in raw})
    index = {n: i for i, n in enumerate(names)}
    return np.array([index[str(v).strip()] for v in raw], np.int64), names


def warn_of_odd_labels(raw: Sequence, wheres: Sequence[str]) -> list[str]:
    """Warn of the labels of a training set that look mistyped, each with its first row: the
    integer-looking labels where most rows have non-integer ones or the reverse (one `positive`
    among 0/1 labels silently makes a third class), labels of fewer than RARE_CLASS_ROWS rows
    that are under RARE_CLASS_SHARE of them, and class ids that leave classes without rows (a 7
    among 0/1 labels makes 8 classes). The labels warned of."""
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for v, where in zip(raw, wheres):
        key = str(v).strip()
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, where)
    numeric = {k for k in counts if _int_label(k) is not None}
    odd: list[str] = []
    if numeric and len(numeric) < len(counts):
        numeric_rows = sum(counts[k] for k in numeric)
        # most rows are integer-labelled: the other labels are odd
        in_integers = numeric_rows * 2 >= len(raw)
        odd = sorted(set(counts) - numeric if in_integers else numeric, key=lambda k: counts[k])
        usual = sorted(numeric if in_integers else set(counts) - numeric)
        for k in odd:
            logger.warning(
                "%s: label %r (%d row%s) is %s, unlike the labels %s of most rows: it makes a class of its "
                "own (%d classes); fix it if it is a typo",
                first[k],
                k,
                counts[k],
                "" if counts[k] == 1 else "s",
                "not an integer" if in_integers else "an integer",
                usual[:10],
                len(counts),
            )
    # class ids: 0 to the largest, each a class, rows or none
    if numeric and len(numeric) == len(counts):
        ids = {_int_label(k): k for k in counts}
        top = max(ids)
        empty = sorted(set(range(top + 1)) - set(ids))
        if empty:
            logger.warning(
                "%s: label %r makes %d classes, of which %s ha%s no rows: fix it if it is a typo",
                first[ids[top]],
                ids[top],
                top + 1,
                empty[:10],
                "s" if len(empty) == 1 else "ve",
            )
            odd.append(ids[top])
    for k, n in counts.items():
        if k not in odd and n < RARE_CLASS_ROWS and n < RARE_CLASS_SHARE * len(raw):
            logger.warning(
                "%s: label %r labels only %d of %d rows: a class of its own, learnt from almost nothing; "
                "fix it if it is a typo",
                first[k],
                k,
                n,
                len(raw),
            )
            odd.append(k)
    return odd


class ClassificationDataset(Dataset):
    """Rows of one file, tokenized at construction; items are `input_ids`, `attention_mask` and
    `label`."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer | str | Path,
        max_length: int = 128,
        text_key: str | None = None,
        label_key: str = "label",
        label_names: Sequence[str] | None = None,
        prefix_ids: Sequence[int] = (),
        suffix_ids: Sequence[int] = (),
        require_labels: bool = False,
    ):
        self.path = Path(path)
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        self.prefix_ids, self.suffix_ids = list(prefix_ids), list(suffix_ids)
        room = max_length - len(self.prefix_ids) - len(self.suffix_ids)
        if room < 1:
            raise UserError(
                f"max_length {max_length} leaves no room for text beside prefix/suffix ids"
            )
        self.max_length = max_length

        texts, raw_labels, wheres, self.row_ids = [], [], [], []
        self.has_labels = None
        for n, (where, row) in enumerate(read_rows(self.path)):
            if text_key is None:
                text_key = next((k for k in TEXT_KEYS if k in row), None)
            if text_key not in row:
                wanted = repr(text_key) if text_key else " or ".join(map(repr, TEXT_KEYS))
                raise UserError(
                    f"{where}: no text column {wanted} among {sorted(row)}: set text_key "
                    f"(data.text_key in a run)"
                )
            if self.has_labels is None:
                self.has_labels = label_key in row
                # else read as unlabelled: no `label` to train on
                if require_labels and not self.has_labels:
                    raise UserError(
                        f"{self.path}: no label column {label_key!r} among its columns {list(row)}: "
                        f"a file to train or validate on needs one: rename the column that holds the "
                        f"classes to {label_key!r}, or name it (data.label_key=COLUMN in a run)"
                    )
            if self.has_labels and label_key not in row:
                raise UserError(
                    f"{where}: no label {label_key!r} here, though earlier rows have one"
                )
            if not isinstance(row[text_key], str):
                raise UserError(
                    f"{where}: {text_key!r} must be a string, got {type(row[text_key]).__name__}"
                )
            # as given: transformers' run_glue reads GLUE's trailing space too
            texts.append(row[text_key])
            if self.has_labels:
                raw_labels.append(row[label_key])
                wheres.append(where)
            self.row_ids.append(str(next((row[k] for k in ROW_ID_KEYS if k in row), n)))
        if not texts:
            raise UserError(f"{self.path} holds no data rows")

        self.labels, self.label_names = None, list(label_names) if label_names is not None else None
        if self.has_labels:
            self.labels, self.label_names = label_ids(raw_labels, wheres, label_names)

        pieces, self.num_cut = [], 0
        for start in range(0, len(texts), ENCODE_CHUNK):
            for ids in tok.encode_batch(texts[start : start + ENCODE_CHUNK]):
                self.num_cut += len(ids) > room
                pieces.append(np.array(self.prefix_ids + ids[:room] + self.suffix_ids, np.int64))
        self.offsets = np.cumsum([0] + [len(p) for p in pieces])
        # one flat array: cheap to hold and to send to DataLoader workers
        self.ids = np.concatenate(pieces)
        self.pad_id = tok.padding_id
        self.collate = PadCollator(self.pad_id)
        logger.info(
            "%s: %d rows, %s, %d tokens",
            self.path,
            len(self),
            f"{self.num_labels} classes {self.label_names}" if self.has_labels else "unlabelled",
            len(self.ids),
        )

    @property
    def num_labels(self) -> int:
        return len(self.label_names) if self.label_names is not None else 0

    @property
    def id2label(self) -> dict[int, str]:
        return dict(enumerate(self.label_names or []))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.ids[self.offsets[i] : self.offsets[i + 1]])
        item = {"input_ids": ids, "attention_mask": torch.ones(len(ids), dtype=torch.int64)}
        if self.labels is not None:
            item["label"] = torch.tensor(self.labels[i])
        return item
