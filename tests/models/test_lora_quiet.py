"""apply_lora's line about what trains is the training run's: a checkpoint read for generate,
eval or export-hf wraps its model quietly, with the same adapters."""

from __future__ import annotations

import torch

from lmforge.models import build
from lmforge.models.lora import LoRAConfig, apply_lora


def test_quiet_wraps_alike_and_says_nothing(caplog):
    lora = LoRAConfig(rank=4, alpha=8, targets="all-linear")
    said, quiet = build("tiny-llama", seed=0), build("tiny-llama", seed=0)
    with caplog.at_level("INFO", logger="lmforge.models.lora"):
        trainable = apply_lora(said, lora, seed=1)
        lines = [r.getMessage() for r in caplog.records]
        caplog.clear()
        assert apply_lora(quiet, lora, seed=1, quiet=True) == trainable
    assert (
        len(lines) == 1
        and lines[0].startswith("LoRA rank 4 alpha 8 on ")
        and f"{trainable} trainable" in lines[0]
    )
    assert not caplog.records
    mine, theirs = said.state_dict(), quiet.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert [n for n, p in said.named_parameters() if p.requires_grad] == [
        n for n, p in quiet.named_parameters() if p.requires_grad
    ]
