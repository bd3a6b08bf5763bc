"""`preprocess` checked byte for byte against Megatron-LM's tools/preprocess_data.py loop, on real
text.

The reference loop is re-enacted here with megatron-core's IndexedDatasetBuilder and an independent
GPT-2 tokenizer (transformers' GPT2TokenizerFast built from vocab.json + merges.txt, as Megatron's
Hugging Face path would): same ids, same dtype rule, same empty-document and eod handling, so the
files must be equal.
"""

import argparse
import gzip
import inspect
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from lmforge.cli.preprocess import add_arguments, run
from lmforge.data import IndexedDataset
from lmforge.data.preprocess import preprocess
from lmforge.errors import UserError
from lmforge.tokenizers import load_tokenizer

N_ARTICLES = 20


@pytest.fixture(scope="module")
def mcore():
    with warnings.catch_warnings():
        # megatron-core warns that Transformer Engine / Apex are absent
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


@pytest.fixture(scope="module")
def gpt2(shared_data) -> Path:
    return shared_data / "tokenizers" / "gpt2"


@pytest.fixture(scope="module")
def articles(shared_data) -> list[str]:
    """The first wikitext-2 validation articles as JSON lines, plus an empty document."""
    with open(
        shared_data / "corpora" / "wikitext-2" / "valid.articles.jsonl", encoding="utf-8"
    ) as f:
        lines = [next(f) for _ in range(N_ARTICLES)]
    lines.insert(3, json.dumps({"title": "empty", "text": ""}) + "\n")
    return lines


@pytest.fixture
def small_jsonl(tmp_path, articles) -> Path:
    path = tmp_path / "in" / "small.jsonl"
    path.parent.mkdir()
    path.write_text("".join(articles), encoding="utf-8")
    return path


def hf_gpt2(gpt2: Path):
    transformers = pytest.importorskip("transformers")
    cls = transformers.GPT2TokenizerFast
    files = str(gpt2 / "vocab.json"), str(gpt2 / "merges.txt")
    if "vocab_file" in inspect.signature(cls.__init__).parameters:  # transformers 4
        return cls(vocab_file=files[0], merges_file=files[1])
    return cls(vocab=files[0], merges=files[1])  # transformers 5 takes the paths as vocab/merges


def megatron_preprocess(mcore, lines, prefix, tok, json_keys, append_eod):
    """tools/preprocess_data.py's Encoder.encode + process_json_file, without --split-sentences."""
    eod = tok.eos_token_id
    builders = {
        key: mcore.IndexedDatasetBuilder(
            f"{prefix}_{key}_document.bin", dtype=mcore.DType.optimal_dtype(len(tok))
        )
        for key in json_keys
    }
    for line in lines:
        data = json.loads(line)
        for key in json_keys:
            doc_ids, sentence_lens = [], []
            for sentence in [data[key]]:
                sentence_ids = tok(sentence, add_special_tokens=False)["input_ids"]
                if len(sentence_ids) > 0:
                    doc_ids.extend(sentence_ids)
                    sentence_lens.append(len(sentence_ids))
            if len(doc_ids) > 0 and append_eod:
                doc_ids.append(eod)
                sentence_lens[-1] += 1
            builders[key].add_document(doc_ids, sentence_lens)
    for key in json_keys:  # Megatron finalizes only the last key (a bug); every key here
        builders[key].finalize(f"{prefix}_{key}_document.idx")


def same_files(a: str, b: str) -> None:
    for ext in (".bin", ".idx"):
        assert Path(a + ext).read_bytes() == Path(b + ext).read_bytes(), f"{a}{ext} != {b}{ext}"


def test_matches_megatron_byte_for_byte_with_1_and_2_workers(
    mcore, tmp_path, small_jsonl, articles, gpt2
):
    megatron_preprocess(
        mcore, articles, str(tmp_path / "ref"), hf_gpt2(gpt2), ["text"], append_eod=True
    )
    for workers in (1, 2):
        stats = preprocess(
            small_jsonl,
            tmp_path / f"w{workers}",
            gpt2,
            append_eod=True,
            workers=workers,
            progress=False,
        )
        assert stats.documents == N_ARTICLES + 1 and stats.skipped == 0
        same_files(stats.outputs["text"], str(tmp_path / "ref_text_document"))
    ds = IndexedDataset(tmp_path / "w1_text_document")
    assert ds.dtype == np.uint16 and ds.num_documents == N_ARTICLES + 1 and len(ds) == N_ARTICLES
    assert ds.document_indices[3] == ds.document_indices[4]  # the empty document has no sequence
    assert all(ds[i][-1] == 50256 for i in range(len(ds)))  # <|endoftext|> closes each document
    assert stats.tokens == int(ds.sequence_lengths.sum())


