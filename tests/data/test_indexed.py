"""The .bin/.idx pair checked byte for byte against megatron-core's own IndexedDatasetBuilder and
IndexedDataset.

megatron-core (the reference, test-only) is skipped where it is not installed; the corruption and
atomicity tests need only numpy.
"""

import pickle
import struct
import warnings

import numpy as np
import pytest

from lmforge.data.indexed import HEADER, IndexedDataset, IndexedDatasetWriter, optimal_dtype
from lmforge.errors import UserError

# (ids, lengths): lengths None is our default (one sequence; none when empty); Megatron gets it
# spelled out.
DOCS_UINT16 = [
    ([1, 2, 3], None),
    ([], None),  # empty document, no sequence: what preprocess_data.py writes for empty text
    ([65535, 0, 42, 50256], None),
    ([], [0]),  # empty document holding one empty sequence
    ([7, 8, 9, 10, 11], [2, 3]),  # two sequences, as with --split-sentences
    ([5], None),
    ([], None),
]
DOCS_INT32 = [
    ([100_000, 2**31 - 1, 0], None),
    ([], None),
    ([-5, 65536, 3], [1, 2]),
    ([1] * 1000, None),
    ([], None),
]


@pytest.fixture(scope="module")
def mcore():
    with warnings.catch_warnings():
        # megatron-core warns that Transformer Engine / Apex are absent
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def megatron_lengths(ids, lengths):
    return lengths if lengths is not None else ([len(ids)] if ids else [])


def write_ours(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for ids, lengths in docs:
            w.add_document(np.array(ids, dtype=np.int64), lengths)
    return prefix


def write_megatron(mcore, prefix, docs, dtype):
    builder = mcore.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for ids, lengths in docs:
        builder.add_document(ids, megatron_lengths(ids, lengths))
    builder.finalize(f"{prefix}.idx")
    return prefix


def sequences(docs):
    out = []
    for ids, lengths in docs:
        lengths = megatron_lengths(ids, lengths)
        starts = np.cumsum([0, *lengths])
        out += [ids[a:b] for a, b in zip(starts[:-1], starts[1:])]
    return out


@pytest.mark.parametrize(
    "docs,dtype", [(DOCS_UINT16, np.uint16), (DOCS_INT32, np.int32)], ids=["uint16", "int32"]
)
def test_writer_is_byte_identical_to_megatron(mcore, tmp_path, docs, dtype):
    ours = write_ours(tmp_path / "ours", docs, dtype)
    ref = write_megatron(mcore, str(tmp_path / "ref"), docs, dtype)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"ref.{ext}").read_bytes(), (
            ext
        )
    assert ours.with_name("ours.idx").read_bytes()[:9] == b"MMIDIDX\x00\x00"
    assert ref  # both written


@pytest.mark.parametrize(
    "docs,dtype", [(DOCS_UINT16, np.uint16), (DOCS_INT32, np.int32)], ids=["uint16", "int32"]
)
def test_reader_reads_megatron_files_and_megatron_reads_ours(mcore, tmp_path, docs, dtype):
    write_megatron(mcore, str(tmp_path / "ref"), docs, dtype)
    write_ours(tmp_path / "ours", docs, dtype)
    expected = sequences(docs)
    for a, b in [("ref", "ours"), ("ours", "ref")]:
        ours = IndexedDataset(tmp_path / a)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = mcore.IndexedDataset(str(tmp_path / b))
        assert ours.dtype == np.dtype(dtype) == theirs.index.dtype
        assert len(ours) == len(theirs) == len(expected)
        assert ours.num_documents == len(docs) == len(theirs.document_indices) - 1
        np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
        np.testing.assert_array_equal(ours.sequence_pointers, theirs.index.sequence_pointers)
        np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
        assert ours.sequence_lengths.dtype == np.int32 and ours.document_indices.dtype == np.int64
        for i, seq in enumerate(expected):
            np.testing.assert_array_equal(ours[i], np.array(seq, dtype=dtype))
            np.testing.assert_array_equal(ours[i], theirs[i])
            if len(seq) >= 2:
                np.testing.assert_array_equal(ours.get(i, 1, 1), theirs.get(i, 1, 1))
                np.testing.assert_array_equal(ours.get(i, offset=1), theirs.get(i, offset=1))


def test_documents_and_random_access(tmp_path):
    ds = IndexedDataset(write_ours(tmp_path / "d", DOCS_UINT16, np.uint16))
    # document d is sequences document_indices[d] .. document_indices[d + 1]
    np.testing.assert_array_equal(ds.document_indices, [0, 1, 1, 2, 3, 5, 6, 6])
    for d, (ids, _) in enumerate(DOCS_UINT16):
        np.testing.assert_array_equal(ds.document(d), np.array(ids, dtype=np.uint16))
    np.testing.assert_array_equal(ds[-1], [5])
    np.testing.assert_array_equal(ds.get(1, offset=1, length=2), [0, 42])
    assert len(ds.get(2)) == 0  # the empty sequence
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=5)
    copy = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker receives
    np.testing.assert_array_equal(copy[1], ds[1])


