"""BERT masking checked by its statistics over many samples, its exact per-sample count and its
determinism."""

import pickle

import numpy as np
import pytest
import torch

from lmforge.data.collate import IGNORE_INDEX
from lmforge.data.indexed import IndexedDataset, IndexedDatasetWriter
from lmforge.data.mlm import MLMDataset
from lmforge.errors import UserError

PAD, CLS, SEP, MASK, EOD = 0, 1, 2, 3, 4
VOCAB, SEQ = 1000, 128


@pytest.fixture(scope="module")
def docs() -> list[np.ndarray]:
    """Documents of 1..400 ordinary tokens, each ending in an eod (special), and one empty
    document."""
    rng = np.random.default_rng(42)
    out = [
        np.append(rng.integers(5, VOCAB, size=int(n)), EOD) for n in rng.integers(1, 400, size=200)
    ]
    out.insert(7, np.zeros(0, np.int64))
    return out


@pytest.fixture(scope="module")
def prefix(tmp_path_factory, docs) -> str:
    prefix = str(tmp_path_factory.mktemp("mlm") / "corpus")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for d in docs:
            w.add_document(d)
    return prefix


def make(prefix, **kw) -> MLMDataset:
    args = dict(
        seq_length=SEQ,
        vocab_size=VOCAB,
        cls_id=CLS,
        sep_id=SEP,
        mask_id=MASK,
        pad_id=PAD,
        special_ids=[EOD],
    )
    return MLMDataset(prefix, **{**args, **kw})


@pytest.fixture(scope="module")
def samples(prefix) -> tuple[MLMDataset, list[dict]]:
    ds = make(prefix)
    return ds, [ds[i] for i in range(len(ds))]


def test_samples_cover_the_stream_once_with_cls_sep(docs, samples):
    ds, items = samples
    stream = np.concatenate(docs)
    assert len(ds) == -(-len(stream) // (SEQ - 2))
    rebuilt = []
    for item in items:
        ids, labels, mask = item["input_ids"], item["labels"], item["attention_mask"]
        assert ids.shape == labels.shape == mask.shape == (SEQ,) and ids.dtype == torch.int64
        n = int(mask.sum())
        assert mask.tolist() == [1] * n + [0] * (SEQ - n)
        assert ids[0] == CLS and ids[n - 1] == SEP and (ids[n:] == PAD).all()
        original = torch.where(labels != IGNORE_INDEX, labels, ids)
        rebuilt.append(original[1 : n - 1].numpy())
    assert all(len(r) == SEQ - 2 for r in rebuilt[:-1])  # only the last sample is padded
    assert np.array_equal(np.concatenate(rebuilt), stream)


def test_masking_rates_are_bert_s(samples):
    ds, items = samples
    chosen = masked = kept = randomized = candidates = 0
    for item in items:
        ids, labels, n = item["input_ids"], item["labels"], int(item["attention_mask"].sum())
        original = torch.where(labels != IGNORE_INDEX, labels, ids)[:n]
        is_candidate = ~torch.isin(original, torch.tensor([PAD, CLS, SEP, MASK, EOD]))
        sel = labels[:n] != IGNORE_INDEX
        assert not (sel & ~is_candidate).any()  # specials are never chosen...
        assert torch.equal(ids[:n][~sel], original[~sel])  # ...and nothing unchosen changes
        c = int(is_candidate.sum())
        assert int(sel.sum()) == max(1, round(0.15 * c))  # exactly 15% (rounded) per sample
        candidates += c
        chosen += int(sel.sum())
        masked += int((ids[:n][sel] == MASK).sum())
        kept += int((ids[:n][sel] == labels[:n][sel]).sum())
        rand = sel & (ids[:n] != MASK) & (ids[:n] != labels[:n])
        randomized += int(rand.sum())
        assert not torch.isin(ids[:n][rand], torch.tensor([PAD, CLS, SEP, MASK, EOD])).any()
    assert chosen > 5000
    assert abs(chosen / candidates - 0.15) < 0.002
    # Binomial standard deviations here are ~0.005 (80%) and ~0.004 (10%): 5-sigma bounds.
    assert abs(masked / chosen - 0.8) < 0.025
    # a random draw equal to the original counts here (p = 1/995)
    assert abs(kept / chosen - 0.1) < 0.02
    assert abs(randomized / chosen - 0.1) < 0.02


def test_same_seed_same_samples_in_any_order_and_process(prefix, samples):
    ds, items = samples
    again = make(prefix)
    for i in reversed(range(len(ds))):
        assert all(torch.equal(again[i][k], items[i][k]) for k in items[i])
    clone = pickle.loads(pickle.dumps(again))  # what a DataLoader worker receives
    assert all(torch.equal(clone[3][k], items[3][k]) for k in items[3])
    other = make(prefix, seed=7)
    assert not torch.equal(other[0]["labels"], items[0]["labels"])
    assert torch.equal(
        torch.where(other[0]["labels"] != IGNORE_INDEX, other[0]["labels"], other[0]["input_ids"]),
        torch.where(items[0]["labels"] != IGNORE_INDEX, items[0]["labels"], items[0]["input_ids"]),
    )


def test_later_epochs_mask_the_same_text_afresh(prefix, samples):
    ds, items = samples
    two = make(prefix, num_epochs=2)
    assert len(two) == 2 * len(ds)
    a, b = two[len(ds) + 1], items[1]
    assert not torch.equal(a["labels"], b["labels"])
    restore = lambda x: torch.where(x["labels"] != IGNORE_INDEX, x["labels"], x["input_ids"])  # noqa: E731
    assert torch.equal(restore(a), restore(b))


def test_collate_stacks_fixed_length_samples(samples):
    ds, items = samples
    batch = ds.collate(items[:4])
    assert batch["input_ids"].shape == (4, SEQ)
    assert torch.equal(batch["labels"][2], items[2]["labels"])


def test_bad_settings_are_user_errors(prefix, tmp_path):
    with pytest.raises(UserError, match="special ids"):
        make(prefix, mask_id=VOCAB)
    with pytest.raises(UserError, match="seq_length must be at least 3"):
        make(prefix, seq_length=2)
    with pytest.raises(UserError, match="not found"):
        make(str(tmp_path / "missing"))
    empty = str(tmp_path / "empty")
    with IndexedDatasetWriter(empty, np.uint16) as w:
        w.add_document([])
    with pytest.raises(UserError, match="holds no tokens"):
        make(IndexedDataset(empty))
