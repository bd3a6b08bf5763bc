"""Expert parallelism: a mixture-of-experts layer's experts split over `parallel.expert`
data-parallel ranks.

Ranks are grouped in blocks of E neighbouring data-parallel ranks (an "ep" group; the mesh's
innermost data ranks, the fastest links, as Megatron and torchtitan place it; a pipeline stage's own
under pipeline parallelism). Rank j of a group holds experts [j * L, (j + 1) * L), L = num_experts /
E, as a DTensor Shard(0) over "ep", so checkpoints and exports see whole weights. A MoE layer's
forward, on every rank of a group:

1. route its own tokens (the router is an ordinary, data-parallel weight);
2. sort its (token, expert) pairs by expert, tell each rank how many rows it will get for each of
   its experts (one all-to-all of counts), send the rows (all-to-all with split sizes);
3. regroup the rows received by local expert, run them through the grouped expert GEMMs;
4. send the outputs back the way they came (the inverse all-to-all) and weight and sum them per
   token there.

The backward runs the same exchanges in reverse, so each rank's expert gradient holds the
contributions of the tokens of its whole group. The D / E ranks holding the same experts (D the
data-parallel size, one rank per group) sum their gradients once per step (after the last gradient
accumulation micro-batch), divided by D: with the loss of each rank scaled as data parallelism
expects (its average over ranks is the step's loss), that is the gradient of one process on the
global batch. How they do it follows the rest of the model (lmforge.parallel.mesh. expert_mesh lays
them out as ("ep_replicate", "ep", "ep_shard")):

- under DDP every one of them holds its experts whole and all-reduces their gradients
  (_ReduceExpertGrad);
- under FSDP2 / HSDP the experts are FSDP2 units of their own (torchtitan's "dp_shard_mod_ep"):
  their stacked weights, gradients and optimizer state sharded over the "ep_shard" ranks holding the
  same experts (data_shard / E of them; 1 where E does not divide data_shard) and replicated over
  "ep_replicate" (HSDP's replicas), gathered for each forward and backward, gradients
  reduce-scattered (and all-reduced over the replicas). Through a pipeline too: the schedule defers
  FSDP's reductions to the step's last backward.

DDP and the other FSDP2 units leave the expert weights to this module and handle every other weight
as before.

Beside tensor parallelism (T ranks; Megatron's expert-tensor parallelism with its size equal to TP,
torchtitan's ETP = TP) the expert mesh is ("ep_replicate", "ep", "tp", "ep_shard"): an ep group is E
data ranks of one tensor-parallel coordinate, and each expert's intermediate rows are split over
"tp" as tensor parallelism alone splits them (gate_up and down Shard(2), LoRA factors as
tensor_parallel.expert_tp_placement says). The router is replicated (tensor_parallel.ExpertSlices):
the T ranks of a data rank see the same tokens and route them alike, so each dispatches the whole
micro-batch to the ranks of its own tensor coordinate, which run their rows of their experts; the
combined output is a partial sum over the T ranks, reduced by ExpertSlices' all-reduce
(reduce-scatter under sequence parallelism) as without expert parallelism. Gradients:

- the tokens' and the routing weights' from the experts are partial sums over "tp": all-reduced
  there in the backward, every micro-batch, before they reach the attention and the router (as
  tensor parallelism alone does);
- the router, a replicated weight on every tensor rank, is data parallelism's like the other
  replicated weights;
- LoRA factors that hold no intermediate rows (gate_up's A, down's B) are whole on every tensor rank
  and their gradient is each rank's share: summed over "tp" (every micro-batch), then reduced like
  the rest of the expert;
- each expert slice's gradient is reduced over the D / E ranks holding the same slice, once per
  step, divided by D, as above: "tp" takes no part in it. FSDP2 shards a slice over "ep_shard" by
  expert, or along its widest dimension where a rank has fewer experts than shard ranks (its
  intermediate rows too: "tp" comes before "ep_shard" in the mesh, so both splits of that dimension
  make one box).
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
from lmforge.parallel.mesh import dim_mesh, dim_size, fsdp_shards_experts
from lmforge.parallel.tensor_parallel import expert_tp_placement, grad_summed

log = logging.getLogger(__name__)


class _AllToAll(torch.autograd.Function):
    """Rows exchanged within `group`: in_splits[j] rows to rank j, out_splits[j] rows from it;
    the backward sends the gradients back the same way."""

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
    """Identity forward; the backward sums the gradient over the ranks holding the same experts
    and divides it by the data-parallel size (what DDP/FSDP do for the other weights, over their
    whole group). On a gradient accumulation micro-batch but the last (dispatch.sync False:
    lmforge.parallel.data_parallel.gradient_sync) it keeps the gradient aside instead and reduces
    it with the last one's: one all-reduce per step."""

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
    """MoE.dispatch under expert parallelism: grouped_experts' arguments and result, the experts
    spread over the ranks of `group` (this rank is `rank` of `size`, holding experts [rank *
    local, (rank + 1) * local)). `fsdp`: FSDP2 reduces the experts' gradients (shard_experts);
    else this rank does (_ReduceExpertGrad)."""

    def __init__(
        self,
        num_experts: int,
        group,
        replicate_group,
        data_parallel: int,
        mesh=None,
        fsdp: bool = False,
        tp_mesh=None,
    ):
        self.group, self.replicate_group, self.data_parallel = group, replicate_group, data_parallel
        self.mesh, self.fsdp, self.tp_mesh = mesh, fsdp, tp_mesh
        self.size = dist.get_world_size(group)
        self.num_experts, self.local = num_experts, num_experts // self.size
        self.sync = True  # reduce the experts' gradients in this backward (see _ReduceExpertGrad)
        # gradients kept from accumulation micro-batches, by weight
        self.pending: dict[str, torch.Tensor] = {}

    def __call__(
        self,
        x: torch.Tensor,
        chosen: torch.Tensor,
        weights: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor],
        lora: ExpertLoRA | None = None,
    ) -> torch.Tensor:
        dtype = (
            torch.get_autocast_dtype(x.device.type)
            if torch.is_autocast_enabled(x.device.type)
            else x.dtype
        )
        # the adapters' factors are split and reduced like the weights they adapt
        if lora is not None:
            lora = lora.map(lambda name, t: self._local(t, name, dtype))
        # this rank's intermediate rows give partial sums of these gradients
        if self.tp_mesh is not None:
            x, weights = grad_summed(x, self.tp_mesh), grad_summed(weights, self.tp_mesh)
        with torch.autocast(x.device.type, enabled=False):
            return self._forward(
                x.to(dtype),
                chosen,
                weights.to(dtype),
                self._local(gate_up, "gate_up", dtype),
                self._local(down, "down", dtype),
                act,
                lora,
            )

    def _local(self, w: torch.Tensor, key: str, dtype: torch.dtype) -> torch.Tensor:
        # under FSDP2: the gathered experts of this rank
        local = w.to_local() if isinstance(w, DTensor) else w
        local = local if self.fsdp else _ReduceExpertGrad.apply(local, self, key)
        if self.tp_mesh is not None and isinstance(expert_tp_placement(key), Replicate):
            # a LoRA factor whole on every tensor-parallel rank
            local = grad_summed(local, self.tp_mesh)
        return local.to(dtype)

    def _forward(self, x, chosen, weights, gate_up, down, act, lora):
        tokens, k = chosen.shape
        flat = chosen.reshape(-1)
        # pairs by expert: rank 0's experts' rows first
        order = torch.sort(flat, stable=True).indices
        counts_host, received_host = self._counts(flat)
        send = [sum(row) for row in counts_host]
        recv = [sum(row) for row in received_host]
        rows = _AllToAll.apply(x.index_select(0, order // k), recv, send, self.group)
        # Received by source rank, then local expert: regroup by local expert (each expert's rows
        # one block, sources in rank order) for the grouped GEMMs.
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.local, device=x.device).repeat(self.size),
            torch.tensor(received_host, device=x.device).reshape(-1),
            output_size=sum(recv),
        )
        by_expert = torch.sort(expert_of_row, stable=True).indices
        per_expert = [sum(received_host[s][e] for s in range(self.size)) for e in range(self.local)]
        y = expert_rows(rows.index_select(0, by_expert), gate_up, down, per_expert, act, lora)
        back = torch.empty_like(by_expert)
        back[by_expert] = torch.arange(by_expert.shape[0], device=by_expert.device)
        # in `order`, on the source rank
        y = _AllToAll.apply(y.index_select(0, back), send, recv, self.group)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0], device=order.device)
        return (y.index_select(0, inverse).view(tokens, k, y.shape[1]) * weights[..., None]).sum(1)

    def _counts(self, flat: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
        """(rows this rank sends each rank's experts, rows it receives from each rank for its
        experts), each (ranks, local experts): one all-to-all of the counts, and the layer's one
        host sync."""
        # lmforge plan traces on fake tensors: no routing to count, take it balanced
        # everywhere
        if is_fake(flat):
            n, e = flat.numel(), self.num_experts
            counts = [n // e + (i < n % e) for i in range(e)]
            sent = [counts[r * self.local : (r + 1) * self.local] for r in range(self.size)]
            rank = dist.get_rank(self.group)
            return sent, [sent[rank]] * self.size
        counts = torch.bincount(flat, minlength=self.num_experts)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        both = torch.stack([counts, received]).view(2, self.size, self.local).tolist()
        return both[0], both[1]


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The stacked expert weights (and their LoRA factors) whose gradients expert parallelism
    reduces itself (DDP/FSDP leave them to it); none without it (tensor parallelism's expert
    slices are DTensors too, and stay FSDP's), none where the experts are FSDP2 units of their
    own (shard_experts: the model's FSDP2 units then skip them as nested units)."""
    return {
        p
        for layer in moe_layers(model)
        if isinstance(layer.dispatch, ExpertDispatch) and not layer.dispatch.fsdp
        for p in layer.experts.parameters()
    }


def apply_expert_parallel(
    model: nn.Module, ep_mesh, data_parallel: int, fsdp: bool = False
) -> None:
    """Lay each MoE layer's experts over `ep_mesh` (lmforge.parallel.mesh.expert_mesh:
    ("ep_replicate", "ep", "ep_shard"), with "tp" before "ep_shard" under tensor parallelism):
    Shard(0) over "ep", their intermediate rows over "tp" as tensor parallelism alone splits them
    (tensor_parallel.expert_tp_placement), replicated over the others (until shard_experts shards
    them over "ep_shard"); its forward then dispatches tokens with all-to-all. `fsdp`: the rest
    of the model is FSDP2's, and so will the experts be wherever other ranks hold the same ones
    (shard_experts, which apply_fsdp calls); else their gradients are all-reduced here. `model`
    is built identically on every rank (or on the meta device, filled afterwards by
    lmforge.parallel.load). Under tensor parallelism the router and the reduction after the
    combine are tensor_parallel.ExpertSlices', applied afterwards."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    group = ep_mesh.get_group("ep")
    # ranks holding the same experts
    same = dim_size(ep_mesh, "ep_replicate") * dim_size(ep_mesh, "ep_shard")
    if fsdp and same > 1 and not fsdp_shards_experts():
        log.warning(
            "torch %s's FSDP2 cannot shard expert-parallel weights (2.12's can): each expert is kept whole on "
            "its %d data-parallel ranks and its gradients all-reduced over them",
            torch.__version__,
            same,
        )
    fsdp = fsdp and same > 1 and fsdp_shards_experts()
    if not fsdp and dim_size(ep_mesh, "ep_shard") > 1:
        raise RuntimeError("experts laid out for FSDP2 (ep_shard > 1) under a plan without it")
    replicate = ep_mesh.get_group("ep_replicate") if same > 1 and not fsdp else None
    tp_mesh = dim_mesh(ep_mesh, "tp") if "tp" in ep_mesh.mesh_dim_names else None
    size = dim_size(ep_mesh, "ep")
    layers = moe_layers(model)
    for layer in layers:
        # The stacked weights, and any LoRA factors of theirs (lmforge.models.lora_experts: expert
        # dim first too).
        experts = layer.experts
        for name, p in list(experts.named_parameters()):
            owner, _, attr = name.rpartition(".")
            placements = tuple(
                Shard(0)
                if dim == "ep"
                else expert_tp_placement(name)
                if dim == "tp"
                else Replicate()
                for dim in ep_mesh.mesh_dim_names
            )
            shape, offset = compute_local_shape_and_global_offset(p.shape, ep_mesh, placements)
            local = (
                torch.empty(shape, device="meta", dtype=p.dtype)
                if p.device.type == "meta"
                else p.detach()[
                    tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                ].clone()
            )
            sharded = DTensor.from_local(
                local,
                ep_mesh,
                placements,
                run_check=False,
                shape=p.shape,
                stride=torch.empty(p.shape, device="meta").stride(),
            )
            setattr(experts.get_submodule(owner), attr, _parameter(sharded, p.requires_grad))
        layer.dispatch = ExpertDispatch(
            layer.num_experts, group, replicate, data_parallel, ep_mesh, fsdp, tp_mesh
        )
    if layers:
        tp = (
            f", each expert's rows over {tp_mesh.size()} tensor-parallel ranks"
            if tp_mesh is not None
            else ""
        )
        holders = (
            f"each expert held by {same} ranks, its gradients all-reduced over them"
            if same > 1 and not fsdp
            else f"each expert's ranks FSDP2 over {dim_size(ep_mesh, 'ep_shard')} x "
            f"{dim_size(ep_mesh, 'ep_replicate')} replicas"
            if fsdp
            else "each expert on one rank"
        )
        log.info(
            "expert parallel: %d experts per layer over %d ranks (%d each%s); %s",
            layers[0].num_experts,
            size,
            layers[0].num_experts // size,
            tp,
            holders,
        )


def _parameter(t: DTensor, requires_grad: bool) -> nn.Parameter:
    """nn.Parameter(t) on t's own mesh object. Parameter() detaches t, and DTensor answers the
    detach from its cache of sharding decisions, whose mesh is whichever equal mesh came first:
    one of an earlier parallelize, or of an earlier world in this process whose process groups
    are gone (lmforge plan's and the tests' fake worlds). FSDP2's SPMD mode (shard_experts)
    requires the very mesh it is given and takes its process groups."""
    param = nn.Parameter(t, requires_grad=requires_grad)
    param._spec = t._spec
    return param


def shard_experts(part: nn.Module, reshard_after_forward: bool = True, mp_policy=None) -> None:
    """FSDP2 on each MoE layer's experts in `part` that apply_expert_parallel left to it: a unit
    of its own on the expert mesh, sharded over "ep_shard" and replicated over "ep_replicate"
    (HSDP), nested in its block's unit (call this before fully_shard on the blocks). Gradients
    are summed over both and divided by the data-parallel size, not FSDP's own (ep_shard x
    ep_replicate ranks): each rank's expert gradient holds its whole ep group's tokens already.
    Sums and one division rather than NCCL's PREMUL_SUM, which gloo lacks."""
    for layer in moe_layers(part):
        dispatch = layer.dispatch
        if not isinstance(dispatch, ExpertDispatch) or not dispatch.fsdp:
            continue
        # torch 2.12+ (fsdp_shards_experts)
        from torch.distributed.fsdp import DataParallelMeshDims, fully_shard

        mesh = dispatch.mesh  # the weights' own (_parameter): FSDP2 wants that very object
        shard, replicate = dim_size(mesh, "ep_shard"), dim_size(mesh, "ep_replicate")
        # A shard dim always, of one rank where nothing divides (HSDP, replicated): torch 2.13's
        # replicate-only mode (DDPMeshInfo) takes no shard_placement_fn.
        dims = DataParallelMeshDims(
            shard="ep_shard", replicate="ep_replicate" if replicate > 1 else None
        )
        kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
        kwargs["shard_placement_fn"] = lambda p, n=shard: expert_shard_placement(p, n)
        fully_shard(
            layer.experts,
            mesh=mesh,
            dp_mesh_dims=dims,
            reshard_after_forward=reshard_after_forward,
            **kwargs,
        )
        layer.experts.set_gradient_divide_factor(float(dispatch.data_parallel))
        # Over one shard rank torch 2.13 divides by the factor at the copy standing in for the
        # reduce-scatter and, with sums forced, again after the all-reduce (no PREMUL_SUM there).
        layer.experts.set_force_sum_reduction_for_comms(shard > 1)


def expert_shard_placement(p: torch.Tensor, shards: int) -> Shard:
    """FSDP2's split of stacked experts (experts, ...; a rank's own under expert parallelism)
    over `shards` ranks: by expert where they divide evenly, else (fewer experts than shards:
    Mixtral's 8 over 16 ranks) along the largest other dimension that does, so every rank holds
    an equal piece (FSDP2 would pad dimension 0, leaving some ranks a whole expert and others
    nothing: twice the expert bytes per rank)."""
    local = p.to_local().shape if isinstance(p, DTensor) else p.shape
    if local[0] % shards == 0:
        return Shard(0)
    even = [d for d in range(1, len(local)) if local[d] % shards == 0]
    return Shard(max(even, key=lambda d: local[d])) if even else Shard(0)
