"""One rank of the context-parallel training tests (started by launch.torchrun). Not a test module.

    context_train_worker.py OUT_DIR CASE...   CASE: name=override,override,... (parallel.* keys)

For each case: the run's model laid out as the trainer lays it out (lmforge.train.transforms.
lay_out_model, the run config's layout over this world), one training step on a packed global
batch, and rank 0 writes the step's loss, gradient norm and every parameter's whole gradient to
OUT_DIR/NAME.pt; the test compares them with one process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# A tiny Llama (4 query heads over 2 key/value heads), fp32, SFT on packed rows.
BASE = [
    "model.preset=tiny-llama",
    "data.task=sft",
    "data.seq_length=32",
    "trainer.precision=fp32",
    "trainer.micro_batch_size=2",
    "trainer.global_batch_size=4",
]
SEQ = 32
# Each row's packed examples; documents straddle the chunk boundaries of C = 2 and 4, the last
# row ends in padding.
LENGTHS = [[9, 14, 9], [20, 8], [3, 29], [32]]


def global_batch() -> list[dict[str, torch.Tensor]]:
    """The packed rows as the SFT collator gives them (labels on the inputs' own positions: the
    task shifts them), -100 on each example's first two tokens (a prompt) and on the padding."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for lengths in LENGTHS:
        item = {
            "input_ids": torch.zeros(SEQ, dtype=torch.int64),
            "labels": torch.full((SEQ,), -100, dtype=torch.int64),
            "attention_mask": torch.zeros(SEQ, dtype=torch.int64),
            "position_ids": torch.zeros(SEQ, dtype=torch.int64),
            "segment_ids": torch.zeros(SEQ, dtype=torch.int64),
        }
        start = 0
        for segment, n in enumerate(lengths, start=1):
            end = start + n
            ids = torch.randint(1, 1000, (n,), generator=g)
            item["input_ids"][start:end] = ids
            item["labels"][start + 2 : end] = ids[2:]
            item["attention_mask"][start:end] = 1
            item["position_ids"][start:end] = torch.arange(n)
            item["segment_ids"][start:end] = segment
            start = end
        rows.append(item)
    return [{k: torch.stack([r[k] for r in rows[i : i + 2]]) for k in rows[0]} for i in (0, 2)]


def train_step(overrides: list[str], world: int, run_dir: Path):
    """(the laid-out ParallelTraining, loss, grad norm) after one step of the global batch."""
    from lmforge.models import build
    from lmforge.parallel.mesh import build_mesh
    from lmforge.train.config import load_run_config, parallel_layout
    from lmforge.train.tasks import get_task
    from lmforge.train.transforms import lay_out_model

    cfg = load_run_config(None, [*BASE, *overrides])
    layout = parallel_layout(cfg, world)
    mcfg = cfg.model.resolve()
    mesh = build_mesh(layout, mcfg, world_size=world, device_type="cpu")
    model = build(mcfg, seed=0)
    task = get_task("sft")
    training = lay_out_model(
        model, None, cfg, layout, mesh, task, cfg.precision, torch.device("cpu"), run_dir
    )
    # each data-parallel rank its micro-batch of the two (a context group: the same one)
    micro = global_batch()
    if training.dp_size > 1:
        micro = [micro[training.dp_rank]]
    loss, norm = training.step(micro, training.global_counts(micro), max_norm=0.0)
    return training, loss, norm


def gradients(training) -> dict[str, torch.Tensor]:
    out = {}
    for part in training.pm.parts:
        for name, p in part.named_parameters():
            g = p.grad
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def main(out: str, cases: list[str]) -> None:
    from lmforge.parallel import init_world

    torch.set_num_threads(1)
    world = init_world("cpu")
    for case in cases:
        name, _, spec = case.partition("=")
        training, loss, norm = train_step(spec.split(","), world.size, Path(out) / name)
        grads = gradients(training)
        if world.rank == 0:
            torch.save({"loss": loss, "norm": norm, "grads": grads}, Path(out) / f"{name}.pt")
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
