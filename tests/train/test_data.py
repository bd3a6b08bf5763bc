"""A run's pretraining data: token ids checked against the model's vocabulary before anything
runs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from lmforge.data.indexed import IndexedDataset, IndexedDatasetWriter
from lmforge.errors import UserError
from lmforge.train import data
from lmforge.train.data import check_token_ids, token_id_range


def _prefix(tmp_path, documents, dtype=np.int32, name="ids_text_document"):
    prefix = tmp_path / name
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    return IndexedDataset(prefix)


def test_the_token_range_is_scanned_in_chunks_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "CHUNK_TOKENS", 3)  # several chunks, the largest id in a later one
    ds = _prefix(tmp_path, [[5, 1, 7], [2, 9, 4, 4], [3, 8]])
    assert token_id_range(ds, tmp_path / "cache") == (1, 9)
    cached = json.loads((tmp_path / "cache" / "ids_text_document-token-range.json").read_text())
    assert cached["max"] == 9 and cached["min"] == 1
    # The cache answers while the .bin is the same file ...
    monkeypatch.setattr(np, "memmap", None)
    assert token_id_range(ds, tmp_path / "cache") == (1, 9)
    monkeypatch.undo()
    # ... and a rewritten .bin (another size or time) is scanned again.
    ds = _prefix(tmp_path, [[5, 1, 7], [2, 12]])
    os.utime(tmp_path / "ids_text_document.bin", ns=(1, 1))
    assert token_id_range(ds, tmp_path / "cache") == (1, 12)


def test_an_id_past_the_vocabulary_is_one_line_naming_prefix_id_and_vocabulary(tmp_path):
    """Issue 18 item 6: such an id failed with an IndexError in the first step's embedding
    lookup."""
    ds = _prefix(tmp_path, [[1, 2, 3], [4, 1000]])
    check_token_ids([ds], 1001, tmp_path / "cache")
    with pytest.raises(UserError) as e:
        check_token_ids([ds], 1000, tmp_path / "cache")
    assert str(e.value).startswith(
        f"data prefix '{ds.prefix}' has token id 1000 but the model's vocab_size is 1000"
    )
    assert str(e.value).endswith(
        "or use a model whose vocabulary holds it (model.vocab_size > 1000)"
    )
    # with model.init_from the vocabulary is the source's: only one way out
    with pytest.raises(UserError) as e:
        check_token_ids([ds], 1000, tmp_path / "cache", fixed_vocab=True)
    assert str(e.value).endswith("preprocess the data with the model's tokenizer")
    negative = _prefix(tmp_path, [[3, -2]], name="neg_text_document")
    with pytest.raises(UserError, match="has a negative token id"):
        check_token_ids([negative], 1000, tmp_path / "cache")


def test_a_dtype_that_cannot_hold_a_bad_id_is_not_scanned(tmp_path, monkeypatch):
    ds = _prefix(tmp_path, [[1, 65535]], dtype=np.uint16)
    monkeypatch.setattr(data, "token_id_range", None)
    check_token_ids([ds], 65536, tmp_path / "cache")  # any uint16 id fits: nothing read
    assert not (tmp_path / "cache").exists()


def test_masked_lm_data_is_checked_against_the_vocabulary_too(tiny_corpus, tmp_path):
    from lmforge.data.tokenizer_train import train_tokenizer
    from lmforge.train.trainer import Trainer
    from tests.train.conftest import run_config

    text = tmp_path / "text.txt"
    text.write_text("a few words to learn a small vocabulary from\n" * 50)
    train_tokenizer(
        [text], 300, tmp_path / "tok", special_tokens=("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]")
    )
    cfg = run_config(
        tiny_corpus,
        tmp_path / "run",
        "model.preset=tiny-bert",
        "model.vocab_size=500",
        "data.task=mlm",
        f"data.tokenizer={tmp_path / 'tok'}",
        "trainer.val_check_interval=0",
    )
    with pytest.raises(UserError) as e:
        Trainer(cfg)
    assert str(e.value).startswith(
        f"data prefix '{tiny_corpus}' has token id 999 but the model's vocab_size is 500"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_loader_workers_give_the_batches_one_process_gives_from_any_sample(tiny_corpus, tmp_path):
    """data.num_workers (2 by default on an accelerator): the same micro-batches, in the same
    order, as reading in the training process, from the start and from a resumed position (every
    sample depends on its index only)."""
    import torch

    from lmforge.train.config import load_run_config

    cfg = load_run_config(
        None,
        [
            "model.preset=tiny-neox",
            f"data.paths=[{tiny_corpus}]",
            "data.seq_length=32",
            "trainer.max_steps=6",
            f"run_dir={tmp_path}",
        ],
    )
    train, _ = data.pretrain_datasets(cfg)
    for consumed in (0, 20):
        read = {w: list(data.micro_batches(train, consumed, 48, 2, 1, 2, w)) for w in (0, 2)}
        assert len(read[0]) == len(read[2]) == (48 - consumed) // 4
        for a, b in zip(read[0], read[2], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_loader_workers_default_to_two_on_an_accelerator_only():
    import torch

    assert data.loader_workers(None, torch.device("cpu")) == 0
    assert data.loader_workers(None, torch.device("cuda", 0)) == 2
    assert data.loader_workers(3, torch.device("cpu")) == 3


def test_data_made_by_another_tokenizer_is_named_from_its_document_ends(
    shared_data, tmp_path, caplog
):
    """GPT-2 data (each document ending in 50256) read with Pythia's tokenizer (end of document
    0): every id is in range, so only the document ends tell. One warning names the prefix, the
    token and what to do; the right tokenizer, or data made without end-of-document tokens, says
    nothing."""
    import logging

    from lmforge.tokenizers import load_tokenizer
    from lmforge.train.data import check_document_ends

    gpt2, neox = (
        load_tokenizer(shared_data / "tokenizers" / name) for name in ("gpt2", "gpt-neox-20b")
    )
    # Each ends in a period, as most articles do: with no marker after it, that is no sign of
    # another tokenizer.
    texts = [f"Document {i} is short. It names the number {i * 7}." for i in range(40)]
    marked = _prefix(
        tmp_path, [gpt2.encode(t) + [gpt2.eod_id] for t in texts], name="marked_text_document"
    )
    plain = _prefix(tmp_path, [gpt2.encode(t) for t in texts], name="plain_text_document")
    with caplog.at_level(logging.WARNING, logger="lmforge.train.data"):
        check_document_ends([marked, plain], gpt2)
        check_document_ends([plain], neox)
        assert not caplog.records
        check_document_ends([marked], neox)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(
        f"data prefix '{marked.prefix}': 40 of 40 documents sampled end in token 50256 "
    )
    assert (
        "but this tokenizer's end of document is 0: was it preprocessed with another tokenizer?"
        in line
    )


def test_a_prefix_that_is_not_one_suggests_the_one_meant(tmp_path):
    """data.paths=[data/corpus] (preprocess's --output-prefix) or [.../corpus_text_document.bin]:
    name the prefix."""
    _prefix(tmp_path, [[1, 2, 3]], name="corpus_text_document")
    for given in (tmp_path / "corpus", tmp_path / "corpus_text_document.bin"):
        with pytest.raises(
            UserError, match=f"has no .*: give '{tmp_path / 'corpus_text_document'}'$"
        ):
            data.open_prefixes([str(given)])
    with pytest.raises(UserError, match="run `lmforge preprocess` or fix data.paths$"):
        data.open_prefixes([str(tmp_path / "other")])


def test_ids_past_the_tokenizer_and_rows_past_it_are_said(tmp_path, caplog):
    """NeoX data read with a 32,000-id tokenizer trained (with a warning) and exported the wrong
    tokenizer; a preset's 50,304 rows over a 4,096-token tokenizer trained 46k rows never used,
    without a word."""
    import dataclasses
    import logging
    from pathlib import Path
    from types import SimpleNamespace

    from lmforge.models.presets import preset
    from lmforge.train.setup import check_tokenizer

    ds = _prefix(tmp_path, [[1, 2, 3], [4, 700]])
    small = SimpleNamespace(vocab_size=500, files=[Path("tok/tokenizer.json")])
    with pytest.raises(
        UserError,
        match=r"has token id 700 but the tokenizer tok/tokenizer.json has 500 ids: the data "
        r"was made with another tokenizer",
    ):
        data.check_tokenizer_holds([ds], small, tmp_path / "cache")
    data.check_tokenizer_holds(
        [ds], SimpleNamespace(vocab_size=701, files=small.files), tmp_path / "cache"
    )
    mcfg = dataclasses.replace(preset("tiny-neox"), vocab_size=1000)  # 1,024 rows
    with caplog.at_level(logging.WARNING, logger="lmforge.train.setup"):
        check_tokenizer(
            SimpleNamespace(vocab_size=1000, files=small.files), mcfg, from_scratch=True
        )
        check_tokenizer(small, mcfg, from_scratch=False)  # a source's vocabulary is the source's
        assert not caplog.records
        check_tokenizer(small, mcfg, from_scratch=True)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(
        "the model has 1024 vocabulary rows for a tokenizer of 500 ids: 512 rows are never used; "
        "set model.vocab_size=500"
    )
