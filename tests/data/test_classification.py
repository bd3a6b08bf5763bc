"""Classification rows checked against GLUE's official SST-2 counts and against independently read
rows.

The 67,349-row training file is tokenized with a byte tokenizer (ids = UTF-8 bytes), whose ids the
test can compute itself and which is fast; dev and test use the real GPT-2 tokenizer.
"""

import dataclasses
import gzip
import json
import re
from pathlib import Path

import pytest
import torch

from lmforge.data.classification import ClassificationDataset
from lmforge.errors import UserError
from lmforge.tokenizers import Tokenizer, load_tokenizer


class ByteTokenizer(Tokenizer):
    vocab_size, eos_id, pad_id, files = 256, None, None, [Path("bytes")]

    def _encode(self, text):
        return list(text.encode("utf-8"))

    def _encode_batch(self, texts):
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8")

    def id_to_token(self, i):
        return chr(i)

    def token_to_id(self, tok):
        return ord(tok) if len(tok) == 1 else None


@pytest.fixture(scope="module")
def sst2(shared_data) -> Path:
    return shared_data / "classification" / "sst-2"


@pytest.fixture(scope="module")
def gpt2(shared_data):
    return load_tokenizer(shared_data / "tokenizers" / "gpt2")


def plain_rows(path: Path) -> list[list[str]]:
    """GLUE TSV rows, read without csv: one line, fields split at tabs."""
    return [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()[1:]]


def test_sst2_train_has_the_official_counts(sst2):
    ds = ClassificationDataset(sst2 / "train.tsv", ByteTokenizer(), max_length=1024)
    assert len(ds) == 67349
    assert (ds.labels == 1).sum() == 37569 and (ds.labels == 0).sum() == 29780
    assert ds.label_names == ["0", "1"] and ds.num_labels == 2 and ds.id2label == {0: "0", 1: "1"}
    rows = plain_rows(sst2 / "train.tsv")
    for i in range(0, 67349, 1013):
        item = ds[i]
        assert bytes(item["input_ids"].tolist()).decode() == rows[i][0]
        assert item["label"].item() == int(rows[i][1])
    assert ds.num_cut == 0


def test_sst2_dev_and_unlabelled_test(sst2, gpt2):
    dev = ClassificationDataset(sst2 / "dev.tsv", gpt2, max_length=128, label_names=["0", "1"])
    assert len(dev) == 872
    assert (dev.labels == 1).sum() == 444 and (dev.labels == 0).sum() == 428
    rows = plain_rows(sst2 / "dev.tsv")
    # GLUE's trailing space, kept: transformers' run_glue tokenizes the text as given, and so does a
    # user who feeds the export raw GLUE rows (stripped here, a classifier trained on GPT-2's pooled
    # last token gave other answers).
    assert rows[0][0] == "it 's a charming and often affecting journey . "
    for i in range(0, 872, 17):
        item = dev[i]
        assert item["input_ids"].tolist() == gpt2.encode(rows[i][0])
        assert item["label"].item() == int(rows[i][1])
        assert item["attention_mask"].tolist() == [1] * len(item["input_ids"])

    test = ClassificationDataset(sst2 / "test.tsv", gpt2, max_length=128)
    assert len(test) == 1821 and not test.has_labels and test.labels is None
    assert set(test[0]) == {"input_ids", "attention_mask"}
    rows = plain_rows(sst2 / "test.tsv")
    assert test.row_ids == [r[0] for r in rows] == [str(i) for i in range(1821)]
    assert test[5]["input_ids"].tolist() == gpt2.encode(rows[5][1])


def test_collate_pads_right_and_stacks_labels(sst2, gpt2):
    dev = ClassificationDataset(sst2 / "dev.tsv", gpt2, max_length=16)
    items = [dev[i] for i in range(6)]
    assert max(len(x["input_ids"]) for x in items) == 16  # some dev sentences are cut at 16
    assert dev.num_cut > 0
    batch = dev.collate(items)
    longest = max(len(x["input_ids"]) for x in items)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (6, longest)
    assert (
        batch["label"].tolist() == [x["label"].item() for x in items]
        and batch["label"].dtype == torch.int64
    )
    for row, x in enumerate(items):
        n = len(x["input_ids"])
        assert torch.equal(batch["input_ids"][row, :n], x["input_ids"])
        assert (batch["input_ids"][row, n:] == 50256).all()  # GPT-2 has no pad: eos pads
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (longest - n)


def test_max_length_cuts_the_text_and_keeps_cls_sep(sst2, gpt2):
    ds = ClassificationDataset(
        sst2 / "dev.tsv", gpt2, max_length=10, prefix_ids=[7], suffix_ids=[8]
    )
    rows = plain_rows(sst2 / "dev.tsv")
    for i in range(50):
        ids = ds[i]["input_ids"].tolist()
        assert ids == [7] + gpt2.encode(rows[i][0])[:8] + [8]


