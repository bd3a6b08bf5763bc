"""The GRPO page's Python block runs as written, and what it computes is what its comments say."""

from __future__ import annotations

import re
from pathlib import Path

import torch

PAGE = Path(__file__).resolve().parents[2] / "docs" / "rl.md"


def test_the_building_blocks_example_runs_and_trains():
    (code,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)
    scope: dict = {"__name__": "docs_rl"}
    exec(compile(code, str(PAGE), "exec"), scope)
    batch, count, model = scope["batch"], scope["count"], scope["model"]
    assert int(count) == int(batch.completion_mask.sum())  # dapo: the step's tokens
    assert batch.completion_ids.shape[0] == 8  # 2 prompts x num_generations 4
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and torch.stack([g.abs().sum() for g in grads]).sum() > 0
