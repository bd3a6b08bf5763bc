"""AllocationMeter: the most tensor storage a piece of code holds at once, as torch ops hand it
out (the sharded import's workers and the one-process LoRA set-up measure their peaks with it)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocationMeter(TorchDispatchMode):
    """The peak bytes of tensor storage alive at once among the storages torch ops hand out while
    active (a DTensor counts its local piece). Tensors that safetensors maps from a file count
    too, whole, from the op that first returns them: an upper bound on what a load holds."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                local = t._local_tensor if isinstance(t, DTensor) else t
                if local.device.type != "meta":
                    storage = local.untyped_storage()
                    ref = StorageWeakRef(storage)
                    self.refs.setdefault(ref.cdata, (ref, storage.nbytes()))
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.refs.values()))
        return out
