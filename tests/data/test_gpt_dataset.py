"""GPT sample indices, splits and blends: parity with megatron-core, caching, exact resume."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data.gpt_dataset import (
    BlendedDataset,
    GPTDataset,
    PretrainingSampler,
    blend_sizes,
    build_blending_indices,
    parse_blend,
    parse_split,
)
from lmforge.data.indexed import IndexedDataset
from lmforge.errors import UserError

VOCAB = 500


def write_corpus(prefix, num_docs: int, seed: int, max_len: int = 40) -> None:
    """Random documents written with megatron-core's own writer; lengths include 0 and 1."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, size=num_docs)
    lengths[:6] = [5, 0, 1, 0, 1, 7]
    lengths[-1] = max(lengths[-1], 3)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for n in lengths:
        builder.add_item(torch.from_numpy(rng.integers(1, VOCAB, size=n).astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def megatron_config(seq_length: int, seed: int, split: str | None, blend, cache):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    tokenizer = types.SimpleNamespace(
        vocab_size=VOCAB, eod=0, pad=VOCAB + 1, unique_identifiers={"class": "Mock"}
    )
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        path_to_cache=cache,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mmap_bin_files=True,
    )


def megatron_build(sizes, config):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset as MGPTDataset

    return BlendedMegatronDatasetBuilder(MGPTDataset, sizes, lambda: True, config).build()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    pytest.importorskip("megatron.core.datasets.gpt_dataset")
    prefix = tmp_path_factory.mktemp("corpus") / "docs"
    write_corpus(prefix, 1000, seed=0)
    return str(prefix)


# (seq_length, train samples, seed, split); with ~19.5k tokens in 1000 documents these span one
# epoch, several epochs with and without the separate final epoch, and a one-sample run.
SETTINGS = [
    (16, 100, 1234, "969,30,1"),
    (16, 1500, 7, "969,30,1"),
    (16, 2200, 7, "969,30,1"),
    (33, 3000, 3, "90,7,3"),
    (64, 1, 5, "80,10,10"),
    (7, 9000, 11, "949,50,1"),
]


@pytest.mark.parametrize("seq_length,num_samples,seed,split", SETTINGS)
def test_indices_and_samples_match_megatron(corpus, tmp_path, seq_length, num_samples, seed, split):
    sizes = [num_samples, 20, None]
    theirs = megatron_build(
        sizes, megatron_config(seq_length, seed, split, ([corpus], None), str(tmp_path / "m"))
    )
    indexed = IndexedDataset(corpus)
    for i, (start, end) in enumerate(parse_split(split, len(indexed))):
        ref = theirs[i]
        assert (start, end) == (int(ref.indices[0]), int(ref.indices[-1]) + 1)
        ours = GPTDataset(
            indexed, np.arange(start, end), sizes[i], seq_length, seed, cache_dir=tmp_path / "o"
        )
        np.testing.assert_array_equal(ours.document_index, ref.document_index)
        np.testing.assert_array_equal(ours.sample_index, ref.sample_index)
        np.testing.assert_array_equal(ours.shuffle_index, ref.shuffle_index)
        assert ours.document_index.dtype == ref.document_index.dtype
        assert ours.sample_index.dtype == ref.sample_index.dtype
        assert ours.shuffle_index.dtype == ref.shuffle_index.dtype
        assert len(ours) == len(ref)
        for j in range(len(ours)):
            text, _ = ref._query_document_sample_shuffle_indices(j)
            np.testing.assert_array_equal(ours.sample(j), text)
        item, ref_item = ours[len(ours) - 1], ref[len(ours) - 1]
        assert torch.equal(item["tokens"], ref_item["tokens"]) and torch.equal(
            item["labels"], ref_item["labels"]
        )


def test_settings_cover_separate_and_joint_final_epoch(corpus):
    """The parity settings must exercise both branches of the final-epoch rule."""
    tokens = int(IndexedDataset(corpus).sequence_lengths[:969].sum())
    seen = set()
    for seq_length, num_samples, _, split in SETTINGS:
        if split != "969,30,1":
            continue
        epochs = -(-(num_samples * seq_length + 1) // tokens)
        if epochs > 1:
            before = ((epochs - 1) * tokens - 1) // seq_length
            seen.add(num_samples - before < int(0.8 * ((tokens - 1) // seq_length)))
        else:
            seen.add("one epoch")
    assert seen == {True, False, "one epoch"}


@pytest.mark.parametrize(
    "split", ["969,30,1", "99,1,0", "1", "0.5, 0.25,0.25", "1,1,1", "949/50/1", "0,1,0"]
)
@pytest.mark.parametrize("num_documents", [1, 7, 333, 1000, 12345])
def test_parse_split_matches_megatron(split, num_documents):
    cfg = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_config")
    matrix = cfg.convert_split_vector_to_split_matrix(cfg.parse_and_normalize_split(split))
    for (start, end), bookends in zip(parse_split(split, num_documents), matrix):
        if bookends is None:
            assert start == end
        else:
            assert (start, end) == (
                round(bookends[0] * num_documents),
                round(bookends[1] * num_documents),
            )


@pytest.mark.parametrize("bad", ["", "a,b", "1,-1", "1,1,1,1", "0,0,0"])
def test_parse_split_rejects_nonsense(bad):
    with pytest.raises(UserError):
        parse_split(bad, 10)


@pytest.mark.parametrize(
    "weights,size",
    [
        ([0.7, 0.3], 1000),
        ([1.0, 2.0, 3.0], 4321),
        ([0.5], 5),
        (list(np.random.default_rng(0).random(12)), 20000),
        ([0.2, 0.8], 1),
    ],
)
def test_blending_indices_match_megatron(weights, size):
    pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets import helpers
    from megatron.core.datasets.utils import normalize

    weights = normalize(weights)
    ref_dataset, ref_sample = np.zeros(size, np.int16), np.zeros(size, np.int64)
    helpers.build_blending_indices(ref_dataset, ref_sample, weights, len(weights), size, False)
    dataset_index, sample_index = build_blending_indices(weights, size)
    np.testing.assert_array_equal(dataset_index, ref_dataset)
    np.testing.assert_array_equal(sample_index, ref_sample)


def test_blended_dataset_matches_megatron(tmp_path):
    pytest.importorskip("megatron.core.datasets.gpt_dataset")
    write_corpus(tmp_path / "a", 300, seed=1)
    write_corpus(tmp_path / "b", 200, seed=2, max_len=80)
    blend = [0.7, str(tmp_path / "a"), "0.3", str(tmp_path / "b")]
    prefixes, weights = parse_blend(blend)
    sizes, seq_length, seed = [700, 30, 10], 16, 42
    # A cache path would make megatron-core's BlendedDataset ask torch.distributed for its rank.
    theirs = megatron_build(
        sizes, megatron_config(seq_length, seed, "98,1,1", (prefixes, weights), None)
    )
    readers = [IndexedDataset(p) for p in prefixes]
    for i in range(3):
        per_dataset, blended_size = blend_sizes(weights, sizes[i])
        parts = [
            GPTDataset(
                r,
                np.arange(*parse_split("98,1,1", len(r))[i]),
                n,
                seq_length,
                seed,
                cache_dir=tmp_path / "o",
            )
            for r, n in zip(readers, per_dataset)
        ]
        ours, ref = BlendedDataset(parts, weights, blended_size), theirs[i]
        np.testing.assert_array_equal(ours.dataset_index, ref.dataset_index)
        np.testing.assert_array_equal(ours.dataset_sample_index, ref.dataset_sample_index)
        for j in range(0, len(ours), 7):
            assert ours[j]["dataset_id"] == ref[j]["dataset_id"]
            assert torch.equal(ours[j]["tokens"], ref[j]["tokens"])


@pytest.mark.parametrize(
    "blend", [[0.7, "a", 0.3], ["x", "a", 0.3, "b"], [-1, "a"], [0, "a", 1, "b"], [], ["nan", "a"]]
)
def test_parse_blend_rejects_bad_lists(blend):
    with pytest.raises(UserError):
        parse_blend(blend)


def test_parse_blend_accepts_strings_and_single_prefix():
    assert parse_blend(["30", " p/a ", 70, "p/b"]) == (["p/a", "p/b"], [30.0, 70.0])
    assert parse_blend(["p/only"]) == (["p/only"], [1.0])


def test_blend_that_oversamples_is_a_user_error(corpus):
    indexed = IndexedDataset(corpus)
    small = GPTDataset(indexed, np.arange(10), None, 16, 0, use_cache=False)
    with pytest.raises(UserError, match="draws"):
        BlendedDataset([small, small], [0.5, 0.5], 4 * len(small))


def test_cache_is_reused_and_keyed_by_every_setting(corpus, tmp_path):
    indexed = IndexedDataset(corpus)
    args = dict(split_documents=np.arange(900), num_samples=500, seq_length=16, seed=1)
    first = GPTDataset(indexed, **args, cache_dir=tmp_path)
    assert not first.loaded_from_cache
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.name for p in first.cache_paths.values()] + [first.description_path.name]
    )
    again = GPTDataset(indexed, **args, cache_dir=tmp_path)
    assert again.loaded_from_cache and again.cache_paths == first.cache_paths
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(again, name), getattr(first, name))
    names = {first.description_path}
    for change in [
        dict(split_documents=np.arange(1, 901)),
        dict(num_samples=501),
        dict(seq_length=17),
        dict(seed=2),
    ]:
        other = GPTDataset(indexed, **{**args, **change}, cache_dir=tmp_path)
        assert not other.loaded_from_cache
        names.add(other.description_path)
    (tmp_path / "other").mkdir()
    write_corpus(tmp_path / "other" / "docs", 1000, seed=9)  # same file name, other lengths
    other = GPTDataset(IndexedDataset(tmp_path / "other" / "docs"), **args, cache_dir=tmp_path)
    assert not other.loaded_from_cache
    names.add(other.description_path)
    assert len(names) == 6
    assert all(np.array_equal(again.sample(j), first.sample(j)) for j in range(0, len(first), 50))
    assert not [p for p in tmp_path.rglob("*.tmp-*")]


def test_default_cache_lives_next_to_the_data(corpus):
    ds = GPTDataset(IndexedDataset(corpus), np.arange(50), 10, 16, 0)
    assert ds.description_path.parent == Path(corpus).parent / "cache"
    assert ds.description_path.is_file()


@pytest.mark.parametrize("dp_size,micro_batch_size", [(1, 4), (2, 3), (4, 1)])
def test_resume_continues_the_same_sample_stream(corpus, dp_size, micro_batch_size):
    ds = GPTDataset(IndexedDataset(corpus), np.arange(969), 300, 16, 0, use_cache=False)

    def stream(consumed: int) -> list[list[int]]:
        """Per step, the ids every rank sees, rank after rank."""
        samplers = [
            iter(PretrainingSampler(len(ds), consumed, micro_batch_size, r, dp_size))
            for r in range(dp_size)
        ]
        return [sum(batches, []) for batches in zip(*samplers)]

    full = stream(0)
    step = micro_batch_size * dp_size
    assert sum(full, []) == list(range(len(full) * step))
    for resume_step in (1, 5, len(full) - 1):
        assert stream(resume_step * step) == full[resume_step:]
    loader = torch.utils.data.DataLoader(
        ds, batch_sampler=PretrainingSampler(len(ds), 5 * step, micro_batch_size)
    )
    first = next(iter(loader))["tokens"]
    assert torch.equal(first[0], ds[5 * step]["tokens"])


def test_the_trainers_split_is_over_sequences_as_megatrons(tmp_path):
    """megatron-core splits a GPT IndexedDataset by sequence; the trainer split it by document,
    so data with empty documents or documents of several sentences (preprocess's
    list-of-sentences form) trained on other samples than Megatron, on a quarter of the corpus,
    or failed with 'split documents reach outside'."""
    pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from lmforge.train.data import _split_dataset

    rng = np.random.default_rng(3)
    prefix = tmp_path / "sentences"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in range(300):
        for _ in range(0 if doc % 7 == 0 else 1 + doc % 4):  # empty documents, and 1-4 sentences
            builder.add_item(
                torch.from_numpy(
                    rng.integers(1, VOCAB, size=int(rng.integers(1, 30))).astype(np.int64)
                )
            )
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    indexed = IndexedDataset(prefix)
    assert len(indexed) > indexed.num_documents
    split, seed, seq_length, sizes = "949,50,1", 5, 16, [400, 30, None]
    theirs = megatron_build(
        sizes, megatron_config(seq_length, seed, split, ([str(prefix)], None), str(tmp_path / "m"))
    )
    data = types.SimpleNamespace(split=split, seq_length=seq_length, cache_dir=tmp_path / "o")
    cfg = types.SimpleNamespace(data=data, trainer=types.SimpleNamespace(seed=seed))
    for i in (0, 1):
        ours = _split_dataset([indexed], [1.0], i, sizes[i], cfg)
        assert len(ours) == len(theirs[i])
        for j in range(len(ours)):
            np.testing.assert_array_equal(
                ours.sample(j), theirs[i]._query_document_sample_shuffle_indices(j)[0]
            )
