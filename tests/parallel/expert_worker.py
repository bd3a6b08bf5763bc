"""One rank of the expert-parallel dispatch test (started by launch.run_ranks). Not a test module
itself.

    expert_worker.py OUT.json

One MoE layer, its experts over the ranks (parallel.expert = world size); each rank routes tokens of
its own. For each routing (a random router; one that sends every token to rank 0's experts, so the
other ranks receive no rows) it compares the dispatched-and-combined output with the dense
expert-by-expert reference (lmforge.models.moe.dense_reference), and the gradients of x, the router
and the experts with the reference's over every rank's tokens. A router that duplicates a token's
expert is run too: its error must be large (the comparison sees a token gone to the wrong place).
Rank 0 writes the worst errors to OUT.json.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lmforge.models import preset
from lmforge.models.moe import MoE, dense_reference
from lmforge.parallel import ParallelConfig, build_mesh, init_world
from lmforge.parallel.expert import apply_expert_parallel
from lmforge.parallel.mesh import expert_mesh

TOKENS = 12


def make_layer(cfg, skewed: bool) -> MoE:
    layer = MoE(cfg, F.silu)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        if skewed:  # with x > 0: experts 0 and 1 (rank 0's) score highest for every token
            layer.router.weight.copy_(
                torch.where(torch.arange(cfg.num_experts)[:, None] < 2, 1.0, -1.0).expand_as(
                    layer.router.weight
                )
            )
    return layer


def tokens(cfg, rank: int, skewed: bool) -> torch.Tensor:
    x = torch.randn(TOKENS, cfg.hidden_size, generator=torch.Generator().manual_seed(100 + rank))
    return x.abs() if skewed else x


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def check(cfg, mesh, rank: int, world: int, skewed: bool, duplicate: bool = False) -> dict:
    layer = make_layer(cfg, skewed)
    ref = copy.deepcopy(layer)
    apply_expert_parallel(layer, mesh, world)
    if duplicate:  # a broken router: every token's second choice replaced by its first
        route = layer.route

        def duplicating(x):
            logits, weights, chosen = route(x)
            return logits, weights, chosen[:, :1].expand_as(chosen)

        layer.route = duplicating
    xs = [tokens(cfg, r, skewed).requires_grad_() for r in range(world)]
    grads = [
        torch.randn(TOKENS, cfg.hidden_size, generator=torch.Generator().manual_seed(200 + r))
        for r in range(world)
    ]
    x = xs[rank].detach().clone().requires_grad_()
    out = layer(x)
    (out * grads[rank]).sum().backward()
    want = [dense_reference(ref, xr) for xr in xs]  # the reference over every rank's tokens
    sum((w * g).sum() for w, g in zip(want, grads, strict=True)).backward()
    local = cfg.num_experts // world
    experts = slice(rank * local, (rank + 1) * local)
    errors = {
        "out": rel(out.detach(), want[rank].detach()),
        "x_grad": rel(x.grad, xs[rank].grad),
        "router_grad": rel(layer.router.weight.grad, ref_router_grad(ref, xs, grads, rank)),
        # Each rank's expert gradient is the step's (divided by the data-parallel size, as DDP/FSDP
        # average).
        "gate_up_grad": rel(
            layer.experts.gate_up.grad.to_local() * world, ref.experts.gate_up.grad[experts]
        ),
        "down_grad": rel(
            layer.experts.down.grad.to_local() * world, ref.experts.down.grad[experts]
        ),
    }
    # skewed: 1, rank 0's experts only
    errors["top_expert"] = float(max(ref.route(xr)[2].max() for xr in xs))
    worst = torch.tensor(list(errors.values()))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(errors, worst.tolist(), strict=True))


def ref_router_grad(ref: MoE, xs, grads, rank: int) -> torch.Tensor:
    """The router gradient of this rank's tokens alone (the router is data-parallel: each rank's
    own share)."""
    one = copy.deepcopy(ref)
    one.zero_grad()
    (dense_reference(one, xs[rank].detach()) * grads[rank]).sum().backward()
    return one.router.weight.grad


def main() -> None:
    torch.set_num_threads(1)
    world = init_world(timeout_minutes=2)
    cfg = preset("tiny-qwen3-moe")  # 8 experts, 2 per token
    layout = ParallelConfig(expert=world.size)
    mesh = expert_mesh(build_mesh(layout, cfg), layout.resolved(world.size))
    results = {
        name: check(cfg, mesh, world.rank, world.size, **kwargs)
        for name, kwargs in {
            "random": {"skewed": False},
            "skewed": {"skewed": True},
            "duplicating": {"skewed": False, "duplicate": True},
        }.items()
    }
    dist.barrier()
    if world.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
