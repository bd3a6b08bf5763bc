"""LoRA adapters under tensor parallelism: the tensor-parallel styles of a LoRALinear
(lmforge.models.lora).

A LoRA module computes y = x W^T + b + s * (x A^T) B^T. Megatron's split of W decides the adapters'
(the layout NeMo and torchtitan-style LoRA use, which keeps every collective the base layer makes
and adds none of size out or in):

    column-parallel W (rows split)   A replicated (rank, in);  B split by rows like W (out / TP, rank)
                                     each rank computes its own rows of the update, as of y
    row-parallel W (columns split)   A split by columns like W (rank, in / TP);  B replicated (out, rank)
                                     x A^T is a partial sum over the ranks like x W^T; the (tokens, rank)
                                     partial sums are reduced before B, the layer's own reduction after

For q/k/v adapters on a fused qkv, each part's B rows are in lmforge's grouped layout ([kv_heads,
per group, head_dim]), so a contiguous split of a part's B hands each rank the rows of its own
key/value groups: exactly the rows of the fused qkv it holds. The module's forward is the same code
on DTensors; gradients of a replicated A (or B) come out summed over the ranks by DTensor, as a
replicated norm weight's do.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lmforge.models.lora import LoRALinear


class LoRAParallel(ParallelStyle):
    """A LoRALinear split as a column- or row-parallel linear (`like`: the base layer's torch
    style, whose input and output layouts it keeps), its adapters split to match (see the module
    docstring)."""

    def __init__(self, like: ColwiseParallel | RowwiseParallel):
        super().__init__()
        self.column = isinstance(like, ColwiseParallel)
        self.input_layout: Placement = like.input_layouts[0]
        self.output_layout: Placement = like.output_layouts[0]
        self.use_local_output = like.use_local_output
        # Where the weight is split, and then A and B (see the module docstring).
        self.weight, self.a, self.b = (
            (Shard(0), Replicate(), Shard(0)) if self.column else (Shard(1), Shard(1), Replicate())
        )

    def _partition(self, name: str, module: nn.Module, mesh) -> None:
        if isinstance(module, LoRALinear):
            placements = {"weight": self.weight, "bias": Shard(0) if self.column else Replicate()}
        elif name in ("lora_A", "lora_B"):
            placements = dict.fromkeys(module._parameters, self.a if name == "lora_A" else self.b)
        else:
            return
        for key, placement in placements.items():
            param = module._parameters.get(key)
            if param is not None and not isinstance(param, DTensor):
                module.register_parameter(
                    key,
                    nn.Parameter(
                        distribute_tensor(param, mesh, [placement]),
                        requires_grad=param.requires_grad,
                    ),
                )

    def _input(self, module, inputs, mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
        want = Replicate() if self.column else Shard(-1)
        if x.placements[0] != want:
            x = x.redistribute(mesh, [want])
        return (x, *inputs[1:])

    def _output(self, module, output, mesh):
        if output.placements[0] != self.output_layout:
            output = output.redistribute(mesh, [self.output_layout])
        return output.to_local() if self.use_local_output else output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, LoRALinear):
            raise TypeError(f"LoRAParallel applies to a LoRALinear, not {type(module).__name__}")
        return distribute_module(
            module, device_mesh, self._partition, input_fn=self._input, output_fn=self._output
        )


def with_lora(block: nn.Module, plan: dict) -> dict:
    """`plan` (a block's tensor-parallel plan) with each LoRA-wrapped linear's style made a
    LoRAParallel."""
    out = {}
    for path, style in plan.items():
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and isinstance(
            block.get_submodule(path), LoRALinear
        ):
            style = LoRAParallel(style)
        out[path] = style
    return out
