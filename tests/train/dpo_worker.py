"""One rank of a DPO run under torchrun, which then reports how its frozen reference is held
(started by tests/train/test_dpo.py; not a test module): dpo_worker.py OUT.json key=value ...

Rank 0 writes {"reference": {name: [placements, local numel, requires_grad, has grad]} (None under
LoRA), "policy": {name: placements}, "in_optimizer": how many reference tensors the optimizer
holds}.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from lmforge.train.config import load_run_config
from lmforge.train.trainer import Trainer


def placements(p: torch.Tensor) -> str:
    return "".join(map(str, p.placements)) if hasattr(p, "placements") else "local"


def main() -> None:
    torch.set_num_threads(1)
    out, overrides = sys.argv[1], sys.argv[2:]
    trainer = Trainer(load_run_config(None, overrides))
    trainer.fit()
    reference = trainer.task.reference
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    report = {  # no reference model under LoRA (the policy's base is its reference)
        "reference": None
        if reference is None
        else {
            n: [
                placements(p),
                p.to_local().numel() if hasattr(p, "to_local") else p.numel(),
                p.requires_grad,
                p.grad is not None,
            ]
            for part in reference.parts
            for n, p in part.named_parameters()
        },
        "policy": {
            n: placements(p)
            for part in trainer.training.pm.parts
            for n, p in part.named_parameters()
        },
        "in_optimizer": 0
        if reference is None
        else sum(id(p) in optimized for p in reference.parameters()),
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/parallel/worker.py ends: a rare gloo abort at interpreter exit otherwise


if __name__ == "__main__":
    main()
