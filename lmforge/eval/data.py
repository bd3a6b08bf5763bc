"""Task data from local files: lm-eval tasks that never reach for the Hugging Face Hub.

A task YAML names this loader as its `custom_dataset` and lists its files per split; relative paths
are read under the data folder (`lmforge eval --data-dir DIR`, lm-eval's `--metadata '{"data_dir":
DIR}'`), else beside the YAML:

    custom_dataset: !function lmforge.eval.data.local_dataset
    dataset_kwargs:
      data_files:
        validation: classification/sst-2/dev.tsv

JSON Lines (.jsonl), a JSON list (.json), TSV and CSV (a header row; a column of whole numbers
becomes ints, as pandas reads it) are read into in-memory `datasets.Dataset`s: nothing is cached or
downloaded. The WikiText helpers let lm-eval's own WikiText detokenizer and perplexity counts read
lmforge's article files ({"title", "text"} per line, see shared/data/SOURCES.md).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from lmforge.errors import UserError

DATA_DIR_KEY = "data_dir"  # the metadata key lm-eval hands to custom_dataset
PACKAGED_TASKS = Path(__file__).parent / "tasks"  # lmforge's own task YAMLs


def local_dataset(
    data_files: dict[str, str | list[str]] | None = None,
    data_dir: str | None = None,
    config_source: str | None = None,
    **_: Any,
):
    """A datasets.DatasetDict of the files named per split. `data_dir` and `config_source` (the
    task's YAML, set by lm-eval) come from the task's metadata; anything else there is ignored."""
    import datasets

    if not data_files:
        raise UserError(
            f"task {config_source or ''} names no dataset_kwargs.data_files for "
            "lmforge.eval.data.local_dataset: list a file per split"
        )
    yaml_dir = Path(config_source).parent if config_source and config_source != "inline" else None
    base = Path(data_dir) if data_dir else yaml_dir
    splits = {}
    names = {
        split: [files] if isinstance(files, str) else list(files)
        for split, files in data_files.items()
    }
    relative = [
        n for files in names.values() for n in files if not Path(n).expanduser().is_absolute()
    ]
    for split, files in names.items():
        rows = []
        for name in files:
            rows += read_rows(_locate(name, base, data_dir, config_source, relative))
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)


def _locate(
    name: str,
    base: Path | None,
    data_dir: str | None,
    config_source: str | None,
    relative: list[str],
) -> Path:
    """The file `name` of a task's data_files; where it is missing, a UserError saying where it
    was looked for and how to point the task at it (`relative`: the task's relative data_files,
    the layout --data-dir must hold)."""
    path = Path(name).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    if path.is_file():
        return path
    yaml = Path(config_source) if config_source and config_source != "inline" else None
    if yaml is not None and yaml.parent.resolve() == PACKAGED_TASKS.resolve():
        # lmforge's own task: its YAML lives inside the installed package, which is no place for a
        # user's edit.
        edit = (
            f"copy {yaml} to a folder of your own, edit its dataset_kwargs.data_files there and pass "
            "--include-path THAT_FOLDER"
        )
    elif yaml is not None:
        edit = f"edit dataset_kwargs.data_files in {yaml}"
    else:
        edit = "point the task's dataset_kwargs.data_files at it"
    if Path(name).expanduser().is_absolute():
        raise UserError(f"task data file '{name}' not found: {edit}")
    where = f"in --data-dir {data_dir}" if data_dir else "(no --data-dir given)"
    layout = " and ".join(dict.fromkeys(relative))
    raise UserError(
        f"task data file '{name}' not found {where}: pass --data-dir DIR, the folder holding {layout}, "
        f"or {edit}"
    )


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The records of one JSONL/JSON/TSV/CSV file."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        if suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, list):
                return data
            raise UserError(f"{path} is not a JSON list of records: use JSON Lines or a list")
        if suffix in (".tsv", ".csv"):
            with path.open(encoding="utf-8", newline="") as f:
                # TSV files (GLUE's) quote nothing: a '"' inside a sentence is a character.
                reader = (
                    csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
                    if suffix == ".tsv"
                    else csv.DictReader(f)
                )
                return _typed(list(reader))
    except (json.JSONDecodeError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"cannot read task data {path} ({e}): check the file") from None
    raise UserError(
        f"task data {path}: unknown file kind '{suffix}': use .jsonl, .json, .tsv or .csv"
    )


def _typed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Columns whose every cell is a whole number as ints (GLUE's labels), the rest as the text
    it is."""
    whole = [k for k in (rows[0] if rows else {}) if all(_is_int(r[k]) for r in rows)]
    for row in rows:
        for k in whole:
            row[k] = int(row[k])
    return rows


def _is_int(value: str | None) -> bool:
    return value is not None and value.strip().removeprefix("-").isdigit()


# -- WikiText article files ------------------------------------------------------------------------


def wikitext_target(doc: dict) -> str:
    """The article's text as lm-eval's WikiText task scores it (its detokenizer)."""
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    return wikitext_detokenizer({"page": doc["text"]})


def wikitext_results(doc: dict, results) -> dict:
    """lm-eval's WikiText metrics (word and byte perplexity, bits per byte), words counted before
    detokenization as there."""
    from lm_eval.tasks.wikitext.preprocess_wikitext import process_results

    return process_results({"page": doc["text"]}, results)
