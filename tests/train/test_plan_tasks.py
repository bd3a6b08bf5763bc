"""lmforge.train.plan_tasks: the plan's side of each task (its example batch is one the task
itself reads), and the run's code as the trace runs it, put back afterwards."""

from __future__ import annotations

import pytest
import torch

from lmforge.train.plan_tasks import as_traced, balanced_counts, task_plan
from lmforge.train.tasks import TASKS, get_task

ROWS, LENGTH = 3, 8


@pytest.mark.parametrize("name", list(TASKS))
def test_each_tasks_example_batch_is_a_batch_of_its_own_form(name):
    """The task reads the plan's batch as it reads a collated one: its inputs, and its count of
    what it scores (every token of every row, every next token under SFT's shifted labels, every
    example of a classifier, every pair of DPO)."""
    task, plan = get_task(name), task_plan(name)
    batch = plan.example_batch(ROWS, LENGTH, 50, torch.device("cpu"))
    ids, labels, _ = task.inputs(batch)
    assert ids.shape == (ROWS * plan.rows_per_example, LENGTH)
    expected = {"classification": ROWS, "dpo": ROWS, "sft": ROWS * (LENGTH - 1)}.get(
        name, ROWS * LENGTH
    )
    assert task.count(batch) == expected
    assert plan.labels == (2 if name == "classification" else 0)


def test_only_dpo_says_what_it_holds_beside_the_model():
    from lmforge.train.config import load_run_config

    cfg = load_run_config(None, ["model.preset=tiny-llama"])
    assert task_plan("dpo").reference(cfg) == "frozen copy"
    assert "frozen copy" in task_plan("dpo").line("frozen copy", "1.00 MiB", 4)
    assert all(task_plan(n).reference(cfg) is None for n in TASKS if n != "dpo")


def test_the_trace_routes_experts_evenly_and_puts_the_run_code_back():
    """Inside as_traced a mixture of experts counts its routing as an even split (fake tensors
    hold no ids to count) and a task builds other models with the plan's builder; outside,
    torch.bincount's counts and the run's own init_model."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lmforge.models import moe
    from lmforge.train import setup

    real_counts, real_init = moe.expert_counts, setup.init_model
    flat = torch.tensor([0, 0, 0, 1, 3, 3, 3])
    assert moe.expert_counts(flat, 4) == torch.bincount(flat, minlength=4).tolist() == [3, 1, 0, 3]

    def builder(*args, **kwargs):
        raise AssertionError("not called here")

    with as_traced(builder):
        assert setup.init_model is builder
        with FakeTensorMode():
            routed = torch.empty(7, dtype=torch.long)
            assert moe.expert_counts(routed, 4) == [2, 2, 2, 1]
    assert moe.expert_counts is real_counts and setup.init_model is real_init
    assert balanced_counts(torch.empty(8), 4) == [2, 2, 2, 2]
