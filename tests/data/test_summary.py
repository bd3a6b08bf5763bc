"""`lmforge data inspect`: counts and lengths read from the index agree with the dataset's own
arrays, in one block or many; the first documents decode back to their text."""

import numpy as np
import pytest

import lmforge.data.summary as summary
from lmforge.cli import main
from lmforge.data import IndexedDataset, IndexedDatasetWriter
from lmforge.data.summary import summarize, summarize_all
from lmforge.errors import UserError
from lmforge.tokenizers import load_tokenizer
from tests.data.test_preprocess import gpt2  # noqa: F401  (fixture)


@pytest.fixture
def dataset(tmp_path):
    """Documents of 0..40 tokens, some empty, one split into two sequences."""
    rng = np.random.default_rng(0)
    prefix = tmp_path / "d_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for n in [5, 0, 1, 2, 3, 0, 40, 17, 8, 9, 33]:
            w.add_document(rng.integers(0, 50000, n), None)
        w.add_document(np.arange(10), [4, 6])
    return prefix


@pytest.mark.parametrize("block", [summary.BLOCK, 3])
def test_counts_and_histogram_agree_with_the_index(dataset, monkeypatch, block):
    monkeypatch.setattr(summary, "BLOCK", block)
    s = summarize(dataset, num_docs=2)
    ds = IndexedDataset(dataset)
    lengths = [len(ds.document(d)) for d in range(ds.num_documents)]
    assert (s.documents, s.sequences, s.tokens, s.dtype) == (12, 11, sum(lengths), "uint16")
    assert (s.empty_documents, s.min_tokens, s.max_tokens) == (2, 0, 40)
    assert s.mean_tokens == pytest.approx(sum(lengths) / 12)
    assert [(b.low, b.high) for b in s.histogram] == [
        (1, 1),
        (2, 3),
        (4, 7),
        (8, 15),
        (16, 31),
        (32, 63),
    ]
    assert [b.documents for b in s.histogram] == [1, 2, 1, 3, 1, 2]  # 8, 9 and the split 10 in 8-15
    assert s.first_documents == [ds.document(0).tolist(), []] and s.decoded is None


def test_first_documents_decode_and_the_cli_prints_them(tmp_path, gpt2, capsys):  # noqa: F811
    tok = load_tokenizer(gpt2)
    texts = ["Hello world.", "A second document, a little longer than the first one."]
    with IndexedDatasetWriter(tmp_path / "w_text_document", np.uint16) as w:
        for text in texts:
            w.add_document(tok.encode(text) + [tok.eod_id])
    # the --output-prefix of preprocess finds its key's dataset
    (s,) = summarize_all(tmp_path / "w", gpt2)
    assert s.decoded == [t + "<|endoftext|>" for t in texts]
    assert (
        main(
            [
                "data",
                "inspect",
                str(tmp_path / "w_text_document"),
                "--tokenizer",
                str(gpt2),
                "--chars",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "w_text_document: 2 documents (0 empty), 2 sequences, 17 tokens, uint16" in out
    assert "[1] 13 tokens: 'A second ...'" in out
    with pytest.raises(
        UserError, match=r"no dataset \S*nothing\.bin/\.idx \(nor \S*nothing_<key>_document"
    ):
        summarize_all(tmp_path / "nothing")


def test_inspect_says_when_the_data_looks_made_by_another_tokenizer(shared_data, tmp_path, capsys):
    """Pretraining warns when documents end in a marker that is not its tokenizer's end of
    document; inspect, with that same tokenizer, decoded the documents as garbage without a word."""
    gpt2_tok = load_tokenizer(shared_data / "tokenizers" / "gpt2")
    prefix = tmp_path / "g_text_document"
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(20):
            w.add_document(gpt2_tok.encode(f"Line {i}. It says {i * 3}.") + [gpt2_tok.eod_id], None)
    assert summarize(prefix, gpt2_tok).mismatch is None
    neox = shared_data / "tokenizers" / "gpt-neox-20b"
    assert "end in token 50256" in summarize(prefix, neox).mismatch
    assert main(["data", "inspect", str(prefix), "--tokenizer", str(neox)]) == 0
    assert "warning: data prefix" in capsys.readouterr().out