def test_string_labels_jsonl_and_a_shared_mapping(tmp_path, gpt2):
    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.jsonl"
    rows = [
        ("good film", "positive"),
        ("dull", "negative"),
        ("fine", "neutral"),
        ("great", "positive"),
    ]
    train.write_text(
        "".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows), encoding="utf-8"
    )
    dev.write_text(json.dumps({"text": "meh", "label": "neutral"}) + "\n", encoding="utf-8")
    ds = ClassificationDataset(train, gpt2)
    assert ds.label_names == ["negative", "neutral", "positive"]
    assert ds.labels.tolist() == [2, 0, 1, 2]
    assert ds[0]["input_ids"].tolist() == gpt2.encode("good film")
    assert ClassificationDataset(dev, gpt2, label_names=ds.label_names).labels.tolist() == [1]
    with pytest.raises(UserError, match=r"dev\.jsonl:1: label 'neutral' is not one of the classes"):
        ClassificationDataset(dev, gpt2, label_names=["negative", "positive"])


def test_csv_with_quotes_and_named_columns(tmp_path, gpt2):
    path = tmp_path / "reviews.csv"
    path.write_text(
        'review,sentiment\n"good, really good",1\n"said ""no""",0\nplain,1\n', encoding="utf-8"
    )
    ds = ClassificationDataset(path, gpt2, text_key="review", label_key="sentiment")
    assert len(ds) == 3 and ds.labels.tolist() == [1, 0, 1]
    assert gpt2.decode(ds[0]["input_ids"].tolist()) == "good, really good"
    assert gpt2.decode(ds[1]["input_ids"].tolist()) == 'said "no"'


def test_gzip_and_byte_order_mark(tmp_path, gpt2):
    tsv = tmp_path / "excel.tsv"
    # a BOM must not rename the column
    tsv.write_text("sentence\tlabel\nfine\t1\n", encoding="utf-8-sig")
    assert ClassificationDataset(tsv, gpt2).labels.tolist() == [1]
    gz = tmp_path / "rows.json.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        json.dump([{"text": "a", "label": 0}, {"text": "b", "label": 2}], f)  # a JSON list, gzipped
    ds = ClassificationDataset(gz, gpt2)
    assert ds.labels.tolist() == [0, 2] and ds.label_names == ["0", "1", "2"]


@pytest.mark.parametrize(
    "name, content, match",
    [
        (
            "a.tsv",
            "sentence\tlabel\nok\t1\nbad row\t0\textra\n",
            r"a\.tsv:3: 3 columns where the header",
        ),
        ("a.tsv", "", r"a\.tsv is empty"),
        ("a.tsv", "sentence\tlabel\n", r"holds no data rows"),
        (
            "a.tsv",
            "review\tlabel\nok\t1\n",
            r"a\.tsv:2: no text column 'sentence' or 'text' among \['label', 'review'\]",
        ),
        ("a.tsv", "sentence\tlabel\nok\t-1\n", r"a\.tsv:2: label '-1' is negative"),
        (
            "a.jsonl",
            '{"text": "a", "label": 1}\n{"text": "b"}\n',
            r"a\.jsonl:2: no label 'label' here",
        ),
        ("a.jsonl", '{"text": "a", "label": 1.5}\n', r"a\.jsonl:1: label 1\.5 must be a class id"),
        (
            "a.jsonl",
            '{"text": "a", "label": 1}\n{"text": "b", "label": 0\n',
            r"a\.jsonl:2: malformed JSON",
        ),
        ("a.txt", "x", r"unknown kind"),
    ],
)
def test_bad_files_are_one_line_user_errors(tmp_path, gpt2, name, content, match):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=match) as e:
        ClassificationDataset(path, gpt2)
    assert "\n" not in str(e.value)


def test_a_file_to_train_on_without_its_label_column_is_refused(tmp_path, gpt2):
    """A misnamed label column (sentence<TAB>sentiment) read as unlabelled trained a head of no
    classes and failed at the first step (KeyError: 'label'); a file to train or validate on is
    refused at its header instead."""
    path = tmp_path / "train.tsv"
    path.write_text("sentence\tsentiment\ngood\t1\nbad\t0\n", encoding="utf-8")
    # for prediction: unlabelled, as GLUE's test files
    assert not ClassificationDataset(path, gpt2).has_labels
    with pytest.raises(UserError) as e:
        ClassificationDataset(path, gpt2, require_labels=True)
    assert str(e.value) == (
        f"{path}: no label column 'label' among its columns ['sentence', 'sentiment']: a file to "
        "train or validate on needs one: rename the column that holds the classes to 'label', "
        "or name it (data.label_key=COLUMN in a run)"
    )


