"""The tokenizer a prefix was made with, recorded beside its .bin/.idx by preprocess (and by the
merge of its shards), and checked by every run that trains on it: another tokenizer's data is
refused in one line; data without a record passes where its document ends show the run's
tokenizer, and is named in one warning where nothing does."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from lmforge.cli import main
from lmforge.data.indexed import IndexedDataset, IndexedDatasetWriter, bin_path, idx_path
from lmforge.data.preprocess import merge_shards, preprocess
from lmforge.errors import UserError
from lmforge.tokenizers import load_tokenizer


def fingerprint_path(prefix) -> Path:
    return Path(f"{prefix}.tokenizer.json")


def check_data_tokenizer(indexed, tokenizer) -> None:
    from lmforge.train.data import check_data_tokenizer

    check_data_tokenizer(indexed, tokenizer)


TEXTS = [
    f"Document {i} says that {i} plus {i} is {2 * i}, which it checks twice." for i in range(40)
]


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


@pytest.fixture(scope="module")
def tokenizers_dir(shared_data) -> Path:
    return shared_data / "tokenizers"


def test_preprocess_records_the_tokenizer_beside_the_pair(corpus, tokenizers_dir, tmp_path):
    gpt2 = tokenizers_dir / "gpt2" / "tokenizer.json"
    preprocess(corpus, tmp_path / "out", gpt2, append_eod=True, progress=False)
    prefix = tmp_path / "out_text_document"
    record = json.loads(fingerprint_path(prefix).read_text())
    reference = tokenizers.Tokenizer.from_file(str(gpt2))  # Hugging Face's own reading of the file
    assert record["vocab_size"] == reference.get_vocab_size() == 50257
    assert record["eod_id"] == reference.token_to_id("<|endoftext|>") == 50256
    assert (
        record["tokenizer"] == str(gpt2)
        and len(record["sha256"]) == len(record["vocab_sha256"]) == 64
    )
    assert (record["bin_bytes"], record["idx_bytes"]) == (
        bin_path(prefix).stat().st_size,
        idx_path(prefix).stat().st_size,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "docs.jsonl",
        "out_text_document.bin",
        "out_text_document.idx",
        "out_text_document.tokenizer.json",
    ]


def test_shards_merged_record_what_one_run_records(corpus, tokenizers_dir, tmp_path):
    gpt2 = tokenizers_dir / "gpt2" / "tokenizer.json"
    preprocess(corpus, tmp_path / "whole", gpt2, append_eod=True, progress=False)
    for i in range(3):
        preprocess(corpus, tmp_path / "sh", gpt2, append_eod=True, progress=False, shard=(i, 3))
    merge_shards(corpus, tmp_path / "sh", gpt2, append_eod=True)
    assert (
        fingerprint_path(tmp_path / "sh_text_document").read_text()
        == fingerprint_path(tmp_path / "whole_text_document").read_text()
    )


def test_data_of_another_tokenizer_is_refused_naming_both(corpus, tokenizers_dir, tmp_path):
    """Llama 2 data (32,000 ids) read by GPT-2's tokenizer: every id is in range and no document
    ends in a marker (no --append-eod), so only the record tells."""
    llama = tokenizers_dir / "llama2" / "tokenizer.model"
    preprocess(corpus, tmp_path / "llama", llama, progress=False)
    prefix = tmp_path / "llama_text_document"
    gpt2 = load_tokenizer(tokenizers_dir / "gpt2" / "tokenizer.json")
    with pytest.raises(UserError) as e:
        check_data_tokenizer([IndexedDataset(prefix)], gpt2)
    assert str(e.value) == (
        f"data prefix '{prefix}' was tokenized with {llama} (32000 ids, end of document 2), but this run's tokenizer "
        f"is {gpt2.files[0]} (50257 ids, end of document 50256): preprocess the data again with the run's tokenizer "
        f"(lmforge preprocess --tokenizer {gpt2.files[0]}), or set data.tokenizer={llama}"
    )
    check_data_tokenizer([IndexedDataset(prefix)], load_tokenizer(llama))  # its own: no word


def test_pretrain_refuses_it_in_one_line(corpus, tokenizers_dir, tmp_path, capsys):
    llama = tokenizers_dir / "llama2" / "tokenizer.model"
    preprocess(corpus, tmp_path / "llama", llama, progress=False)
    code = main(
        [
            "pretrain",
            "/dev/null",
            "model.preset=tiny-neox",
            "model.vocab_size=50304",
            f"data.paths=[{tmp_path / 'llama_text_document'}]",
            f"data.tokenizer={tokenizers_dir / 'gpt2'}",
            "data.seq_length=32",
            f"run_dir={tmp_path / 'run'}",
            "trainer.device=cpu",
            "trainer.max_steps=1",  # (were the data taken, one short step)
            "trainer.global_batch_size=1",
            "trainer.val_check_interval=0",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert "was tokenized with" in err[0] and str(llama) in err[0] and "gpt2" in err[0]


def test_the_same_tokenizer_in_another_file_is_the_same(corpus, tokenizers_dir, tmp_path):
    """GPT-2's tokenizer.json and its vocab.json + merges.txt: other bytes, the same ids."""
    preprocess(corpus, tmp_path / "out", tokenizers_dir / "gpt2" / "tokenizer.json", progress=False)
    pair = load_tokenizer(tokenizers_dir / "gpt2" / "vocab.json")
    assert [f.name for f in pair.files] == ["vocab.json", "merges.txt"]
    check_data_tokenizer([IndexedDataset(tmp_path / "out_text_document")], pair)


