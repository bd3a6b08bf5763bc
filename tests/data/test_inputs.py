"""Every input kind gives, byte for byte, the .bin/.idx that the same documents as plain JSON
lines give; how inputs are found, cut into slices, and reported when they are wrong."""

import gzip
import json
import random
import sys

import pytest

import lmforge.data.reader as reader
from lmforge.data.inputs import describe, find_inputs, plan
from lmforge.data.preprocess import preprocess
from lmforge.data.reader import records
from lmforge.errors import UserError
from tests.data.test_preprocess import articles, gpt2, same_files  # noqa: F401  (fixtures)

KEYS = ["text", "title"]


@pytest.fixture
def docs(articles):  # noqa: F811
    """20 wikitext articles cut to their first 1,000 characters (formats, not volume, are tested
    here) and an empty document at index 3."""
    return [{k: v[:1000] for k, v in json.loads(line).items()} for line in articles]


def jsonl(docs) -> bytes:
    return "".join(json.dumps(d) + "\n" for d in docs).encode()


def zst(data: bytes, frames: int = 2) -> bytes:
    """`frames` zstd frames back to back, as parallel compressors (pzstd, zstd -T) write them."""
    zstandard = pytest.importorskip("zstandard")
    step = -(-len(data) // frames)
    return b"".join(
        zstandard.ZstdCompressor().compress(data[i : i + step]) for i in range(0, len(data), step)
    )


def parquet(path, docs, row_group_size=4, large=False):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    text = pa.large_string() if large else pa.string()
    schema = pa.schema([(k, text) for k in docs[0]])
    pq.write_table(pa.Table.from_pylist(docs, schema=schema), path, row_group_size=row_group_size)
    return path


def make_input(kind, root, docs):
    root.mkdir()
    if kind == "jsonl.gz":
        (root / "c.jsonl.gz").write_bytes(gzip.compress(jsonl(docs)))
        return root / "c.jsonl.gz"
    if kind == "jsonl.zst":
        (root / "c.jsonl.zst").write_bytes(zst(jsonl(docs)))
        return root / "c.jsonl.zst"
    if kind in ("parquet", "parquet-large-string"):
        return parquet(root / "c.parquet", docs, large=kind.endswith("string"))
    if kind == "datasets":
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_list(docs).save_to_disk(str(root / "ds"), num_shards=3)
        return root / "ds"
    # sorted path order across kinds, a nested datasets folder, hidden and other files passed
    # over
    if kind == "folder":
        datasets = pytest.importorskip("datasets")
        (root / "a").mkdir()
        (root / "a" / "1.jsonl.zst").write_bytes(zst(jsonl(docs[:5])))
        parquet(root / "a" / "2.parquet", docs[5:9])
        datasets.Dataset.from_list(docs[9:14]).save_to_disk(str(root / "a" / "3-ds"), num_shards=2)
        (root / "b.jsonl").write_bytes(jsonl(docs[14:]))
        (root / "a" / ".hidden.jsonl").write_bytes(jsonl(docs[:1]))
        (root / "README.md").write_text("not data")
        return root
    assert kind == "glob"
    (root / "part-0.jsonl.gz").write_bytes(gzip.compress(jsonl(docs[:7])))
    parquet(root / "part-1.parquet", docs[7:12])
    (root / "part-2.jsonl").write_bytes(jsonl(docs[12:]))
    (root / "part-notes.md").write_text("a pattern's matches of other kinds are passed over")
    return root / "part-*"


@pytest.mark.parametrize(
    "kind",
    ["jsonl.gz", "jsonl.zst", "parquet", "parquet-large-string", "datasets", "folder", "glob"],
)
def test_every_input_kind_matches_plain_jsonl(tmp_path, docs, gpt2, kind):  # noqa: F811
    (tmp_path / "plain.jsonl").write_bytes(jsonl(docs))
    ref = preprocess(
        tmp_path / "plain.jsonl",
        tmp_path / "ref",
        gpt2,
        json_keys=KEYS,
        append_eod=True,
        progress=False,
    )
    got = preprocess(
        make_input(kind, tmp_path / "in", docs),
        tmp_path / "out",
        gpt2,
        json_keys=KEYS,
        append_eod=True,
        progress=False,
    )
    assert got.documents == ref.documents == len(docs)
    for key in KEYS:
        same_files(got.outputs[key], ref.outputs[key])


def test_sentence_lists_from_parquet_match_json(tmp_path, gpt2):  # noqa: F811
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = [
        {"text": ["First sentence.", "", " Second one."]},
        {"text": []},
        {"text": ["Only one."]},
    ]
    (tmp_path / "s.jsonl").write_bytes(jsonl(docs))
    pq.write_table(pa.Table.from_pylist(docs), tmp_path / "s.parquet")
    ref = preprocess(tmp_path / "s.jsonl", tmp_path / "ref", gpt2, append_eod=True, progress=False)
    got = preprocess(
        tmp_path / "s.parquet", tmp_path / "got", gpt2, append_eod=True, progress=False
    )
    same_files(got.outputs["text"], ref.outputs["text"])


def test_bad_rows_name_file_and_row_and_can_be_skipped(tmp_path, gpt2, monkeypatch):  # noqa: F811
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": ["a", "b", None, "d"]}), tmp_path / "n.parquet", row_group_size=2
    )
    with pytest.raises(
        UserError, match=r"n\.parquet row 2: key 'text' must hold a string .*got NoneType"
    ):
        preprocess(tmp_path / "n.parquet", tmp_path / "out", gpt2, progress=False)
    stats = preprocess(
        tmp_path / "n.parquet", tmp_path / "out", gpt2, on_error="skip", progress=False
    )
    assert (stats.documents, stats.skipped) == (3, 1)
    # an Arrow batch larger than the rows turned into Python strings at a time: row numbers run on
    # across slices
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["a", "b", "c", "d", None]}).save_to_disk(
        str(tmp_path / "ds")
    )
    monkeypatch.setattr(reader, "PARQUET_BATCH_ROWS", 2)
    with pytest.raises(
        UserError, match=r"data-00000-of-00001\.arrow row 4: key 'text' must hold a string"
    ):
        preprocess(tmp_path / "ds", tmp_path / "out", gpt2, progress=False)


