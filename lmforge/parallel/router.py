"""A mixture of experts' router losses (load balancing, z-loss) under tensor and pipeline parallelism.

Under tensor parallelism the router is replicated and sees every token (tensor_parallel.ExpertSlices), so each
rank computes the one-process losses itself; only their sum with a vocabulary-parallel loss (a DTensor) needs
care: with_router_loss.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate


def with_router_loss(loss: torch.Tensor, router_loss: torch.Tensor | None) -> torch.Tensor:
    """loss + router_loss, where loss may be loss_parallel's replicated DTensor and router_loss (the same value on
    every tensor-parallel rank) a plain tensor: the sum to call backward on."""
    if router_loss is None:
        return loss
    if isinstance(loss, DTensor):
        router_loss = DTensor.from_local(router_loss.to(loss.dtype), loss.device_mesh,
                                         [Replicate()] * loss.device_mesh.ndim, run_check=False)
    return loss + router_loss
