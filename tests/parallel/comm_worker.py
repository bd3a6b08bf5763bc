"""Worker for test_comm_volume: one training step under DDP or FSDP2, the bytes this rank sent
through gloo measured from /proc/self/io, next to the analytic count. Run with torchrun."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from lmforge.models import build
from lmforge.parallel.comm_volume import Layout, bytes_sent, step_bytes
from lmforge.parallel.data_parallel import gradient_sync, init_world, wrap


def main(strategy: str, micro_batches: int, out: str) -> None:
    torch.set_num_threads(1)
    world = init_world()
    torch.manual_seed(0)
    model = build("tiny-neox")
    cfg = model.config
    model = wrap(model, strategy, world)
    seq, micro = 16, 2
    x = torch.randint(0, cfg.vocab_size, (micro_batches, micro, seq))

    def step() -> None:
        for i in range(micro_batches):
            with gradient_sync(model, i == micro_batches - 1):
                model(x[i]).float().mean().backward()

    step()  # the first step builds DDP buckets / FSDP buffers
    dist.barrier()
    before = bytes_sent()
    step()
    dist.barrier()
    sent = bytes_sent() - before
    layout = Layout(data=world.size, data_parallel=strategy)
    expected = step_bytes(cfg, layout, seq, micro * micro_batches * world.size, micro, param_bytes=4, grad_bytes=4,
                           reduce_scatter_as_all_reduce=True)
    result = {"rank": world.rank, "sent": sent, "expected": expected["data"]}
    gathered = [None] * world.size
    dist.all_gather_object(gathered, result)
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