def test_wrong_inputs_fail_with_one_line_and_leave_nothing(tmp_path, docs, gpt2):  # noqa: F811
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    import pyarrow.parquet as pq

    out = tmp_path / "out" / "p"
    cases = []
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "nokey.parquet")
    cases.append(
        (
            "nokey.parquet",
            r"nokey\.parquet has no column 'text' \(columns: 'body'\): check --json-keys",
        )
    )
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    cases.append(("ints.parquet", r"column 'text' of \S*ints\.parquet holds int64, not text"))
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "norows.parquet")
    cases.append(("norows.parquet", r"norows\.parquet has no rows: remove it"))
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(docs[:2]),
            "test": datasets.Dataset.from_list(docs[:1]),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    cases.append(
        (
            "dd",
            r"dd is a DatasetDict with splits train, test: give one split's folder, e.g. \S*dd/train",
        )
    )
    datasets.Dataset.from_list(docs[:4]).save_to_disk(str(tmp_path / "part"), num_shards=2)
    (tmp_path / "part" / "data-00001-of-00002.arrow").unlink()
    cases.append(
        ("part", r"datasets folder \S*part lists data-00001-of-00002\.arrow, which is not there")
    )
    (tmp_path / "zero.jsonl").write_bytes(b"")
    cases.append(("zero.jsonl", r"input \S*zero\.jsonl is empty: remove it"))
    (tmp_path / "blank.jsonl").write_bytes(jsonl([{"text": ""}, {"text": ""}]))
    cases.append(
        ("blank.jsonl", r"input \S*blank\.jsonl has no text \(every document in it is empty\)")
    )
    (tmp_path / "cut.jsonl.zst").write_bytes(zst(jsonl(docs), frames=1)[:-50])
    cases.append(
        (
            "cut.jsonl.zst",
            r"cannot read \S*cut\.jsonl\.zst \(.*truncated\): check the file is intact",
        )
    )
    cases.append(("nothing-*.jsonl", r"input pattern \S*nothing-\*\.jsonl matches no file"))
    for name, match in cases:
        with pytest.raises(UserError, match=match) as e:
            preprocess(tmp_path / name, out, gpt2, progress=False)
        assert "\n" not in str(e.value)
    # a file without text among good ones is named too
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "1.jsonl").write_bytes(jsonl(docs[:2]))
    (tmp_path / "mixed" / "2.jsonl").write_bytes(jsonl([{"text": ""}]))
    with pytest.raises(UserError, match=r"input \S*mixed/2\.jsonl has no text"):
        preprocess(tmp_path / "mixed", out, gpt2, progress=False)
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