@pytest.mark.parametrize("bad", ["train", "valid"])
def test_finetune_refuses_an_unlabelled_file_before_writing_the_run_folder(
    sst2, shared_data, tmp_path, bad
):
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    unlabelled = tmp_path / "unlabelled.tsv"
    rows = (sst2 / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:50]
    unlabelled.write_text("\n".join(["sentence\tsentiment", *rows]) + "\n", encoding="utf-8")
    files = {"train": sst2 / "dev.tsv", "valid": sst2 / "dev.tsv", bad: unlabelled}
    run = tmp_path / "run"
    cfg = load_run_config(
        None,
        [
            "model.preset=tiny-gpt2",
            "model.vocab_size=50257",
            "data.task=classification",
            f"data.tokenizer={shared_data / 'tokenizers' / 'gpt2'}",
            "data.seq_length=64",
            f"data.train_file={files['train']}",
            f"data.valid_file={files['valid']}",
            "trainer.max_steps=2",
            "trainer.global_batch_size=4",
            "trainer.micro_batch_size=4",
            "trainer.precision=fp32",
            "trainer.progress_bar=false",
            f"run_dir={run}",
        ],
    )
    with pytest.raises(
        UserError, match="^" + re.escape(f"{unlabelled}: no label column 'label' among its columns")
    ):
        Trainer(cfg)
    assert not run.exists() or not any(run.iterdir())
    # named, the same file trains: data.label_key (and data.text_key) as the run's keys
    if bad == "train":
        named = dataclasses.replace(
            cfg,
            data=dataclasses.replace(
                cfg.data, label_key="sentiment", text_key="sentence", valid_file=str(unlabelled)
            ),
        )
        trainer = Trainer(named)
        assert trainer.data.num_labels == 2
        trainer.close()


def _labels_file(path: Path, labels: list[str]) -> Path:
    path.write_text(
        "sentence\tlabel\n" + "".join(f"row {i}\t{y}\n" for i, y in enumerate(labels)),
        encoding="utf-8",
    )
    return path


def test_one_mistyped_label_among_integers_is_warned_of_with_its_line(tmp_path, caplog):
    labels = ["0", "1"] * 150
    labels[41] = "positive"  # line 43 of the file (a header, then row 0 on line 2)
    with caplog.at_level("WARNING", logger="lmforge.data.classification"):
        ds = ClassificationDataset(_labels_file(tmp_path / "t.tsv", labels), ByteTokenizer())
    assert ds.label_names == ["0", "1", "positive"]  # trained as given: a warning, not a refusal
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        f"{tmp_path / 't.tsv'}:43: label 'positive' (1 row) is not an integer, unlike the labels "
        "['0', '1'] of most rows: it makes a class of its own (3 classes); fix it if it is a typo"
    ]


def test_an_integer_among_class_names_and_a_class_of_almost_no_rows_are_warned_of(tmp_path, caplog):
    labels = ["neg", "pos"] * 300
    labels[10], labels[500] = "1", "nuetral"
    with caplog.at_level("WARNING", logger="lmforge.data.classification"):
        ClassificationDataset(_labels_file(tmp_path / "t.tsv", labels), ByteTokenizer())
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2
    assert warned[0].startswith(
        f"{tmp_path / 't.tsv'}:12: label '1' (1 row) is an integer, unlike the labels "
        "['neg', 'nuetral', 'pos'] of most rows"
    )
    assert warned[1] == (
        f"{tmp_path / 't.tsv'}:502: label 'nuetral' labels only 1 of 600 rows: a class of its own, "
        "learnt from almost nothing; fix it if it is a typo"
    )


def test_a_class_id_that_leaves_classes_without_rows_is_warned_of(tmp_path, caplog):
    """Integer labels are class ids, 0 to the largest: a 7 among 0/1 labels makes 8 classes, 6 of
    them empty (one warning, though its row is also a rare class's)."""
    labels = ["0", "1"] * 300
    labels[100] = "7"
    with caplog.at_level("WARNING", logger="lmforge.data.classification"):
        assert (
            ClassificationDataset(
                _labels_file(tmp_path / "t.tsv", labels), ByteTokenizer()
            ).num_labels
            == 8
        )
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"{tmp_path / 't.tsv'}:102: label '7' makes 8 classes, of which [2, 3, 4, 5, 6] have no rows: fix it if it "
        "is a typo"
    ]


@pytest.mark.parametrize(
    "labels",
    [["0", "1"] * 150 + ["2"] * 5, ["0", "1", "2", "1"], ["a", "b", "c"]],
    ids=["five-rows", "small-file", "names"],
)
def test_ordinary_labels_are_not_warned_of(tmp_path, caplog, labels):
    """A class of 5 rows or more, or of 1% of the rows (a small file's), is a class, not a typo."""
    with caplog.at_level("WARNING", logger="lmforge.data.classification"):
        ClassificationDataset(_labels_file(tmp_path / "t.tsv", labels), ByteTokenizer())
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_the_validation_set_draws_no_label_warnings(tmp_path, caplog):
    """A validation file's labels are checked against the training classes (an unknown one is an
    error)."""
    with caplog.at_level("WARNING", logger="lmforge.data.classification"):
        ClassificationDataset(
            _labels_file(tmp_path / "v.tsv", ["0"] * 300 + ["1"]),
            ByteTokenizer(),
            label_names=["0", "1"],
        )
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