def _unrecorded(tmp_path, name, documents) -> IndexedDataset:
    prefix = tmp_path / name
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for doc in documents:
            writer.add_document(doc)
    return IndexedDataset(prefix)


def test_data_without_a_record_is_checked_by_its_document_ends_else_named_once(
    tokenizers_dir, tmp_path, caplog
):
    gpt2 = load_tokenizer(tokenizers_dir / "gpt2" / "tokenizer.json")
    ended = _unrecorded(
        tmp_path, "ended_text_document", [gpt2.encode(t) + [gpt2.eod_id] for t in TEXTS]
    )
    # Documents ending in their own last words (no --append-eod): a period inside, a number at the
    # end.
    texts = [f"Document {i}. It says that {i} plus {i} is {2 * i}" for i in range(40)]
    plain = [
        _unrecorded(tmp_path, f"plain{i}_text_document", [gpt2.encode(t) for t in texts])
        for i in range(2)
    ]
    with caplog.at_level(logging.WARNING, logger="lmforge.train.data"):
        # Megatron's own files, made with --append-eod by this tokenizer
        check_data_tokenizer([ended], gpt2)
        assert not caplog.records
        check_data_tokenizer([ended, *plain, plain[0]], gpt2)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(
        f"nothing shows that data prefix '{plain[0].prefix}', '{plain[1].prefix}' were made with "
        f"this run's tokenizer {gpt2.files[0]}: no PREFIX.tokenizer.json"
    )


def test_a_record_of_files_made_again_is_not_read(corpus, tokenizers_dir, tmp_path, caplog):
    """The prefix written again by another tool (Megatron's, which writes no record): the old
    record describes other files and is set aside, not held against them."""
    llama = tokenizers_dir / "llama2" / "tokenizer.model"
    preprocess(corpus, tmp_path / "out", llama, progress=False)
    gpt2 = load_tokenizer(tokenizers_dir / "gpt2" / "tokenizer.json")
    again = _unrecorded(
        tmp_path, "out_text_document", [gpt2.encode(t) + [gpt2.eod_id] for t in TEXTS]
    )
    assert fingerprint_path(again.prefix).is_file()
    with caplog.at_level(logging.WARNING, logger="lmforge.train.data"):
        check_data_tokenizer([again], gpt2)
    assert not caplog.records


def test_a_record_too_large_to_be_one_is_not_read(tmp_path, caplog):
    """A data folder is not trusted: a 2 MiB 'record' is not read whole for its few fields."""
    from lmforge.data.fingerprint import read_fingerprint

    ds = _unrecorded(tmp_path, "big_text_document", [[1, 2, 3]])
    fingerprint_path(ds.prefix).write_text(" " * (2 << 20) + "{}")
    with caplog.at_level(logging.WARNING, logger="lmforge.data.fingerprint"):
        assert read_fingerprint(ds.prefix) is None
    assert "over 1,048,576" in caplog.text and "the data's tokenizer is not checked" in caplog.text


def test_inspect_names_the_tokenizer_and_a_wrong_one(corpus, tokenizers_dir, tmp_path, capsys):
    llama = tokenizers_dir / "llama2" / "tokenizer.model"
    preprocess(corpus, tmp_path / "llama", llama, progress=False)
    prefix = tmp_path / "llama_text_document"
    assert main(["data", "inspect", str(prefix)]) == 0
    assert (
        f"tokenized with {llama} (32000 ids, end of document 2) (its .tokenizer.json)"
        in capsys.readouterr().out
    )
    assert main(["data", "inspect", str(prefix), "--tokenizer", str(tokenizers_dir / "gpt2")]) == 0
    assert f"warning: data prefix '{prefix}' was tokenized with {llama}" in capsys.readouterr().out