@pytest.mark.parametrize("module", ["pyarrow", "zstandard"])
def test_a_missing_optional_dependency_says_how_to_install_it(tmp_path, gpt2, monkeypatch, module):  # noqa: F811
    name = "c.parquet" if module == "pyarrow" else "c.jsonl.zst"
    (tmp_path / name).write_bytes(b"anything")
    for m in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        # a None entry makes `import` fail as if not installed
        monkeypatch.setitem(sys.modules, m, None)
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(
        UserError, match=rf"needs {module}, which is not installed: pip install 'lmforge\[data\]'$"
    ):
        preprocess(tmp_path / name, tmp_path / "out", gpt2, progress=False)


def _contents(sources, keys, shard, n):
    return [
        (where[0], payload) for where, _, payload, _ in records(plan(sources, keys, shard, n), keys)
    ]


def test_slices_hold_every_document_once_in_order(tmp_path):
    """Any N: slice 0's documents, then slice 1's, ... are the input's. Lines of one length put
    some cuts exactly on line starts; blank lines, a gz file (never cut) and Parquet row groups
    are among them."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rng = random.Random(0)
    # 16 bytes a line
    (tmp_path / "a.jsonl").write_bytes(b"".join(b'{"text": "%03d"}\n' % i for i in range(30)))
    lines = [
        json.dumps({"text": "x" * rng.randrange(0, 300)}) + "\n" if i % 7 else "\n"
        for i in range(60)
    ]
    (tmp_path / "b.jsonl").write_text("".join(lines))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "gz"}\n' * 5))
    pq.write_table(
        pa.table({"text": [str(i) * 50 for i in range(40)]}),
        tmp_path / "d.parquet",
        row_group_size=6,
    )
    sources = find_inputs(tmp_path)
    whole = _contents(sources, ["text"], 0, 1)
    assert len(whole) == 30 + sum(1 for line in lines if line.strip()) + 5 + 40
    for n in (2, 3, 4, 5, 7, 8, 16, 200):
        parts = [_contents(sources, ["text"], i, n) for i in range(n)]
        assert [r for part in parts for r in part] == whole, n
        if n == 200:
            assert any(not part for part in parts)


def test_line_numbers_are_the_files_in_every_slice(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(
        b"".join(b'{"text": "line %d"}\n' % i for i in range(1, 101))
    )
    sources = find_inputs(tmp_path / "a.jsonl")
    seen, lines = [], {}
    for i in range(3):
        for where, kind, payload, _ in records(plan(sources, ["text"], i, 3), ["text"]):
            seen.append((describe(where, kind, lines), json.loads(payload)["text"]))
    assert seen == [(f"{tmp_path / 'a.jsonl'}:{i}", f"line {i}") for i in range(1, 101)]
