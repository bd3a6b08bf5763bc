"""Pretraining validated on held-out prefixes (data.valid_paths, Megatron's --valid-data-path):
the validation loss is the model's loss on those documents, a blend of them is drawn by its
weights, and their sample indices are cached beside the training ones without sharing a file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lmforge.data.indexed import IndexedDatasetWriter
from lmforge.parallel.data_parallel import unwrap
from lmforge.train.trainer import Trainer
from tests.train.conftest import run_config

SEQ, SAMPLES = 32, 8  # conftest's run: data.seq_length=32, one validation batch of 8 sequences


def _held_out(folder, name, tokens) -> str:
    prefix = folder / name
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        writer.add_document(np.asarray(tokens) % 1000)
    return str(prefix)


def _by_hand(model, tokens: np.ndarray) -> float:
    """Mean next-token loss of `model` over the held-out document cut into SAMPLES windows of SEQ
    + 1 tokens, each sharing its last token with the next (Megatron's samples of one document, in
    any order)."""
    ids = torch.from_numpy(tokens.astype(np.int64))
    total = 0.0
    with torch.no_grad():
        for i in range(SAMPLES):
            window = ids[i * SEQ : (i + 1) * SEQ + 1]
            logits = model(input_ids=window[None, :-1]).float()
            total += float(F.cross_entropy(logits[0], window[1:], reduction="sum"))
    return total / (SAMPLES * SEQ)


@pytest.mark.slow
def test_the_validation_loss_is_the_loss_on_the_held_out_documents(tiny_corpus, tmp_path):
    # One document of exactly SAMPLES * SEQ + 1 tokens: one validation is one pass over it.
    tokens = (7 + 3 * np.arange(SAMPLES * SEQ + 1)) % 1000
    held = _held_out(tmp_path, "held_text_document", tokens)
    run = tmp_path / "run"
    trainer = Trainer(run_config(tiny_corpus, run, f"data.valid_paths=[{held}]"))
    assert len(trainer.data.train.documents) == 300  # data.paths trains whole: no split cut from it
    trainer.fit()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    model = unwrap(trainer.model).eval()
    expected = _by_hand(model, tokens)
    assert rows[-1]["val_loss"] == pytest.approx(expected, rel=1e-5)
    # The corpus's own validation part scores otherwise: the check tells the two apart.
    ours = np.concatenate([trainer.data.train.indexed.document(d) for d in range(290, 300)])[
        : SAMPLES * SEQ + 1
    ]
    assert abs(_by_hand(model, ours) - expected) > 1e-2


def test_a_held_out_blend_is_drawn_by_its_weights_from_whole_prefixes(tiny_corpus, tmp_path):
    even = _held_out(tmp_path, "even_text_document", 2 * np.arange(600))
    odd = _held_out(tmp_path, "odd_text_document", 1 + 2 * np.arange(600))
    cfg = run_config(
        tiny_corpus,
        tmp_path / "run",
        f"data.valid_paths=[0.7,{even},0.3,{odd}]",
        "trainer.val_batches=10",
    )
    from lmforge.train.data import pretrain_datasets

    train, valid = pretrain_datasets(cfg)
    n = 10 * 8
    picked = np.bincount(valid.dataset_index[:n], minlength=2)
    assert picked.tolist() == [56, 24]  # 70% and 30% of 80 validation sequences
    for i in range(n):
        item = valid[i]
        # even ids from the first, odd from the other
        assert set((item["tokens"] % 2).tolist()) == {item["dataset_id"]}
    # every sequence of each, nothing split off
    assert [len(part.documents) for part in valid.datasets] == [1, 1]


def test_held_out_sample_indices_are_cached_apart_from_the_training_ones(tiny_corpus, tmp_path):
    """Beside the data (the default data.cache_dir), in one folder with the training corpus,
    validating on the training corpus itself too: each dataset its own files, and a second build
    reads them back."""
    import shutil

    from lmforge.data.indexed import bin_path, idx_path
    from lmforge.train.data import pretrain_datasets

    folder = tmp_path / "data"
    folder.mkdir()
    for path in (bin_path(tiny_corpus), idx_path(tiny_corpus)):
        shutil.copy(path, folder)
    corpus = folder / tiny_corpus.name
    held = _held_out(folder, "held_text_document", np.arange(2000))
    builds = []
    for valid_paths in ([held], [0.5, held, 0.5, str(corpus)]):
        for _ in range(2):
            cfg = run_config(
                corpus, tmp_path / "run", f"data.valid_paths={json.dumps(valid_paths)}"
            )
            builds.append(pretrain_datasets(cfg))
    (train, valid), (train_again, valid_again) = builds[:2]
    parts = [train, *builds[2][1].datasets]
    files = [set(ds.cache_paths.values()) | {ds.description_path} for ds in parts]
    assert all(f.parent == folder / "cache" for f in set.union(*files))
    assert not files[0] & files[1] and not files[0] & files[2] and not files[1] & files[2]
    assert train_again.loaded_from_cache and valid_again.loaded_from_cache
    assert builds[3][1].datasets[1].loaded_from_cache
    for i in (0, 5):
        assert torch.equal(valid[i]["tokens"], valid_again[i]["tokens"])
        assert torch.equal(train[i]["tokens"], train_again[i]["tokens"])
