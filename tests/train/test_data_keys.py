"""A data key the run's task does not read is refused when the config is read, in one line naming
the key, the task and what the task reads instead; every key is read by some task, and every
shipped recipe sets only what it reads."""

from __future__ import annotations

import dataclasses

import pytest

from lmforge.errors import UserError
from lmforge.train.config import DataConfig, load_run_config
from lmforge.train.tasks import TASKS


def _load(*overrides: str):
    return load_run_config(None, ["model.preset=tiny-neox", *overrides])


def test_pretraining_refuses_the_fine_tuning_keys():
    with pytest.raises(UserError) as e:
        _load("data.paths=[corpus_text_document]", "data.valid_file=valid.jsonl")
    assert str(e.value) == (
        "data.valid_file is read by data.task=sft, classification, mlm, dpo, not "
        "data.task=pretrain: pretraining validates on data.valid_paths (held-out prefixes) or on "
        "data.split's validation part"
    )
    for key in (
        "train_file=train.jsonl",
        "packing=true",
        "chat_template=chatml",
        "pad_to_multiple_of=8",
        "text_key=sentence",
        "truncate=drop",
    ):
        with pytest.raises(
            UserError,
            match=rf"^data\.{key.split('=')[0]} is read by data\.task=.*, not "
            r"data\.task=pretrain: ",
        ):
            _load(f"data.{key}")


def test_fine_tuning_refuses_the_pretraining_keys():
    with pytest.raises(UserError) as e:
        _load("data.task=sft", "data.paths=[corpus_text_document]")
    assert str(e.value) == (
        "data.paths is read by data.task=pretrain, mlm, not data.task=sft: fine-tuning reads "
        "data.train_file (JSON lines; classification: TSV, CSV or JSONL), not tokenized prefixes"
    )
    for task in ("sft", "dpo", "classification"):
        for key in ("valid_paths=[held_text_document]", "split=90,10,0", "cache_dir=cache"):
            with pytest.raises(
                UserError,
                match=rf"^data\.{key.split('=')[0]} is read by .*, not data\.task={task}: "
                "fine-tuning ",
            ):
                _load(f"data.task={task}", f"data.{key}")
    with pytest.raises(
        UserError,
        match=r"^data\.assistant_only_loss is read by data\.task=sft, not data\.task=dpo: "
        "DPO compares",
    ):
        _load("data.task=dpo", "data.assistant_only_loss=false")
    with pytest.raises(
        UserError, match=r"^data\.split is read by data\.task=pretrain, not data\.task=mlm: "
    ):
        _load("data.task=mlm", "data.split=90,10,0")


def test_held_out_prefixes_leave_the_split_unread():
    """Megatron's --train-data-path with --valid-data-path: data.paths trains whole, so a split
    set beside data.valid_paths would cut nothing."""
    cfg = _load(
        "data.paths=[a_text_document]", "data.valid_paths=[0.7,b_text_document,0.3,c_text_document]"
    )
    assert cfg.data.valid_paths == [0.7, "b_text_document", 0.3, "c_text_document"]
    assert _load("data.valid_paths=b_text_document").data.valid_paths == ["b_text_document"]
    with pytest.raises(
        UserError,
        match=r"^data\.split is not read by data\.task=pretrain as configured: with "
        r"data\.valid_paths, data\.paths trains whole",
    ):
        _load("data.valid_paths=[b_text_document]", "data.split=98,2,0")


def test_a_key_at_its_default_is_no_error_and_every_key_has_a_reader():
    """Written out at its default (a recipe's `split: "969,30,1"` beside data.task=sft), a key
    says nothing; and no field of DataConfig is left that no task reads."""
    from lmforge.train.data_keys import READ_BY_ALL, READS, readers

    _load("data.task=sft", "data.split=969,30,1", "data.paths=[]", "data.cache_dir=null")
    for f in dataclasses.fields(DataConfig):
        assert f.name in READ_BY_ALL or readers(f.name), f"data.{f.name} is read by no task"
    assert set(READS) == set(TASKS)  # every task declares what it reads
    for name, keys in READS.items():
        assert keys <= {f.name for f in dataclasses.fields(DataConfig)}, name
