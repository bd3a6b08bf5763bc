"""What `lmforge plan` needs of each task that a run does not: a micro-batch of the task's form made
without its data, the labels of its head, the sequences an example holds, what it keeps beside the
model and a line saying so; and the run's code as a fake-tensor trace runs it (`as_traced`). The
tasks (lmforge.train.tasks) and the models know nothing of the plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from lmforge.train.config import RunConfig
from lmforge.train.tasks import Task

Batch = dict[str, torch.Tensor]


class TaskPlan:
    """A language-model task's (sft, mlm, and any task without a plan of its own)."""

    # the labels of the model's classification head for a run planned without its data (0: an
    # LM head)
    labels = 0
    rows_per_example = 1  # sequences per example of trainer.micro_batch_size

    def example_batch(self, rows: int, length: int, vocab_size: int, device: torch.device) -> Batch:
        """A collated micro-batch of the task's form, `rows` examples of `length` tokens made on
        `device`, every position a real, scored token."""
        rows *= self.rows_per_example
        ids = torch.randint(0, vocab_size, (rows, length), device=device)
        mask = torch.ones(rows, length, dtype=torch.long, device=device)
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}

    def reference(self, cfg: RunConfig) -> str | None:
        """What the plan sizes of the task's other model for the run `cfg`, in words; None: it
        holds none."""
        return None

    def line(self, reference: str | None, reference_size: str, sequences: int) -> str | None:
        """A line of the plan's report on what the task adds (`reference`: reference()'s,
        `reference_size`: what a rank holds of it, `sequences`: a micro-batch's), or None."""
        return None


class PretrainPlan(TaskPlan):
    def example_batch(self, rows: int, length: int, vocab_size: int, device: torch.device) -> Batch:
        tokens = torch.randint(0, vocab_size, (rows, length), device=device)
        return {"tokens": tokens, "labels": tokens.clone()}


class ClassificationPlan(TaskPlan):
    labels = 2

    def example_batch(self, rows: int, length: int, vocab_size: int, device: torch.device) -> Batch:
        batch = super().example_batch(rows, length, vocab_size, device)
        del batch["labels"]
        return {**batch, "label": torch.randint(0, self.labels, (rows,), device=device)}


class DPOPlan(TaskPlan):
    rows_per_example = 2  # a pair: chosen and rejected interleaved, as the collator lays them out

    def reference(self, cfg: RunConfig) -> str | None:
        return "base without adapters" if cfg.lora is not None else "frozen copy"

    def line(self, reference: str | None, reference_size: str, sequences: int) -> str | None:
        if reference == "frozen copy":
            held = (
                f"a frozen copy of the model laid out like the policy, {reference_size} of a rank's params without "
                "gradients or optimizer state (data files with ref_chosen_logps and ref_rejected_logps need none)"
            )
        else:
            held = "the base without its adapters, no second model"
        return (
            f"DPO: the reference is {held}; each micro-batch is {sequences} sequences (chosen and rejected) in one "
            "forward, after the reference's under no_grad"
        )


PLANS: dict[str, TaskPlan] = {
    "pretrain": PretrainPlan(),
    "classification": ClassificationPlan(),
    "dpo": DPOPlan(),
}


def task_plan(task: Task | str) -> TaskPlan:
    """The plan's side of `task` (a Task or its data.task name)."""
    return PLANS.get(task if isinstance(task, str) else task.name, TaskPlan())


def balanced_counts(flat: torch.Tensor, num_experts: int) -> list[int]:
    """Routing as a fake tensor has it: no values to count, so every expert gets an even share of
    the rows."""
    n = flat.numel()
    return [n // num_experts + (e < n % num_experts) for e in range(num_experts)]


@contextlib.contextmanager
def as_traced(init_model: Callable) -> Iterator[None]:
    """The run's code as the plan traces it: a task builds its other models with `init_model`
    (the meta-device builder at the traced depth) instead of lmforge.train.setup.init_model, and
    a mixture of experts routes its rows evenly (lmforge.models.moe.expert_counts reads the
    routing on the host, which fake tensors do not hold)."""
    from lmforge.models import moe
    from lmforge.train import setup

    saved = setup.init_model, moe.expert_counts
    setup.init_model, moe.expert_counts = init_model, balanced_counts
    try:
        yield
    finally:
        setup.init_model, moe.expert_counts = saved
