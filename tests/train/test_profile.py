"""lmforge.train.profile: every op's self time lands in exactly one category, by what it is part of."""

from __future__ import annotations

import pytest
import torch

from lmforge.models import build
from lmforge.train.profile import OP_CATEGORIES, categorize, profile_step, profile_table
from lmforge.train.tasks import get_task


def test_a_step_is_split_into_categories_that_add_up():
    model = build("tiny-neox", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)  # per-tensor ops: mul_, lerp_ ...
    tokens = torch.randint(0, 1000, (2, 32))
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, 1)}

    def step():
        loss, count, _ = get_task("pretrain").loss(model, batch)
        (loss / count).backward()
        opt.step()
        opt.zero_grad()

    step()
    with torch.profiler.profile() as prof:
        step()
    parts = categorize(prof.events())
    gemms, _ = OP_CATEGORIES[0]
    loss_part, _ = OP_CATEGORIES[2]
    assert parts[gemms] > 0 and parts[loss_part] > 0 and parts["optimizer step"] > 0
    # The optimizer's elementwise ops count as the optimizer, not as "other ops".
    lerp = sum(e.self_cpu_time_total for e in prof.events() if e.name.startswith("aten::lerp_")) / 1e6
    assert 0 < lerp < parts["optimizer step"]
    # Nothing is counted twice or dropped: the categories add up to the events' total self time.
    total = sum(e.self_cpu_time_total for e in prof.events()) / 1e6
    assert sum(parts.values()) == pytest.approx(total, rel=1e-9)
    table = profile_table({"a": parts, "b": profile_step(step)})
    assert "| **step (profiled)** |" in table and gemms in table
