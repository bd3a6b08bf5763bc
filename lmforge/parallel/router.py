"""A mixture of experts' router losses (load balancing, z-loss) under tensor and pipeline
parallelism.

Under tensor parallelism the router is replicated and sees every token
(tensor_parallel.ExpertSlices), so each rank computes the one-process losses itself; only their sum
with a vocabulary-parallel loss (a DTensor) needs care: with_router_loss. Under pipeline parallelism
each stage holds some of the layers: PipelineRouterLosses.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from lmforge.models.router_losses import RouterSums, router_sums, take_router_logits


def with_router_loss(loss: torch.Tensor, router_loss: torch.Tensor | None) -> torch.Tensor:
    """loss + router_loss, where loss may be loss_parallel's replicated DTensor and router_loss
    (the same value on every tensor-parallel rank) a plain tensor: the sum to call backward on."""
    if router_loss is None:
        return loss
    if isinstance(loss, DTensor):
        router_loss = DTensor.from_local(
            router_loss.to(loss.dtype),
            loss.device_mesh,
            [Replicate()] * loss.device_mesh.ndim,
            run_check=False,
        )
    return loss + router_loss


class PipelineRouterLosses:
    """The router losses of a pipelined MoE model, in its loss and gradients as one process has
    them.

    The load-balancing loss is num_experts * sum_e f_e * P_e with f and P averaged over every MoE
    layer's tokens together, so it is no sum of per-stage losses: each stage's share of the gradient
    needs the choices of every stage. What it is made of is additive (RouterSums: choices,
    probabilities, z, rows per stage), and its gradient with respect to a stage's summed
    probabilities, coef * num_experts * f_e / rows, needs f only, which no gradient flows through.
    So each stage, after its forward of a microbatch, sends its sums to the other stages of its
    pipeline (a process group of their own, non-blocking: the schedule's messages are untouched),
    and its output carries a node (_RouterGrad) that, in the stage's backward, adds the router
    losses' gradient with respect to its own sums, the other stages' sums received by then: every
    stage's forward of a microbatch comes before any stage's backward of it. Per microbatch, scaled
    by 1 / microbatches: the mean over microbatches of coef x loss, as the trainer adds per
    micro-batch without a pipeline.
    """

    def __init__(self, parts: list, cfg, group, peers: list[int], device: torch.device):
        self.cfg, self.group, self.peers, self.device = cfg, group, peers, device
        self.parts = len(parts)
        self.active = False
        for index, part in enumerate(parts):
            part.register_forward_hook(
                functools.partial(self._after_forward, index), with_kwargs=True
            )

    def begin(self, microbatches: int) -> None:
        self.active, self.microbatches = True, microbatches
        self.forwards = [0] * self.parts
        self.local: dict[int, torch.Tensor] = {}
        self.done: dict[int, int] = {}
        self.sends: list = []
        self.totals: dict[int, torch.Tensor] = {}
        # aux, z: means over microbatches
        self.losses = torch.zeros(2, dtype=torch.float64, device=self.device)

    def end(self) -> torch.Tensor:
        """[aux loss, z-loss] of the step (means over microbatches), the same on every pipeline
        rank."""
        forwards = self.forwards[0]
        # a stage without MoE layers still receives, so every send completes
        self._total(forwards - 1)
        for work in self.sends:
            work.wait()
        self.active = False
        e = self.cfg.num_experts
        # torch's first step runs each stage once more, first, to learn the shapes it exchanges (a
        # forward and backward of its own, every stage alike): not a microbatch of the loss.
        for m in range(forwards - self.microbatches, forwards):
            total = self.totals[m]
            sums = RouterSums(total[:e], total[e : 2 * e], total[2 * e], total[2 * e + 1])
            self.losses += (
                torch.stack([sums.load_balancing_loss(e), sums.z_loss()]).double()
                / self.microbatches
            )
        return self.losses

    def _after_forward(self, index: int, module, args, kwargs, output):
        if not (self.active and module.training and torch.is_grad_enabled()):
            return None  # validation
        m = self.forwards[index]
        self.forwards[index] += 1
        logits = take_router_logits(module)
        e = self.cfg.num_experts
        mask = kwargs.get("attention_mask")
        sums = (
            router_sums(
                logits,
                self.cfg.experts_per_token,
                mask if mask is not None and mask.dim() == 2 else None,
            )
            if logits
            else None
        )
        vec = (
            torch.zeros(2 * e + 2, device=self.device)
            if sums is None
            else torch.cat(
                [
                    sums.choices,
                    sums.probs.detach(),
                    sums.z.detach().reshape(1),
                    sums.rows.reshape(1),
                ]
            )
        )
        self.local[m] = self.local[m] + vec if m in self.local else vec
        self.done[m] = self.done.get(m, 0) + 1
        if self.done[m] == self.parts:
            for peer in self.peers:
                self.sends.append(dist.isend(self.local[m], dst=peer, group=self.group, tag=m))
        if sums is None:
            return None
        return _RouterGrad.apply(output, sums.probs, sums.z, self, m)

    def _total(self, m: int) -> torch.Tensor:
        """Microbatch m's sums over the whole pipeline (received in microbatch order, once)."""
        while len(self.totals) <= m:
            k = len(self.totals)
            total = self.local[k].clone()
            for peer in self.peers:
                theirs = torch.empty_like(total)
                dist.recv(theirs, src=peer, group=self.group, tag=k)
                total += theirs
            self.totals[k] = total
        return self.totals[m]


class _RouterGrad(torch.autograd.Function):
    """The stage output unchanged; in backward, the router losses' gradient with respect to the
    stage's sums."""

    @staticmethod
    def forward(ctx, output, probs, z, sync: PipelineRouterLosses, m: int):
        ctx.sync, ctx.m = sync, m
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        sync = ctx.sync
        cfg, e, scale = sync.cfg, sync.cfg.num_experts, 1.0 / sync.microbatches
        total = sync._total(ctx.m)
        choices, rows = total[:e], total[2 * e + 1]
        grad_probs = cfg.router_aux_loss_coef * scale * e * choices / rows.square()
        grad_z = (cfg.router_z_loss_coef * scale / rows).reshape(())
        return grad_output, grad_probs, grad_z, None, None
