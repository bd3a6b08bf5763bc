"""Sharded preprocessing: N shards merged are the one-shot .bin/.idx byte for byte, empty shards
included; shards made differently are refused with one line, and nothing is written then."""

import gzip
import json
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.data.indexed import bin_path, idx_path
from lmforge.data.preprocess import preprocess
from lmforge.data.shards import merge, parse_shard, record_path, shard_prefix
from lmforge.errors import UserError
from lmforge.tokenizers import load_tokenizer
from tests.data.test_inputs import jsonl, parquet
from tests.data.test_preprocess import articles, gpt2, same_files  # noqa: F401  (fixtures)

KEYS = ["text", "title"]


@pytest.fixture
def tok(gpt2):  # noqa: F811
    return load_tokenizer(gpt2)


@pytest.fixture
def corpus(tmp_path, articles):  # noqa: F811
    """A folder: a plain JSONL (cut at line starts, an empty document in it), a gzip JSONL far
    larger than one slice of 7 (never cut, so slices around it hold nothing) and a Parquet file
    of 3 row groups."""
    docs = [{k: v[:1500] for k, v in json.loads(line).items()} for line in articles]
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.jsonl").write_bytes(jsonl([{k: v[:300] for k, v in d.items()} for d in docs[:8]]))
    (root / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(docs[8:20])))
    parquet(root / "c.parquet", docs[:6], row_group_size=2)
    return root


