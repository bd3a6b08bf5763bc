"""The data.* keys each task reads, and the refusal of the others: a key set to anything but its
default that the run's task never reads is a mistake (data.valid_file under pretraining validated on
nothing it named), said in one line when the config is read, naming the key, the task and what the
task reads instead.

READS declares per task (a name in lmforge.train.tasks.TASKS; a test keeps the two in step) the keys
it reads beyond READ_BY_ALL, UNREAD_WITH those it leaves unread once another is set, and INSTEAD
what it uses in place of a key it does not read. (A table here rather than on the Task classes: the
config is checked as it is read, and the tasks import the config.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lmforge.errors import UserError

READ_BY_ALL = frozenset({"task", "seq_length", "tokenizer", "num_workers"})
FINE_TUNING = frozenset({"train_file", "valid_file", "pad_to_multiple_of"})
READS: dict[str, frozenset[str]] = {
    "pretrain": frozenset({"paths", "split", "valid_paths", "cache_dir"}),
    "sft": FINE_TUNING
    | {
        "packing",
        "prompt_template",
        "chat_template",
        "assistant_only_loss",
        "truncate",
        "max_train_examples",
    },
    "classification": FINE_TUNING | {"text_key", "label_key"},
    "mlm": frozenset({"paths", "valid_file", "cache_dir", "pad_to_multiple_of"}),
    "dpo": FINE_TUNING | {"prompt_template", "chat_template", "truncate", "max_train_examples"},
    "grpo": frozenset({"train_file", "chat_template", "max_train_examples"}),
}
# Keys a task leaves unread once another is set: with held-out prefixes, pretraining trains on
# data.paths whole.
UNREAD_WITH: dict[str, dict[str, frozenset[str]]] = {
    "pretrain": {"valid_paths": frozenset({"split"})}
}
FINE_TUNING_INSTEAD = {
    "paths": "fine-tuning reads data.train_file (JSON lines; classification: TSV, CSV or JSONL), not tokenized "
    "prefixes",
    "valid_paths": "fine-tuning validates on data.valid_file, scored whole",
    "split": "fine-tuning trains on data.train_file whole and validates on data.valid_file",
    "cache_dir": "fine-tuning reads its files whole, with no sample-index cache",
}
INSTEAD: dict[str, dict[str, str]] = {
    "pretrain": {
        "train_file": "pretraining reads Megatron .bin/.idx prefixes, data.paths (lmforge preprocess makes them)",
        "valid_file": "pretraining validates on data.valid_paths (held-out prefixes) or on data.split's validation "
        "part",
        "split": "with data.valid_paths, data.paths trains whole and data.valid_paths validates (Megatron's "
        "--train-data-path and --valid-data-path): unset data.split, or unset data.valid_paths to cut "
        "data.paths by the split",
        "pad_to_multiple_of": "pretraining samples are data.seq_length tokens each, never padded",
    },
    "sft": FINE_TUNING_INSTEAD,
    "classification": FINE_TUNING_INSTEAD,
    "mlm": {
        "split": "data.task=mlm trains on data.paths whole and validates on data.valid_file (a prefix)",
        "valid_paths": "data.task=mlm validates on data.valid_file (one prefix)",
        "train_file": "data.task=mlm reads a tokenized prefix, data.paths",
    },
    "dpo": {
        **FINE_TUNING_INSTEAD,
        "packing": "preference pairs are not packed",
        "assistant_only_loss": "DPO compares the log-probabilities of the answers alone",
    },
    "grpo": {
        **FINE_TUNING_INSTEAD,
        "valid_file": "data.task=grpo trains on the prompts of data.train_file and validates on none",
        "pad_to_multiple_of": "rollout batches are as long as their prompts and completions",
        "packing": "rollouts are not packed",
        "truncate": "a prompt that does not fit data.seq_length with grpo.max_completion_length is refused",
        "prompt_template": "a text prompt is used as it is, a chat prompt rendered by data.chat_template",
        "assistant_only_loss": "the loss is on the completions alone",
    },
}


def reads(task: str, data: Any) -> frozenset[str]:
    """The data keys `task` reads with `data` (a DataConfig) as set (see UNREAD_WITH)."""
    unread = {
        key
        for given, keys in UNREAD_WITH.get(task, {}).items()
        if getattr(data, given)
        for key in keys
    }
    return (READ_BY_ALL | READS[task]) - unread


def readers(key: str) -> list[str]:
    """The tasks that read data.`key` (with the other keys at their defaults)."""
    return [task for task, keys in READS.items() if key in READ_BY_ALL | keys]


def check_data_keys(data: Any) -> None:
    """UserError for the first key of `data` (a DataConfig) that data.task does not read yet is
    set away from its default. An unknown data.task is lmforge.train.tasks.get_task's to refuse."""
    if data.task not in READS:
        return
    default, read = type(data)(), reads(data.task, data)
    for f in dataclasses.fields(data):
        if f.name in read or getattr(data, f.name) == getattr(default, f.name):
            continue
        instead, names = INSTEAD[data.task].get(f.name), readers(f.name)
        if data.task in names:  # read by this task, but not with the other keys as set
            raise UserError(
                f"data.{f.name} is not read by data.task={data.task} as configured: {instead}"
            )
        fix = instead or (f"unset it, or set data.task={names[0]}" if names else "unset it")
        raise UserError(
            f"data.{f.name} is read by data.task={', '.join(names)}, not data.task={data.task}: {fix}"
        )
