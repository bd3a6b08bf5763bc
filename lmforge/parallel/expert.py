"""Expert parallelism: a mixture-of-experts layer's experts split over `parallel.expert` data-parallel ranks.

Ranks are grouped in blocks of E neighbouring data-parallel ranks (an "ep" group; the mesh's innermost data
ranks, the fastest links, as Megatron and torchtitan place it). Rank j of a group holds experts
[j * L, (j + 1) * L), L = num_experts / E, as a DTensor Shard(0) over "ep" (Replicate over "ep_replicate", the
groups), so checkpoints and exports see whole weights. A MoE layer's forward, on every rank of a group:

1. route its own tokens (the router is an ordinary, data-parallel weight);
2. sort its (token, expert) pairs by expert, tell each rank how many rows it will get for each of its experts
   (one all-to-all of counts), send the rows (all-to-all with split sizes);
3. regroup the rows received by local expert, run them through the grouped expert GEMMs;
4. send the outputs back the way they came (the inverse all-to-all) and weight and sum them per token there.

The backward runs the same exchanges in reverse, so each rank's expert gradient holds the contributions of the
tokens of its whole group. The ranks holding the same experts (one per group) sum their gradients (once per step,
after the last gradient accumulation micro-batch), divided by the data-parallel size: with the loss of each rank
scaled as data parallelism expects (its average over ranks is the step's loss), that is the gradient of one process
on the global batch. DDP and FSDP2 leave the expert weights to this module (ignored there) and handle every other
weight as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Replicate, Shard

from lmforge.models.moe import ExpertLoRA, expert_rows, moe_layers

log = logging.getLogger(__name__)


class _AllToAll(torch.autograd.Function):
    """Rows exchanged within `group`: in_splits[j] rows to rank j, out_splits[j] rows from it; the backward sends
    the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        grad_x = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_x, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_x, None, None, None