def shards(corpus, prefix, tok, n, **kw):
    return [
        preprocess(
            corpus,
            prefix,
            tok,
            json_keys=KEYS,
            append_eod=True,
            progress=False,
            shard=f"{i}/{n}",
            **kw,
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("n", [1, 3, 7])
def test_n_shards_merged_are_the_one_shot_files(tmp_path, corpus, tok, n):
    one = preprocess(corpus, tmp_path / "one", tok, json_keys=KEYS, append_eod=True, progress=False)
    made = shards(corpus, tmp_path / "sh", tok, n)
    assert sum(s.documents for s in made) == one.documents == 8 + 12 + 6
    if n == 7:
        assert 0 in [s.documents for s in made]  # an empty shard merges like any other
    for key in KEYS:
        stats = merge(f"{tmp_path}/sh_{key}_document")
        assert (stats.shards, stats.documents) == (n, one.documents)
        same_files(f"{tmp_path}/sh_{key}_document", one.outputs[key])


def _refused(prefix: str, match: str) -> None:
    with pytest.raises(UserError, match=match) as e:
        merge(prefix)
    assert "\n" not in str(e.value)
    assert not bin_path(prefix).exists() and not idx_path(prefix).exists()


def test_shards_made_differently_are_refused(tmp_path, corpus, tok, shared_data):
    prefix = f"{tmp_path}/sh_text_document"
    shards(corpus, tmp_path / "sh", tok, 3)
    tok.vocab_size = 65500  # Megatron's threshold: this "tokenizer" writes int32
    preprocess(
        corpus, tmp_path / "sh", tok, json_keys=KEYS, append_eod=True, progress=False, shard="1/3"
    )
    _refused(
        prefix,
        r"shard 1 has dtype=int32 but shard 0 has dtype=uint16 \(different tokenizers\): make them",
    )
    # uint16 too
    neox = load_tokenizer(shared_data / "tokenizers" / "gpt-neox-20b" / "20B_tokenizer.json")
    preprocess(
        corpus, tmp_path / "sh", neox, json_keys=KEYS, append_eod=True, progress=False, shard="1/3"
    )
    _refused(
        prefix,
        r"shard 1 has tokenizer 20B_tokenizer\.json \(sha256 \w+\) but shard 0 has tokenizer "
        r"tokenizer\.json \(sha256 \w+\): make them again with one tokenizer",
    )
    tok.vocab_size = 50257
    preprocess(
        corpus, tmp_path / "sh", tok, json_keys=KEYS, append_eod=False, progress=False, shard="1/3"
    )
    _refused(prefix, r"shard 1 has append_eod=False but shard 0 has append_eod=True")
    (corpus / "d.jsonl").write_text('{"text": "one more file", "title": "t"}\n')
    preprocess(
        corpus, tmp_path / "sh", tok, json_keys=KEYS, append_eod=True, progress=False, shard="1/3"
    )
    _refused(
        prefix,
        r"shard 1 has inputs with digest \w+ \(4 files\) but shard 0 has inputs .*\(3 files\): "
        "make them again with the same --input",
    )


def test_missing_mixed_and_unfinished_shards_are_refused(tmp_path, corpus, tok):
    prefix = f"{tmp_path}/sh_text_document"
    made = shards(corpus, tmp_path / "sh", tok, 3)
    for ext in (".bin", ".idx", ".json"):
        Path(made[1].outputs["text"] + ext).unlink()
    _refused(
        prefix, r"sh_text_document lacks shard\(s\) 1 of 3: run lmforge preprocess --shard 1/3"
    )
    preprocess(
        corpus, tmp_path / "sh", tok, json_keys=KEYS, append_eod=True, progress=False, shard="1/4"
    )
    _refused(prefix, r"sh_text_document has shards of 3 and of 4: delete the stale set")
    for ext in (".bin", ".idx", ".json"):
        Path(f"{prefix}.shard-1-of-4{ext}").unlink()
    preprocess(
        corpus, tmp_path / "sh", tok, json_keys=KEYS, append_eod=True, progress=False, shard="1/3"
    )
    # as if shard 2 died between its .idx and its record
    record_path(made[2].outputs["text"]).unlink()
    _refused(
        prefix,
        r"sh_text_document\.shard-2-of-3\.json is missing: that shard's preprocess did not finish",
    )
    with pytest.raises(UserError, match=r"--shard 3/3: I counts from 0 and must be below N"):
        parse_shard("3/3")
    with pytest.raises(UserError, match=r"--shard '2' is not I/N"):
        parse_shard("2")


def test_shard_names_sort_in_shard_order():
    """Megatron's tools/merge_datasets.py merges a folder's pairs in sorted name order: ours must
    be shard order."""
    names = [shard_prefix("d_text_document", i, 12) for i in range(12)]
    assert names[3] == "d_text_document.shard-03-of-12" and sorted(names) == names
    assert shard_prefix("d", 2, 7) == "d.shard-2-of-7"


def test_a_file_without_text_cut_between_shards_fails_at_merge_as_one_shot(tmp_path, tok):
    root = tmp_path / "in"
    root.mkdir()
    # 5,600 bytes: cut in two by 3 slices
    (root / "a.jsonl").write_bytes(jsonl([{"text": ""}] * 400))
    (root / "b.jsonl").write_bytes(jsonl([{"text": "some text " * 50}] * 10))
    with pytest.raises(UserError, match=r"input \S*a\.jsonl has no text"):
        preprocess(root, tmp_path / "one", tok, progress=False)
    for i in range(3):
        preprocess(root, tmp_path / "sh", tok, progress=False, shard=(i, 3))
    _refused(f"{tmp_path}/sh_text_document", r"cannot merge \S+: input \S*a\.jsonl has no text")


@pytest.mark.slow  # five CLI runs, each loading the tokenizer: ~3 s
def test_cli_shards_then_merges_with_the_same_arguments(tmp_path, corpus, gpt2, capsys):  # noqa: F811
    common = [
        "--input",
        str(corpus),
        "--tokenizer",
        str(gpt2),
        "--json-keys",
        *KEYS,
        "--append-eod",
        "--no-progress",
    ]
    assert main(["preprocess", *common, "--output-prefix", str(tmp_path / "one")]) == 0
    for i in range(2):
        assert (
            main(
                [
                    "preprocess",
                    *common,
                    "--output-prefix",
                    str(tmp_path / "sh"),
                    "--shard",
                    f"{i}/2",
                ]
            )
            == 0
        )
    assert "shard 1/2: wrote" in capsys.readouterr().out
    # --merge checks the shards against its own arguments: another option is refused in one line
    assert (
        main(
            [
                "preprocess",
                *common[:-2],
                "--no-progress",
                "--output-prefix",
                str(tmp_path / "sh"),
                "--merge",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip()
    assert (
        "\n" not in err
        and "this command has append_eod=False but the shards have append_eod=True" in err
    )
    assert main(["preprocess", *common, "--output-prefix", str(tmp_path / "sh"), "--merge"]) == 0
    assert "merged 2 shards into" in capsys.readouterr().out
    for key in KEYS:
        same_files(f"{tmp_path}/sh_{key}_document", f"{tmp_path}/one_{key}_document")
        bin_path(f"{tmp_path}/sh_{key}_document").unlink()
    # the output prefix: every key's shards
    assert main(["data", "merge", str(tmp_path / "sh")]) == 0
    for key in KEYS:
        same_files(f"{tmp_path}/sh_{key}_document", f"{tmp_path}/one_{key}_document")
