"""What differs between pretraining and fine-tuning, one Task object per kind of run:

    pretrain        Megatron GPT samples (tokens, labels already shifted)         tasks/pretrain.py
    sft             instruction/chat examples (labels -100 on prompts), packed    tasks/sft.py
    classification  text + label rows, a score/classifier head on the model      tasks/classification.py
    mlm             BERT masked-LM samples from a .bin/.idx prefix                tasks/mlm.py
    dpo             preference pairs (prompt, chosen, rejected), a frozen reference tasks/dpo.py
    grpo            prompts, rollouts on the live weights, rewards (lmforge.rl)   tasks/grpo.py

A Task says how its data is built, what the model is called with, what its loss is normalised by
and which validation metrics it reports (lmforge.train.tasks.base.Task). Adding a task is one file
here and one line in TASKS.
"""

from __future__ import annotations

import copy

from lmforge.config import closest
from lmforge.errors import UserError
from lmforge.train.tasks.base import Task, TaskData, count_tokens, logits_loss
from lmforge.train.tasks.classification import Classification
from lmforge.train.tasks.dpo import DPO
from lmforge.train.tasks.grpo import GRPO
from lmforge.train.tasks.mlm import MaskedLM
from lmforge.train.tasks.pretrain import Pretrain
from lmforge.train.tasks.sft import SFT

TASKS: dict[str, Task] = {
    task.name: task for task in (Pretrain(), SFT(), Classification(), MaskedLM(), DPO(), GRPO())
}


def get_task(name: str) -> Task:
    """A Task called `name` (data.task), the run's own instance; a UserError naming the choices
    for anything else."""
    if name not in TASKS:
        raise UserError(
            f"data.task='{name}' is not valid{closest(str(name), TASKS)}: choose one of {', '.join(TASKS)}"
        )
    return copy.copy(TASKS[name])


__all__ = ["TASKS", "Task", "TaskData", "count_tokens", "get_task", "logits_loss"]
