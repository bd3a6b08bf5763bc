"""A byte-level BPE trained on tinyshakespeare: loads back, round-trips text, honours the
vocabulary size."""

import argparse
import json
from pathlib import Path

import pytest

from lmforge.cli.tokenizer import add_train_arguments, run
from lmforge.data import tokenizer_train
from lmforge.data.tokenizer_train import iter_texts, train_tokenizer
from lmforge.errors import UserError
from lmforge.tokenizers import load_tokenizer

EXTRA = "Ünïcödé, 世界 🙂\ttabs  and   spaces\r\n<|endoftext|> stays text"


@pytest.fixture(scope="module")
def shakespeare(shared_data) -> Path:
    return shared_data / "corpora" / "tinyshakespeare" / "input.txt"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, shakespeare) -> Path:
    out = tmp_path_factory.mktemp("tok") / "shakespeare-1k"
    train_tokenizer([shakespeare], 1000, out)
    return out


def test_loads_back_with_the_vocab_size_and_eod(trained):
    assert sorted(p.name for p in trained.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    tok = load_tokenizer(trained)
    assert tok.vocab_size == 1000
    assert tok.eod_id == tok.eos_id == tok.bos_id == tok.token_to_id("<|endoftext|>") == 0
    assert (
        json.loads((trained / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    )


def test_round_trip_and_compression(trained, shakespeare):
    tok = load_tokenizer(trained)
    text = shakespeare.read_text(encoding="utf-8")[:300_000]
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(text) / len(ids) > 2.2  # ~2.4 characters per token, against 1 for the bytes alone
    assert tok.decode(tok.encode(EXTRA)) == EXTRA  # bytes never seen in training still round-trip
    assert 0 not in tok.encode(EXTRA)  # a literal <|endoftext|> in text is not the control id
    assert tok.encode("First Citizen")[0] == tok.token_to_id("First")  # no prefix space, as GPT-2


def test_transformers_reads_the_same_ids(trained, shakespeare):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(trained))
    text = shakespeare.read_text(encoding="utf-8")[:20_000] + EXTRA.replace("<|endoftext|>", "")
    assert hf(text)["input_ids"] == load_tokenizer(trained).encode(text)
    assert hf.eos_token == "<|endoftext|>" and hf.eos_token_id == 0


def test_plain_text_is_streamed_in_whole_lines(monkeypatch, shakespeare):
    monkeypatch.setattr(tokenizer_train, "BATCH_CHARS", 10_000)
    pieces = list(iter_texts([shakespeare]))
    assert len(pieces) > 100 and all(p.endswith("\n") for p in pieces)
    assert "".join(pieces) == shakespeare.read_text(encoding="utf-8")


def test_cli_arguments_take_jsonl_folders(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    lines = [json.dumps({"text": f"the cat sat on the mat number {i}\n"}) for i in range(200)]
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "sub" / "b.txt").write_text("the dog sat on the log\n" * 50, encoding="utf-8")
    assert len(list(iter_texts([folder]))) == 201
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    out = tmp_path / "tok"
    args = parser.parse_args(["--input", str(folder), "--vocab-size", "280", "--out", str(out)])
    assert args.func is run
    args.func(args)
    tok = load_tokenizer(out)
    assert tok.vocab_size == 280 and tok.decode(tok.encode("the cat sat")) == "the cat sat"
    assert len(tok.encode("the cat sat on the mat")) == 6  # frequent words became one token each
    with pytest.raises(UserError, match="already exists"):
        args.func(args)


@pytest.mark.parametrize(
    "content, vocab, match",
    [
        ('{"text": "a"}\n{"txt": "b"}\n', 300, r"in\.jsonl:2: no key 'text'"),
        ('{"text": "a"}\n{"text": \n', 300, r"in\.jsonl:2: malformed JSON"),
        ('{"text": "a"}\n', 100, r"vocab_size 100 is below the 256 byte symbols"),
    ],
)
def test_errors_leave_no_output(tmp_path, content, vocab, match):
    path = tmp_path / "in.jsonl"
    path.write_text(content, encoding="utf-8")
    out = tmp_path / "out"
    with pytest.raises(UserError, match=match) as e:
        train_tokenizer([path], vocab, out)
    assert "\n" not in str(e.value)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]
    with pytest.raises(UserError, match="does not exist"):
        train_tokenizer([tmp_path / "missing.txt"], 300, out)


def test_parquet_and_zst_inputs_give_the_jsonl_texts(tmp_path):
    """The trainer finds and opens inputs as preprocess does: a Parquet column and a .zst file
    read as JSONL."""
    pa = pytest.importorskip("pyarrow")
    zstandard = pytest.importorskip("zstandard")
    import pyarrow.parquet as pq

    texts = [f"the cat sat on the mat number {i}\n" for i in range(50)]
    raw = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({"text": texts}), tmp_path / "b.parquet", row_group_size=7)
    assert list(iter_texts([tmp_path / "a.jsonl.zst", tmp_path / "b.parquet"])) == texts + texts
    pq.write_table(pa.table({"text": ["ok", None]}), tmp_path / "c.parquet")
    with pytest.raises(UserError, match=r"c\.parquet row 1: 'text' must be a string, got NoneType"):
        list(iter_texts([tmp_path / "c.parquet"]))


def test_bert_special_tokens_take_their_roles_in_transformers(tmp_path, shakespeare):
    """Trained with BERT's special tokens, tokenizer_config.json named [PAD] as bos, eos and unk
    and no mask token: the MLM export failed transformers' fill-mask pipeline ("does not define a
    mask_token")."""
    tf = pytest.importorskip("transformers")
    out = tmp_path / "bert-tok"
    specials = ("[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]")
    train_tokenizer([shakespeare], 600, out, special_tokens=specials)
    reference = tf.AutoTokenizer.from_pretrained(out)
    assert (
        reference.pad_token,
        reference.cls_token,
        reference.sep_token,
        reference.mask_token,
        reference.unk_token,
    ) == specials
    assert reference.bos_token is None and reference.eos_token is None
    framed = reference("To be or not").input_ids
    ours = load_tokenizer(out)
    # "[CLS] text [SEP]" there; plain ids here (MLM frames)
    assert framed == [1, *ours.encode("To be or not"), 2]