class _ReduceExpertGrad(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the ranks holding the same experts and divides it by
    the data-parallel size (what DDP/FSDP do for the other weights, over their whole group). On a gradient
    accumulation micro-batch but the last (dispatch.sync False: lmforge.parallel.data_parallel.gradient_sync) it
    keeps the gradient aside instead and reduces it with the last one's: one all-reduce per step."""

    @staticmethod
    def forward(ctx, w, dispatch, key):
        ctx.dispatch, ctx.key = dispatch, key
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        dispatch, key = ctx.dispatch, ctx.key
        held = dispatch.pending.pop(key, None)
        grad = grad.contiguous() if held is None else held + grad
        if not dispatch.sync:
            dispatch.pending[key] = grad
            return None, None, None  # no gradient yet: the parameter's .grad stays as it is
        if dispatch.replicate_group is not None:
            dist.all_reduce(grad, group=dispatch.replicate_group)
        return grad / dispatch.data_parallel, None, None


class ExpertDispatch:
    """MoE.dispatch under expert parallelism: grouped_experts' arguments and result, the experts spread over
    the ranks of `group` (this rank is `rank` of `size`, holding experts [rank * local, (rank + 1) * local))."""

    def __init__(self, num_experts: int, group, replicate_group, data_parallel: int):
        self.group, self.replicate_group, self.data_parallel = group, replicate_group, data_parallel
        self.size = dist.get_world_size(group)
        self.num_experts, self.local = num_experts, num_experts // self.size
        self.sync = True  # reduce the experts' gradients in this backward (see _ReduceExpertGrad)
        self.pending: dict[str, torch.Tensor] = {}  # gradients kept from accumulation micro-batches, by weight

    def __call__(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], lora: ExpertLoRA | None = None,
                 ) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        if lora is not None:  # the adapters' factors are split and reduced like the weights they adapt
            lora = lora.map(lambda name, t: self._local(t, name, dtype))
        with torch.autocast(x.device.type, enabled=False):
            return self._forward(x.to(dtype), chosen, weights.to(dtype), self._local(gate_up, "gate_up", dtype),
                                 self._local(down, "down", dtype), act, lora)

    def _local(self, w: torch.Tensor, key: str, dtype: torch.dtype) -> torch.Tensor:
        local = w.to_local() if isinstance(w, DTensor) else w
        return _ReduceExpertGrad.apply(local, self, key).to(dtype)

    def _forward(self, x, chosen, weights, gate_up, down, act, lora):
        tokens, k = chosen.shape
        flat = chosen.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # pairs by expert: rank 0's experts' rows first
        counts_host, received_host = self._counts(flat)
        send = [sum(row) for row in counts_host]
        recv = [sum(row) for row in received_host]
        rows = _AllToAll.apply(x.index_select(0, order // k), recv, send, self.group)
        # Received by source rank, then local expert: regroup by local expert (each expert's rows one block,
        # sources in rank order) for the grouped GEMMs.
        expert_of_row = torch.repeat_interleave(torch.arange(self.local, device=x.device).repeat(self.size),
                                                torch.tensor(received_host, device=x.device).reshape(-1),
                                                output_size=sum(recv))
        by_expert = torch.sort(expert_of_row, stable=True).indices
        per_expert = [sum(received_host[s][e] for s in range(self.size)) for e in range(self.local)]
        y = expert_rows(rows.index_select(0, by_expert), gate_up, down, per_expert, act, lora)
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.shape[0], device=by_expert.device)
        y = _AllToAll.apply(y.index_select(0, back), send, recv, self.group)  # in `order`, on the source rank
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0], device=order.device)
        return (y.index_select(0, inverse).view(tokens, k, y.shape[1]) * weights[..., None]).sum(1)

    def _counts(self, flat: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
        """(rows this rank sends each rank's experts, rows it receives from each rank for its experts), each
        (ranks, local experts): one all-to-all of the counts, and the layer's one host sync."""
        if is_fake(flat):  # lmforge plan traces on fake tensors: no routing to count, take it balanced everywhere
            n, e = flat.numel(), self.num_experts
            counts = [n // e + (i < n % e) for i in range(e)]
            sent = [counts[r * self.local:(r + 1) * self.local] for r in range(self.size)]
            rank = dist.get_rank(self.group)
            return sent, [sent[rank]] * self.size
        counts = torch.bincount(flat, minlength=self.num_experts)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        both = torch.stack([counts, received]).view(2, self.size, self.local).tolist()
        return both[0], both[1]


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The stacked expert weights (and their LoRA factors) that expert parallelism laid out (DDP/FSDP leave them to
    it); none without it (tensor parallelism's expert slices are DTensors too, and stay FSDP's)."""
    return {p for layer in moe_layers(model) if isinstance(layer.dispatch, ExpertDispatch)
            for p in layer.experts.parameters()}


def apply_expert_parallel(model: nn.Module, ep_mesh, data_parallel: int) -> None:
    """Lay each MoE layer's experts over `ep_mesh` (dims ("ep_replicate", "ep")): Shard(0) over "ep", replicated
    over "ep_replicate"; its forward then dispatches tokens with all-to-all. `model` is built identically on every
    rank (or on the meta device, filled afterwards by lmforge.parallel.load)."""
    group = ep_mesh["ep"].get_group()
    replicate = ep_mesh["ep_replicate"].get_group() if ep_mesh["ep_replicate"].size() > 1 else None
    placements = (Replicate(), Shard(0))
    layers = moe_layers(model)
    for layer in layers:
        # The stacked weights, and any LoRA factors of theirs (lmforge.models.lora_experts: expert dim first too).
        for name, p in list(layer.experts.named_parameters()):
            owner, _, attr = name.rpartition(".")
            size, rank = ep_mesh["ep"].size(), ep_mesh["ep"].get_local_rank()
            local = p.detach().chunk(size, dim=0)[rank].clone() if p.device.type != "meta" else \
                torch.empty((p.shape[0] // size, *p.shape[1:]), device="meta", dtype=p.dtype)
            sharded = DTensor.from_local(local, ep_mesh, placements, run_check=False, shape=p.shape,
                                         stride=torch.empty(p.shape, device="meta").stride())
            layer.experts.get_submodule(owner).register_parameter(attr, nn.Parameter(sharded,
                                                                                     requires_grad=p.requires_grad))
        layer.dispatch = ExpertDispatch(layer.num_experts, group, replicate, data_parallel)
    if layers:
        log.info("expert parallel: %d experts per layer over %d ranks (%d each), %d replica groups",
                 layers[0].num_experts, ep_mesh["ep"].size(), layers[0].num_experts // ep_mesh["ep"].size(),
                 ep_mesh["ep_replicate"].size())
