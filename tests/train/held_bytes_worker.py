"""The bytes one rank of a real run holds after one training step, what `lmforge plan` must equal
(used by tests/train/test_plan_lora.py; not a test module). Under torchrun: held_bytes_worker.py
OUT.json key=value ...

Counted from the trainer itself: its parameters and buffers (local pieces of DTensors; the task's
frozen reference model's too), the gradients once the step's backward has run, the optimizer state
once it has stepped. Rank 0 writes {"params", "reference", "grads", "optimizer", "trainable"}.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def local_bytes(tensors) -> int:
    """Bytes of the distinct tensors on this rank: a DTensor's local piece, a wrapper tensor
    (torchao's NF4) as the tensors it holds."""
    from torch.distributed.tensor import DTensor

    def size(t: torch.Tensor) -> int:
        if isinstance(t, DTensor):
            return size(t.to_local())
        if hasattr(t, "__tensor_flatten__"):
            return sum(size(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()

    return sum(map(size, {id(t): t for t in tensors if isinstance(t, torch.Tensor)}.values()))


def held_bytes(trainer) -> dict[str, int]:
    """One step of `trainer` (a lmforge Trainer) as its train_step runs it, and what its rank
    holds."""
    from lmforge.train.data import micro_batches

    t, training = trainer.cfg.trainer, trainer.training

    def model_bytes(pm) -> int:
        return local_bytes(x for part in pm.parts for x in [*part.parameters(), *part.buffers()])

    reference = trainer.task.reference
    held = {"reference": model_bytes(reference) if reference is not None else 0}
    held["params"] = model_bytes(training.pm) + held["reference"]
    held["trainable"] = sum(p.numel() for p in training.pm.parameters() if p.requires_grad)
    batches = micro_batches(
        trainer.data.train,
        0,
        t.global_batch_size,
        t.micro_batch_size,
        trainer.dp_rank,
        trainer.dp_size,
        0,
        trainer.data.collate,
    )
    micro = [next(batches) for _ in range(trainer.grad_accum)]
    training.step(micro, training.global_counts(micro), t.grad_clip)
    held["grads"] = local_bytes(p.grad for p in training.pm.parameters())
    trainer.optimizer.step()
    held["optimizer"] = local_bytes(
        v
        for o in trainer.optimizer.optimizers
        for state in o.state.values()
        for v in state.values()
    )
    return held


def main() -> None:
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    torch.set_num_threads(1)
    out, overrides = sys.argv[1], sys.argv[2:]
    trainer = Trainer(load_run_config(None, overrides))
    held = held_bytes(trainer)
    trainer.close()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(held, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/parallel/worker.py ends: a rare gloo abort at interpreter exit otherwise


if __name__ == "__main__":
    main()