def test_several_json_keys_match_megatron(mcore, tmp_path, small_jsonl, articles, gpt2):
    lines = articles[:6]
    small_jsonl.write_text("".join(lines), encoding="utf-8")
    megatron_preprocess(
        mcore, lines, str(tmp_path / "ref"), hf_gpt2(gpt2), ["text", "title"], append_eod=False
    )
    stats = preprocess(
        small_jsonl, tmp_path / "ours", gpt2, json_keys=["text", "title"], progress=False
    )
    for key in ("text", "title"):
        same_files(stats.outputs[key], str(tmp_path / f"ref_{key}_document"))


def test_int32_when_the_vocabulary_is_large(tmp_path, small_jsonl, gpt2):
    tok = load_tokenizer(gpt2)
    small = preprocess(small_jsonl, tmp_path / "small", tok, append_eod=True, progress=False)
    tok.vocab_size = 65500  # Megatron's threshold: from here on ids are stored as int32
    large = preprocess(small_jsonl, tmp_path / "large", tok, append_eod=True, progress=False)
    a, b = IndexedDataset(small.outputs["text"]), IndexedDataset(large.outputs["text"])
    assert (a.dtype, b.dtype) == (np.uint16, np.int32)
    np.testing.assert_array_equal(a.document_indices, b.document_indices)
    for i in range(len(a)):
        np.testing.assert_array_equal(a[i], b[i])


def test_folders_gzip_and_plain_text(tmp_path, gpt2):
    root = tmp_path / "corpus"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    with gzip.open(root / "a" / "1.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write('{"text": "first line"}\n\n{"text": "second line"}\n')  # a blank line is skipped
    (root / "a" / ".hidden.jsonl").write_text('{"text": "never read"}\n')
    (root / "b" / "2.txt").write_text("A plain text file\n\nis one document.\n")
    (root / "README.md").write_text("not data")
    single = tmp_path / "3.json"
    single.write_text('{"text": "last"}')  # no final newline
    stats = preprocess([root, single], tmp_path / "out", gpt2, append_eod=True, progress=False)
    tok = load_tokenizer(gpt2)
    expected = ["first line", "second line", "A plain text file\n\nis one document.\n", "last"]
    ds = IndexedDataset(stats.outputs["text"])
    assert ds.num_documents == stats.documents == len(expected)
    for d, text in enumerate(expected):
        assert ds.document(d).tolist() == tok.encode(text) + [tok.eod_id]


def test_malformed_json_fails_with_file_and_line_and_leaves_nothing(
    tmp_path, small_jsonl, articles, gpt2
):
    small_jsonl.write_text(
        "".join(articles[:2]) + '{"text": "cut off\n' + "".join(articles[2:4]), encoding="utf-8"
    )
    for workers in (1, 2):
        with pytest.raises(
            UserError, match=r"small\.jsonl:3: malformed JSON .*--on-error skip"
        ) as e:
            preprocess(small_jsonl, tmp_path / "out" / "p", gpt2, workers=workers, progress=False)
        assert "\n" not in str(e.value)
        assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_skip_mode_skips_and_counts_bad_lines(tmp_path, small_jsonl, articles, gpt2):
    clean = small_jsonl.with_name("clean.jsonl")
    clean.write_text("".join(articles[:4]), encoding="utf-8")
    bad = ['{"text": \n', '{"title": "no text"}\n', "[1, 2]\n", '{"text": 5}\n']
    small_jsonl.write_bytes(
        "".join(articles[:2] + bad + articles[2:4]).encode() + b'{"text": "\xff"}\n'
    )
    ref = preprocess(clean, tmp_path / "clean", gpt2, append_eod=True, progress=False)
    # 2 workers: the bad lines are found in the workers and reported back in order
    stats = preprocess(
        small_jsonl,
        tmp_path / "skip",
        gpt2,
        append_eod=True,
        workers=2,
        on_error="skip",
        progress=False,
    )
    assert (stats.documents, stats.skipped) == (4, 5)
    same_files(stats.outputs["text"], ref.outputs["text"])


@pytest.mark.parametrize(
    "content,match",
    [
        (b'{"title": "x"}\n', r"bad\.jsonl:1: no key 'text' \(keys: 'title'\): check --json-keys"),
        (
            b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
            r"bad\.jsonl:2: not valid UTF-8 \(invalid continuation byte",
        ),
        (
            b'{"text": ["a", 1]}\n',
            r"bad\.jsonl:1: key 'text' must hold a string or a list of strings",
        ),
        (b'{"text": "\\ud800"}\n', r"bad\.jsonl:1: key 'text' holds a lone UTF-16 surrogate"),
    ],
    ids=["missing-key", "not-utf8", "not-a-string", "surrogate"],
)
def test_bad_lines_fail_with_one_line_errors(tmp_path, gpt2, content, match):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    with pytest.raises(UserError, match=match) as e:
        preprocess(bad, tmp_path / "out", gpt2, progress=False)
    assert "\n" not in str(e.value)
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]


