"""Local task data: every file kind gives the same records, relative paths follow the data
folder."""

from __future__ import annotations

import json

import pytest

from lmforge.errors import UserError
from lmforge.eval.data import local_dataset, read_rows

pytest.importorskip("datasets")

ROWS = [{"sentence": 'a "quoted" word , 1', "label": 1}, {"sentence": "12", "label": 0}]


def test_every_file_kind_reads_the_same_records(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    (tmp_path / "a.json").write_text(json.dumps(ROWS))
    # GLUE's TSV quotes nothing; a column of whole numbers is read as ints, a text column stays text
    # ("12").
    (tmp_path / "a.tsv").write_text(
        "sentence\tlabel\n" + "".join(f"{r['sentence']}\t{r['label']}\n" for r in ROWS)
    )
    (tmp_path / "a.csv").write_text('sentence,label\n"a ""quoted"" word , 1",1\n12,0\n')
    for name in ("a.jsonl", "a.json", "a.tsv", "a.csv"):
        assert read_rows(tmp_path / name) == ROWS, name


def test_relative_files_follow_the_data_dir_then_the_yaml(tmp_path):
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "sub" / "x.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "y.jsonl").write_text(json.dumps(ROWS[1]) + "\n")
    got = local_dataset({"validation": "sub/x.jsonl"}, data_dir=str(tmp_path / "data"), version=1.0)
    assert got["validation"].to_list() == [ROWS[0]]
    got = local_dataset(
        {"test": ["y.jsonl", "y.jsonl"]}, config_source=str(tmp_path / "tasks" / "t.yaml")
    )
    assert got["test"].to_list() == [ROWS[1], ROWS[1]]
    with pytest.raises(
        UserError,
        match=r"'sub/x.jsonl' not found \(no --data-dir given\): pass --data-dir DIR, the "
        r"folder holding sub/x.jsonl, or edit dataset_kwargs.data_files in .*t.yaml$",
    ):
        local_dataset(
            {"validation": "sub/x.jsonl"}, config_source=str(tmp_path / "tasks" / "t.yaml")
        )


def test_unreadable_files_are_one_line_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "obj.json").write_text("{}")
    (tmp_path / "x.parquet").write_bytes(b"")
    for name, message in [
        ("bad.jsonl", "cannot read task data"),
        ("obj.json", "not a JSON list"),
        ("x.parquet", "unknown file kind"),
    ]:
        with pytest.raises(UserError, match=message):
            read_rows(tmp_path / name)
    with pytest.raises(UserError, match="names no dataset_kwargs.data_files"):
        local_dataset(None)