def test_empty_dataset_round_trip(tmp_path):
    ds = IndexedDataset(write_ours(tmp_path / "e", [], np.uint16))
    assert len(ds) == 0 and ds.num_documents == 0
    assert (tmp_path / "e.bin").stat().st_size == 0


def test_optimal_dtype_is_megatrons_rule(mcore):
    for vocab in (None, 1, 50257, 65499, 65500, 65536, 128_256):
        assert optimal_dtype(vocab) == np.dtype(mcore.DType.optimal_dtype(vocab))


def patch_idx(prefix, offset, data: bytes):
    path = prefix.with_name(prefix.name + ".idx")
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "corrupt,match",
    [
        (lambda p: patch_idx(p, 0, b"NOTMMIDX\x00"), r"d\.idx is not a Megatron MMIDIDX index"),
        (lambda p: patch_idx(p, 9, struct.pack("<Q", 2)), r"d\.idx has index version 2"),
        (lambda p: patch_idx(p, 17, bytes([9])), r"d\.idx has unknown dtype code 9"),
        (
            lambda p: patch_idx(p, 18, struct.pack("<Q", 7)),
            r"d\.idx is \d+ bytes but its header .* needs \d+",
        ),
        (
            lambda p: _truncate(p.with_name("d.idx"), 20),
            r"d\.idx is 20 bytes, shorter than the 34-byte header",
        ),
        (lambda p: _truncate(p.with_name("d.idx"), -8), r"d\.idx is \d+ bytes but its header"),
        (
            lambda p: _truncate(p.with_name("d.bin"), -2),
            r"d\.bin is 24 bytes but \S*d\.idx indexes 26 bytes of uint16",
        ),
        (
            lambda p: _append(p.with_name("d.bin"), b"\x00\x00"),
            r"d\.bin is 28 bytes but .* indexes 26 bytes",
        ),
        (lambda p: p.with_name("d.bin").unlink(), r"d\.bin not found"),
        (
            lambda p: patch_idx(p, HEADER.size + 7 * 12 + 8 * 7, struct.pack("<q", 5)),
            r"document indices",
        ),
    ],
    ids=[
        "magic",
        "version",
        "dtype",
        "count",
        "short-header",
        "short-idx",
        "short-bin",
        "long-bin",
        "no-bin",
        "doc-index",
    ],
)
def test_corrupt_files_give_one_line_errors(tmp_path, corrupt, match):
    prefix = write_ours(tmp_path / "d", DOCS_UINT16, np.uint16)
    corrupt(prefix)
    with pytest.raises(UserError, match=match) as e:
        IndexedDataset(prefix)
    assert "\n" not in str(e.value)


def _truncate(path, size):
    raw = path.read_bytes()
    path.write_bytes(raw[:size])


def _append(path, data):
    path.write_bytes(path.read_bytes() + data)


def test_writer_leaves_nothing_under_final_names_until_finalize(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "out" / "d", np.uint16)  # creates the folder
    w.add_document([1, 2, 3])
    assert not list((tmp_path / "out").glob("d.*"))
    assert len(list((tmp_path / "out").glob(".d.bin.tmp-*"))) == 1
    w.finalize()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["d.bin", "d.idx"]


def test_a_rewrite_cut_between_its_renames_leaves_no_old_index_beside_new_tokens(
    tmp_path, monkeypatch
):
    """Rewriting a prefix: killed after the .bin's rename, before the .idx's. The old .idx went
    first, so the reader refuses the half pair in one line (an old index beside the new tokens is
    read whenever the sizes agree: here they do, the same 3-token document)."""
    import os

    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
        w.add_document([1, 2, 3])
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if str(dst).endswith(".idx"):
            raise KeyboardInterrupt  # as a kill would stop it here
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
            w.add_document([4, 5, 6])
    monkeypatch.undo()
    assert [p.name for p in calls] == ["d.bin", "d.idx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin"]
    with pytest.raises(
        UserError, match=r"d.bin has no d.idx beside it \(a write of it was cut short\)"
    ):
        IndexedDataset(tmp_path / "d")


def test_writer_removes_everything_on_error(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(UserError, match="token id 65536 does not fit uint16"):
        with IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
            w.add_document([1, 65536])
    with pytest.raises(UserError, match="token id -1 does not fit uint16"):
        with IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
            w.add_document(np.array([-1, 3]))
    assert list(tmp_path.iterdir()) == []
