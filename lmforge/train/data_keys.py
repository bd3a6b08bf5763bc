"""The data.* keys a task reads, and the refusal of the others: a key set to anything but its default that the run's
task never reads is a mistake (data.valid_file under pretraining validated on nothing it named), said in one line
when the config is read.

Each Task declares what it reads (`Task.data_keys`, beyond READ_BY_ALL) and, for keys it does not read, what to use
instead (`Task.instead`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lmforge.errors import UserError

READ_BY_ALL = frozenset({"task", "seq_length", "tokenizer", "num_workers"})


def readers(key: str) -> list[str]:
    """The tasks that read data.`key` (with the others at their defaults)."""
    from lmforge.train.config import DataConfig
    from lmforge.train.tasks import TASKS

    return [name for name, task in TASKS.items() if key in task.reads(DataConfig())]


def check_data_keys(cfg: Any) -> None:
    """UserError for the first data key that `cfg.data.task` does not read yet is set away from its default."""
    from lmforge.train.config import DataConfig
    from lmforge.train.tasks import get_task

    task, data, default = get_task(cfg.data.task), cfg.data, DataConfig()
    reads = READ_BY_ALL | task.reads(data)
    for f in dataclasses.fields(DataConfig):
        if f.name in reads or getattr(data, f.name) == getattr(default, f.name):
            continue
        instead = task.instead.get(f.name)
        names = readers(f.name)
        if task.name in names:  # read by this task, but not with the other keys as set
            raise UserError(f"data.{f.name} is not read by data.task={task.name} as configured: {instead}")
        fix = instead or (f"unset it, or set data.task={names[0]}" if names else "unset it")
        raise UserError(f"data.{f.name} is read by data.task={', '.join(names)}, not data.task={task.name}: {fix}")
