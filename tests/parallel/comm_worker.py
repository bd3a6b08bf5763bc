"""Worker for test_comm_volume: one training step under DDP or FSDP2, or under tensor (and sequence) or
pipeline parallelism, the bytes this rank sent through gloo measured from /proc/self/io, next to the
analytic count. Run with torchrun:

    comm_worker.py ddp|fsdp MICRO_BATCHES OUT.json
    comm_worker.py mesh LAYOUTS.json OUT.json     each layout: tensor, pipeline, sequence_parallel, micro_batches
    comm_worker.py expert OUT.json                parallel.expert=2, the rest under DDP, then FSDP2
    comm_worker.py expert_tp OUT.json             parallel.expert=2 x tensor=2, with sequence parallelism and without
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from lmforge.models import build
from lmforge.parallel.comm_volume import Layout, bytes_sent, expert_bytes, step_bytes
from lmforge.parallel.data_parallel import gradient_sync, init_world


def _write(world, results, out: str) -> None:
    gathered = [None] * world.size
    dist.all_gather_object(gathered, results)
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def mesh_layout(spec: dict, world) -> dict:
    """One step of `spec`'s layout on a tiny NeoX (fp32, untied head): bytes sent vs the analytic
    count of the layout's own dimension (tensor or pipeline); the data dimension is 1."""
    from dataclasses import replace

    import torch.nn.functional as F

    from lmforge.models import preset
    from lmforge.parallel import ParallelConfig, build_mesh, parallelize, pipeline_step

    # Activations of 2 x 64 x 256 fp32: large beside gloo's few hundred bytes of framing per
    # collective.
    model = build(
        replace(
            preset("tiny-neox"), num_layers=4, hidden_size=256, head_dim=64, intermediate_size=512
        ),
        seed=0,
    )
    cfg = model.config
    schedule = (
        {"pipeline_schedule": "interleaved_1f1b", "virtual_stages": 2}
        if spec.get("virtual_stages")
        else {}
    )
    pcfg = ParallelConfig(
        tensor=spec["tensor"],
        pipeline=spec["pipeline"],
        data_shard=1,
        sequence_parallel=spec["sequence_parallel"],
        microbatches=spec["micro_batches"],
        **schedule,
    )
    pm = parallelize(model, pcfg, build_mesh(pcfg, cfg))
    seq, micro, n = 64, 2, spec["micro_batches"]
    x = torch.randint(0, cfg.vocab_size, (n * micro, seq))

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")

    def step() -> None:
        if pm.pipelined:  # all micro batches in one pipeline step
            pipeline_step(pm, x, x, loss_fn)
        else:
            for i in range(n):
                pipeline_step(
                    pm, x[i * micro : (i + 1) * micro], x[i * micro : (i + 1) * micro], loss_fn
                )

    step()  # the first step infers the pipeline's shapes
    dist.barrier()
    before = bytes_sent()
    step()
    dist.barrier()
    sent = bytes_sent() - before
    layout = Layout(
        tensor=spec["tensor"],
        pipeline=spec["pipeline"],
        sequence_parallel=spec["sequence_parallel"],
        virtual_stages=spec.get("virtual_stages", 1),
    )
    v = step_bytes(
        cfg,
        layout,
        seq,
        micro * n,
        micro,
        param_bytes=4,
        grad_bytes=4,
        activation_bytes=4,
        reduce_scatter_as_all_reduce=True,
    )
    return {"rank": world.rank, "layout": spec, "sent": sent, "expected": v["total"], "by_dim": v}


def expert_layout(world, strategy: str) -> dict:
    """One step (two accumulation micro-batches) of a Mixtral-shaped MoE (fp32) with
    parallel.expert=2 over the ranks, the rest under DDP or FSDP2: bytes sent vs data
    parallelism's count for the other weights plus expert_bytes with the rows really routed
    (all-to-alls) and the experts' own reduction: under DDP an all-reduce over the ranks holding
    the same experts, under FSDP2 their all-gathers per micro-batch and one reduce-scatter per
    step (4 ranks: each expert sharded over 2)."""
    from dataclasses import replace

    from lmforge.models import preset
    from lmforge.parallel import ParallelConfig, build_mesh, parallelize

    # Rows of 256 fp32 values: large beside gloo's framing of the all-to-alls (four per layer and
    # micro-batch).
    cfg = replace(
        preset("tiny-mixtral"),
        hidden_size=256,
        head_dim=64,
        intermediate_size=256,
        moe_intermediate_size=256,
    )
    model = build(cfg, seed=0)
    expert, accumulate = 2, 2
    pcfg = ParallelConfig(
        expert=expert,
        **({"data_replicate": world.size, "data_shard": 1} if strategy == "ddp" else {}),
    )
    pm = parallelize(model, pcfg, build_mesh(pcfg, cfg))
    # rows sent to and received from other ranks, per MoE layer forward
    routed = record_routed(model, expert)
    seq, micro = 64, 2
    x = torch.randint(
        0,
        cfg.vocab_size,
        (accumulate, micro, seq),
        generator=torch.Generator().manual_seed(world.rank),
    )

    def step() -> None:
        for i in range(accumulate):
            with gradient_sync(pm.parts[0], i == accumulate - 1):
                pm(x[i]).float().mean().backward()

    step()  # DDP's buckets, FSDP's buffers
    routed.clear()
    dist.barrier()
    before = bytes_sent()
    step()
    dist.barrier()
    sent = bytes_sent() - before
    layout = Layout(data=world.size, data_parallel=strategy, expert=expert)
    dense = step_bytes(
        cfg,
        layout,
        seq,
        micro * accumulate * world.size,
        micro,
        param_bytes=4,
        grad_bytes=4,
        reduce_scatter_as_all_reduce=True,
    )["data"]
    v = expert_bytes(
        cfg,
        expert,
        world.size,
        micro * seq,
        accumulate,
        activation_bytes=4,
        routed=sum(routed),
        data_parallel=strategy,
        param_bytes=4,
        reduce_scatter_as_all_reduce=True,
    )
    return {
        "rank": world.rank,
        "strategy": strategy,
        "sent": sent,
        "expected": dense + sum(v.values()),
        "dense": dense,
        **v,
    }