def test_non_utf8_plain_text_names_the_file(tmp_path, gpt2):
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin1\.txt: not valid UTF-8"):
        preprocess(tmp_path / "latin1.txt", tmp_path / "out", gpt2, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["latin1.txt"]


def test_bad_inputs(tmp_path, gpt2):
    with pytest.raises(UserError, match="no input given"):
        preprocess([], tmp_path / "out", gpt2, progress=False)
    with pytest.raises(UserError, match=r"input \S*missing\.jsonl does not exist"):
        preprocess([tmp_path / "missing.jsonl"], tmp_path / "out", gpt2, progress=False)
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(UserError, match=r"data\.csv is of an unknown kind"):
        preprocess(tmp_path / "data.csv", tmp_path / "out", gpt2, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no data files"):
        preprocess(tmp_path / "empty", tmp_path / "out", gpt2, progress=False)
    raw = gzip.compress(b'{"text": "a"}\n' * 1000)
    (tmp_path / "cut.jsonl.gz").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "junk.jsonl.gz").write_bytes(raw[:10] + b"\xff" * 50)
    for name in ("cut.jsonl.gz", "junk.jsonl.gz"):
        with pytest.raises(
            UserError, match=rf"cannot read \S*{name} \(.*\): check the file is intact"
        ):
            preprocess(tmp_path / name, tmp_path / "out", gpt2, progress=False)
        (tmp_path / name).unlink()
    with pytest.raises(UserError, match="on_error must be"):
        preprocess(tmp_path / "data.csv", tmp_path / "out", gpt2, on_error="ignore")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.csv", "empty"]


def test_cli_arguments(tmp_path, small_jsonl, articles, gpt2, capsys):
    small_jsonl.write_text("".join(articles[:5]), encoding="utf-8")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "cli" / "wiki"
    args = parser.parse_args(
        [
            "--input",
            str(small_jsonl.parent),
            "--output-prefix",
            str(out),
            "--tokenizer",
            str(gpt2 / "vocab.json"),
            "--append-eod",
            "--workers",
            "1",
            "--no-progress",
        ]
    )
    assert args.func is run
    stats = run(args)
    assert "wrote 5 documents" in capsys.readouterr().out
    ref = preprocess(small_jsonl, tmp_path / "api", gpt2, append_eod=True, progress=False)
    # vocab.json+merges.txt gives tokenizer.json's ids
    same_files(stats.outputs["text"], ref.outputs["text"])
    shutil.rmtree(tmp_path / "cli")


def _die(chunk):
    os._exit(3)  # a worker killed mid-task, as by the out-of-memory killer


@pytest.mark.skipif(sys.platform != "linux", reason="the patched task reaches the workers by fork")
def test_a_dead_worker_raises_instead_of_hanging(tmp_path, small_jsonl, gpt2, monkeypatch):
    import lmforge.data.encoding as enc

    monkeypatch.setattr(enc, "_encode_in_worker", _die)
    with pytest.raises(RuntimeError, match="worker process died"):
        preprocess(small_jsonl, tmp_path / "out" / "p", gpt2, workers=2, progress=False)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_chunks_finishing_out_of_order_are_written_in_input_order(
    mcore, tmp_path, small_jsonl, articles, gpt2, monkeypatch
):
    """Chunks run concurrently (tokenizer threads with 1 worker, processes with 2); the first one
    is made the slowest, so the others finish before it, and the files must still be Megatron's
    byte for byte."""
    import lmforge.data.encoding as enc

    encode_chunk = enc.Encoder.encode_chunk

    def first_chunk_last(self, chunk):
        if chunk[0][0][2] == 1:  # where = (file, base, line): the first line
            time.sleep(0.5)
        return encode_chunk(self, chunk)

    monkeypatch.setattr(enc, "CHUNK_DOCS", 2)
    monkeypatch.setattr(enc.Encoder, "encode_chunk", first_chunk_last)  # forked workers inherit it
    megatron_preprocess(
        mcore, articles, str(tmp_path / "ref"), hf_gpt2(gpt2), ["text"], append_eod=True
    )
    for workers in (1, 2):
        stats = preprocess(
            small_jsonl,
            tmp_path / f"w{workers}",
            gpt2,
            append_eod=True,
            workers=workers,
            progress=False,
        )
        same_files(stats.outputs["text"], str(tmp_path / "ref_text_document"))


def test_cli_preprocess_does_not_import_torch(tmp_path, small_jsonl, gpt2):
    """`lmforge preprocess` needs no torch; importing it would add seconds to every run's
    start-up."""
    argv = [
        "preprocess",
        "--input",
        str(small_jsonl),
        "--output-prefix",
        str(tmp_path / "cli"),
        "--tokenizer",
        str(gpt2),
        "--append-eod",
    ]
    code = f"import sys; from lmforge.cli import main; rc = main({argv!r}); print(rc, 'torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines()[-1] == "0 False", r.stdout + r.stderr
    ref = preprocess(small_jsonl, tmp_path / "api", gpt2, append_eod=True, progress=False)
    same_files(str(tmp_path / "cli_text_document"), ref.outputs["text"])


def test_spawned_workers_load_their_own_tokenizer(
    tmp_path, small_jsonl, articles, gpt2, monkeypatch
):
    """macOS and Windows start workers by spawn: they load the tokenizer from its file, same
    bytes as fork."""
    import lmforge.data.encoding as enc

    small_jsonl.write_text("".join(articles[:6]), encoding="utf-8")
    monkeypatch.setattr(enc, "START_METHOD", "spawn")
    monkeypatch.setattr(enc, "CHUNK_DOCS", 2)
    spawned = preprocess(
        small_jsonl,
        tmp_path / "spawn",
        gpt2 / "vocab.json",
        append_eod=True,
        workers=2,
        progress=False,
    )
    ref = preprocess(
        small_jsonl, tmp_path / "one", gpt2 / "vocab.json", append_eod=True, progress=False
    )
    same_files(spawned.outputs["text"], ref.outputs["text"])


def test_parse_special_tokens_matches_megatron_and_the_default_keeps_text(
    mcore, tmp_path, articles, gpt2
):
    """Megatron's tool tokenizes through Hugging Face, which turns "<|endoftext|>" in a document
    into the control id; --parse-special-tokens gives those bytes. By default it stays text: no
    document can forge a boundary."""
    lines = articles[:4] + [
        json.dumps({"text": t}) + "\n"
        for t in (
            "A scraped page<|endoftext|>with a forged boundary, and another <|endoftext|> here.",
            "<|endoftext|>",
            "Text that is only text.",
        )
    ]
    (tmp_path / "special.jsonl").write_text("".join(lines), encoding="utf-8")
    megatron_preprocess(
        mcore, lines, str(tmp_path / "ref"), hf_gpt2(gpt2), ["text"], append_eod=True
    )
    tok = load_tokenizer(gpt2)
    for workers in (1, 2):
        parsed = preprocess(
            tmp_path / "special.jsonl",
            tmp_path / f"parsed{workers}",
            tok,
            append_eod=True,
            workers=workers,
            parse_special_tokens=True,
            progress=False,
        )
        same_files(parsed.outputs["text"], str(tmp_path / "ref_text_document"))
    assert not tok.parse_special_tokens  # a caller's tokenizer comes back as it was given
    text = preprocess(
        tmp_path / "special.jsonl", tmp_path / "text", tok, append_eod=True, progress=False
    )
    ds = IndexedDataset(text.outputs["text"])
    assert [int((ds.document(d) == tok.eod_id).sum()) for d in range(ds.num_documents)] == [
        1,
        1,
        1,
        0,
        1,
        1,
        1,
    ]
    # the characters, then eod
    assert ds.document(5).tolist() == tok.encode("<|endoftext|>") + [tok.eod_id]


def test_prepend_bos_matches_megatrons_llama_tokenizer(
    mcore, tmp_path, articles, shared_data, monkeypatch
):
    """Llama 2 continued pretraining: Megatron's Llama tokenizer starts every text with <s>
    (tokenize(text, bos=True): [bos] + SentencePiece's ids, an empty text the bos alone);
    --prepend-bos writes the same bytes."""
    import lmforge.data.encoding as enc

    spm = pytest.importorskip("sentencepiece")
    model = shared_data / "tokenizers" / "llama2" / "tokenizer.model"
    sp = spm.SentencePieceProcessor(model_file=str(model))
    lines = articles[:5]  # the empty document among them
    (tmp_path / "in.jsonl").write_text("".join(lines), encoding="utf-8")
    builder = mcore.IndexedDatasetBuilder(
        str(tmp_path / "ref.bin"), dtype=mcore.DType.optimal_dtype(sp.vocab_size())
    )
    # tools/preprocess_data.py's Encoder.encode with _Llama2Tokenizer and --append-eod
    for line in lines:
        ids = [sp.bos_id()] + sp.encode(json.loads(line)["text"])
        builder.add_document(ids + [sp.eos_id()], [len(ids) + 1])
    builder.finalize(str(tmp_path / "ref.idx"))
    monkeypatch.setattr(enc, "CHUNK_DOCS", 2)
    for workers in (1, 2):
        out = preprocess(
            tmp_path / "in.jsonl",
            tmp_path / f"bos{workers}",
            model,
            append_eod=True,
            prepend_bos=True,
            workers=workers,
            progress=False,
        )
        same_files(out.outputs["text"], str(tmp_path / "ref"))
    plain = preprocess(
        tmp_path / "in.jsonl", tmp_path / "plain", model, append_eod=True, progress=False
    )
    # off by default, as before
    assert IndexedDataset(plain.outputs["text"]).document(0)[0] != sp.bos_id()
    tok = load_tokenizer(model)
    tok.bos_id = None
    with pytest.raises(UserError, match="has no beginning-of-sequence token: drop --prepend-bos"):
        preprocess(tmp_path / "in.jsonl", tmp_path / "none", tok, prepend_bos=True, progress=False)
    assert not list(tmp_path.glob("none*"))


def test_special_token_text_left_as_text_is_said_once(
    tmp_path, articles, shared_data, monkeypatch, caplog
):
    """WikiText holds 11,718 "<unk>" strings: preprocess wrote them as text (the bytes Megatron's
    SentencePiece tokenizer writes, kept) where lmforge eval and transformers read the unk id,
    and said nothing. One warning at the end counts them, each shard its own; none where
    --parse-special-tokens reads them, or none is there."""
    import logging

    import lmforge.data.encoding as enc

    spm = pytest.importorskip("sentencepiece")
    model = shared_data / "tokenizers" / "llama2" / "tokenizer.model"
    lines = [*articles, json.dumps({"text": "a <s> forged </s> turn"}) + "\n"]
    (tmp_path / "in.jsonl").write_text("".join(lines), encoding="utf-8")
    texts = [json.loads(line)["text"] for line in lines]
    found = {name: sum(t.count(name) for t in texts) for name in ("<unk>", "<s>", "</s>")}
    documents = sum(any(name in t for name in found) for t in texts)
    assert (
        found["<unk>"] > 1000 and found["<s>"] == found["</s>"] == 1 and 1 < documents < len(texts)
    )
    said = (
        f"{sum(found.values()):,} occurrences of special-token text (<unk> x{found['<unk>']:,}, </s> x1, <s> x1) "
        f"in {documents} documents were tokenized as plain text (lmforge's default, as Megatron's "
        "preprocess_data.py does with its own GPT-2 BPE and SentencePiece tokenizers); lmforge eval and "
        "transformers read such text as the special ids: --parse-special-tokens tokenizes them so"
    )
    monkeypatch.setattr(enc, "CHUNK_DOCS", 4)
    sp = spm.SentencePieceProcessor(model_file=str(model))

    def warnings_of(**kw) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lmforge.data.preprocess"):
            stats = preprocess(tmp_path / "in.jsonl", tmp_path / "out", model, progress=False, **kw)
        if not kw.get("parse_special_tokens") and "shard" not in kw:
            # the text stays sentencepiece's, as Megatron's
            ds = IndexedDataset(stats.outputs["text"])
            last = json.loads((tmp_path / "in.jsonl").read_text(encoding="utf-8").splitlines()[-1])[
                "text"
            ]
            assert ds.document(ds.num_documents - 1).tolist() == sp.encode(last)
        return [r.getMessage() for r in caplog.records]

    for workers in (1, 2):
        assert warnings_of(workers=workers) == [said]
    shards = [warnings_of(shard=f"{i}/2") for i in range(2)]
    assert [w[0].split(": ")[0] for w in shards] == ["shard 0/2", "shard 1/2"]
    assert sum(int(w[0].split(": ")[1].split()[0].replace(",", "")) for w in shards) == sum(
        found.values()
    )
    assert warnings_of(parse_special_tokens=True) == []
    (tmp_path / "in.jsonl").write_text(
        "".join(line.replace("<", "[") for line in lines), encoding="utf-8"
    )
    assert warnings_of() == []


@pytest.mark.slow  # spawned workers import lmforge and load the tokenizer themselves: seconds
def test_spawned_workers_parse_special_tokens_when_asked(tmp_path, gpt2, monkeypatch):
    import lmforge.data.encoding as enc

    (tmp_path / "s.jsonl").write_text(
        json.dumps({"text": "a<|endoftext|>b"}) + "\n" + '{"text": "c"}\n'
    )
    monkeypatch.setattr(enc, "START_METHOD", "spawn")
    monkeypatch.setattr(enc, "CHUNK_DOCS", 1)
    spawned = preprocess(
        tmp_path / "s.jsonl",
        tmp_path / "spawn",
        gpt2,
        workers=2,
        parse_special_tokens=True,
        progress=False,
    )
    assert IndexedDataset(spawned.outputs["text"]).document(0).tolist() == [64, 50256, 65]


def test_sigterm_stops_the_workers_and_leaves_no_partial_output(gpt2, shared_data, tmp_path):
    """`kill`, `timeout` and Slurm send SIGTERM: preprocess ended at once, its worker processes
    blocked forever on a pipe nobody read, and its partial .bin stayed behind. It now unwinds as
    Ctrl-C does (exit 143)."""
    import signal

    articles = (shared_data / "corpora" / "wikitext-2" / "valid.articles.jsonl").read_text()
    # minutes of work: stopped long before its end
    (tmp_path / "big.jsonl").write_text(articles * 100)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmforge.cli",
            "preprocess",
            "--input",
            str(tmp_path / "big.jsonl"),
            "--output-prefix",
            str(out / "p"),
            "--tokenizer",
            str(gpt2),
            "--workers",
            "2",
            "--no-progress",
        ],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def group() -> list[str]:
        return subprocess.run(
            ["ps", "-o", "pid=", "-g", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()

    deadline = time.monotonic() + 120
    while len(group()) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the two workers have started
    time.sleep(1)  # and are tokenizing
    assert proc.poll() is None, "preprocess finished before it could be stopped: give it more text"
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    time.sleep(1)
    left = group()
    for pid in left:
        os.kill(int(pid), signal.SIGKILL)
    assert left == [] and (not out.exists() or list(out.iterdir()) == [])
