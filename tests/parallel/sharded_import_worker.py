"""One rank of test_sharded_import.py (not a test module itself).

    sharded_import_worker.py SPEC.json OUT.json

For each case: build the model on the meta device, parallelize it, load_sharded from the case's folder
under an AllocationMeter, then compare every tensor this rank holds (gathered with full_tensor) with the
whole-model import (load_pretrained), and one training step's loss and gradients with the same layout
built the old way (the whole model on every rank, then parallelize). With "trainer", the Trainer runs the
same pretraining twice on this layout: once as it now does (sharded, load_pretrained forbidden), once
forced onto the whole-model path. Rank 0 writes every rank's results to OUT.json.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from worker import ce_sum, finish, make_batch, parallel_step  # tests/parallel/worker.py, beside this file

from lmforge.models import build, load_pretrained
from lmforge.models.hf.weights import HFWeights
from lmforge.parallel import ParallelConfig, build_mesh, init_world, model_state_dict, parallelize
from lmforge.parallel.load import load_sharded, local_tensors, source_config


class AllocationMeter(TorchDispatchMode):
    """The peak bytes of tensor storage alive at once among the storages torch ops hand out while active
    (a DTensor counts its local piece). Tensors that safetensors maps from a file count too, whole, from
    the op that first returns them: an upper bound on what a load holds."""

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


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def whole_model(case: dict, cfg):
    """The old path: the whole model imported on this rank (load_pretrained), re-padded like the run's."""
    from lmforge.train.setup import with_vocab_multiple

    return with_vocab_multiple(load_pretrained(case.get("reference", case["source"])),
                               cfg.make_vocab_size_divisible_by).train()


def run_case(case: dict, meshes: dict) -> dict:
    cfg = dataclasses.replace(source_config(case["source"]), make_vocab_size_divisible_by=case["multiple"])
    pcfg = ParallelConfig(**case["parallel"])
    key = json.dumps(case["parallel"], sort_keys=True)
    mesh = meshes.setdefault(key, build_mesh(pcfg, cfg))
    model = build(cfg, device="meta")
    pm = parallelize(model, pcfg, mesh)
    hf_read: list[str] = []
    get = HFWeights.get
    HFWeights.get = lambda self, name: hf_read.append(name) or get(self, name)
    try:
        with AllocationMeter() as meter:
            stats = load_sharded(pm, case["source"])
    finally:
        HFWeights.get = get
    held = local_tensors(pm)
    with AllocationMeter() as control:  # the same meter must see a whole-model load
        whole = whole_model(case, cfg)
    expected = {n: t.detach().clone() for n, t in whole.state_dict(keep_vars=True).items()}
    buffers = dict(whole.named_buffers())
    mismatched = [n for n, t in held.items()
                  if not torch.equal(t.full_tensor() if isinstance(t, DTensor) else t, expected[n])]
    for part in pm.parts:  # non-persistent buffers too (rotary inv_freq), recomputed after to_empty
        mismatched += [n for n, b in part.named_buffers() if not torch.equal(b, buffers[n])]
    # The meta model's tensors that no part of this rank holds must never have been allocated.
    held_ids = {id(p) for part in pm.parts for p in part.parameters()}
    allocated_elsewhere = [n for n, p in model.named_parameters() if id(p) not in held_ids and not p.is_meta]
    all_names: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_names, sorted(held))

    # One training step: the same layout built the old way (whole model on every rank, then parallelize).
    batch = make_batch(cfg, seed=1)
    with torch.no_grad():
        single = whole_model(case, cfg)
        ids, labels, kwargs = batch
        single_loss = (ce_sum(single(ids, **kwargs), labels) / (labels != -100).sum()).item()
    ref_pm = parallelize(whole, pcfg, mesh)
    loss, ref_loss = parallel_step(pm, mesh, batch), parallel_step(ref_pm, mesh, batch)
    ref_grads = {n: p.grad for part in ref_pm.parts for n, p in part.named_parameters()}
    grads_differ = [n for part in pm.parts for n, p in part.named_parameters()
                    if not torch.equal(_local(p.grad), _local(ref_grads[n]))]
    if "save_checkpoint" in case:  # a training checkpoint (DCP) of these weights, for a later case
        save_checkpoint(pm, cfg, Path(case["save_checkpoint"]))
    return {
        "mismatched": mismatched, "grads_differ": grads_differ, "allocated_elsewhere": allocated_elsewhere,
        "held": sorted(held), "all_held": sorted({n for names in all_names for n in names}),
        "expected_names": sorted(expected),
        "loss": loss, "ref_loss": ref_loss, "single_loss": single_loss,
        "peak_bytes": meter.peak, "whole_load_peak": control.peak, "local_bytes": stats.local_bytes,
        "read_bytes": stats.read_bytes, "hf_read": hf_read, "source_bytes": stats.source_bytes,
        "whole_bytes": sum(nbytes(t) for t in expected.values()),
        "largest_bytes": max(nbytes(t) for t in expected.values()),
        # What the parts hold, counted here: parameters and every buffer, once each.
        "local_bytes_measured": sum(nbytes(_local(t)) for t in {id(t): t for part in pm.parts for t in
                                                                 [*part.parameters(), *part.buffers()]}.values()),
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def save_checkpoint(pm, cfg, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from lmforge.models.io import write_config

    dcp.save({"model": {k: v.detach() for k, v in model_state_dict(pm).items()}}, checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (path / "trainer.json").write_text(json.dumps({"step": 0}))
        write_config(path, cfg)
    dist.barrier()


def run_trainer(spec: dict) -> None:
    """The Trainer on this layout from an HF folder: sharded (load_pretrained must not be called), then
    forced onto the whole-model path; the test compares their metrics.jsonl."""
    from lmforge.train import setup, trainer
    from lmforge.train.config import load_run_config

    def forbidden(*args, **kwargs):
        raise AssertionError("the sharded path called load_pretrained: a rank built the whole model")

    original = setup.load_pretrained
    setup.load_pretrained = forbidden
    try:
        trainer.Trainer(load_run_config(None, [*spec["args"], f"run_dir={spec['dir']}/sharded"])).fit()
    finally:
        setup.load_pretrained = original
    init_model = trainer.init_model
    trainer.init_model = lambda cfg, num_labels=0, meta=False, **kw: init_model(cfg, num_labels, meta=False, **kw)
    try:
        trainer.Trainer(load_run_config(None, [*spec["args"], f"run_dir={spec['dir']}/whole"])).fit()
    finally:
        trainer.init_model = init_model


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    world = init_world(timeout_minutes=2)
    meshes: dict = {}
    results = {name: run_case(case, meshes) for name, case in spec["cases"].items()}
    if "trainer" in spec:
        run_trainer(spec["trainer"])
    gathered: list = [None] * world.size
    dist.all_gather_object(gathered, results)
    if world.rank == 0:
        Path(sys.argv[2]).write_text(json.dumps(gathered))
    dist.barrier()
    finish(0)


if __name__ == "__main__":
    main()