def record_routed(model, expert: int) -> list[int]:
    """A list that receives, per MoE layer forward, the rows this rank sent to and received from
    the other ranks of its ep group (from the dispatch's counts)."""
    from lmforge.models.moe import moe_layers

    routed: list[int] = []
    for layer in moe_layers(model):
        counts, me = layer.dispatch._counts, dist.get_rank(layer.dispatch.group)

        def recording(flat, counts=counts, me=me):
            sent, received = counts(flat)
            routed.append(sum(sum(sent[r]) + sum(received[r]) for r in range(expert) if r != me))
            return sent, received

        layer.dispatch._counts = recording
    return routed


def expert_tensor_layout(world, sequence_parallel: bool) -> dict:
    """One step (two accumulation micro-batches) of a Mixtral-shaped MoE (fp32) at
    parallel.expert=2 x tensor=2 on 4 ranks, the rest FSDP2 over the 2 data ranks: each expert on
    one data rank, nothing to reduce over ranks holding the same ones; bytes sent vs the data,
    tensor and expert counts of step_bytes (the all-to-alls with the rows really routed)."""
    from dataclasses import replace

    import torch.nn.functional as F

    from lmforge.models import preset
    from lmforge.parallel import ParallelConfig, build_mesh, parallelize, pipeline_step

    cfg = replace(
        preset("tiny-mixtral"),
        hidden_size=256,
        head_dim=64,
        intermediate_size=256,
        moe_intermediate_size=256,
    )
    model = build(cfg, seed=0)
    expert, tensor, accumulate = 2, 2, 2
    pcfg = ParallelConfig(expert=expert, tensor=tensor, sequence_parallel=sequence_parallel)
    pm = parallelize(model, pcfg, build_mesh(pcfg, cfg))
    routed = record_routed(model, expert)
    seq, micro, data = 64, 2, world.size // tensor
    # a data rank's tensor-parallel ranks read the same
    g = torch.Generator().manual_seed(world.rank // tensor)
    x = torch.randint(0, cfg.vocab_size, (accumulate, micro, seq), generator=g)

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")

    def step() -> None:
        for i in range(accumulate):
            with gradient_sync(pm.parts[0], i == accumulate - 1):
                pipeline_step(pm, x[i], x[i], loss_fn)

    step()
    routed.clear()
    dist.barrier()
    before = bytes_sent()
    step()
    dist.barrier()
    sent = bytes_sent() - before
    layout = Layout(
        tensor=tensor,
        data=data,
        data_parallel="fsdp",
        expert=expert,
        sequence_parallel=sequence_parallel,
    )
    v = step_bytes(
        cfg,
        layout,
        seq,
        micro * accumulate * data,
        micro,
        param_bytes=4,
        grad_bytes=4,
        activation_bytes=4,
        reduce_scatter_as_all_reduce=True,
    )
    e = expert_bytes(
        cfg,
        expert,
        data,
        micro * seq,
        accumulate,
        activation_bytes=4,
        routed=sum(routed),
        data_parallel="fsdp",
        param_bytes=4,
        tensor=tensor,
        reduce_scatter_as_all_reduce=True,
    )
    return {
        "rank": world.rank,
        "sequence_parallel": sequence_parallel,
        "sent": sent,
        "expected": v["data"] + v["tensor"] + sum(e.values()),
        "data": v["data"],
        "tensor": v["tensor"],
        **e,
    }


def main(strategy: str, micro_batches: int, out: str) -> None:
    torch.set_num_threads(1)
    world = init_world()
    torch.manual_seed(0)
    model = build("tiny-neox")
    cfg = model.config
    from lmforge.parallel import ParallelConfig, build_mesh, parallelize

    # The trainer's data-parallel plans: DDP over replicas, or FSDP2 over shards.
    layout = (
        ParallelConfig(data_replicate=world.size, data_shard=1)
        if strategy == "ddp"
        else ParallelConfig()
    )
    model = parallelize(model, layout, build_mesh(layout, cfg)).parts[0]
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
    expected = step_bytes(
        cfg,
        layout,
        seq,
        micro * micro_batches * world.size,
        micro,
        param_bytes=4,
        grad_bytes=4,
        reduce_scatter_as_all_reduce=True,
    )
    _write(world, {"rank": world.rank, "sent": sent, "expected": expected["data"]}, out)


if __name__ == "__main__":
    if sys.argv[1] == "mesh":
        torch.set_num_threads(1)
        w = init_world()
        _write(
            w, [mesh_layout(spec, w) for spec in json.loads(open(sys.argv[2]).read())], sys.argv[3]
        )
    if sys.argv[1] == "expert":
        torch.set_num_threads(1)
        w = init_world()
        _write(w, [expert_layout(w, strategy) for strategy in ("ddp", "fsdp")], sys.argv[2])
    if sys.argv[1] == "expert_tp":
        torch.set_num_threads(1)
        w = init_world()
        _write(w, [expert_tensor_layout(w, sp) for sp in (True, False)], sys.argv[2])
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
