"""One rank of test_sharded_import.py (not a test module itself).

    sharded_import_worker.py SPEC.json OUT.json

For each case: build the model on the meta device, parallelize it, load_sharded from the case's
folder under an AllocationMeter, then compare every tensor this rank holds (gathered with
full_tensor) with the whole-model import (load_pretrained), and one training step's loss and
gradients with the same layout built the old way (the whole model on every rank, then parallelize).
A case with "lora" wraps the meta model with adapters first (apply_lora) and fills them after the
base (init_adapters), against apply_lora on the whole model; "fresh" initialises (init_sharded)
instead of reading the source. With "trainer", the Trainer runs the same training twice on this
layout: once as it now does (sharded, load_pretrained forbidden), once forced onto the whole-model
path, each set up under an AllocationMeter. Rank 0 writes every rank's results to OUT.json.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from meter import AllocationMeter  # tests/parallel/meter.py, beside this file
from torch.distributed.tensor import DTensor

# tests/parallel/worker.py, beside this file
from worker import ce_sum, finish, make_batch, parallel_step

from lmforge.models import build, load_pretrained
from lmforge.models.build import local_piece
from lmforge.models.hf.weights import HFWeights
from lmforge.models.lora import LoRAConfig, apply_lora, init_adapters, is_adapter
from lmforge.parallel import ParallelConfig, build_mesh, init_world, model_state_dict, parallelize
from lmforge.parallel.load import (
    LoadStats,
    init_sharded,
    load_sharded,
    local_tensors,
    source_config,
)

SEED = 1234  # the fresh weights' and the adapters' (a run's trainer.seed)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def whole_model(case: dict, cfg):
    """The old path: the whole model imported on this rank (load_pretrained), re-padded like the
    run's, or built fresh ("fresh"), then wrapped with the case's LoRA adapters (apply_lora) and
    their base dtype."""
    from lmforge.train.setup import with_vocab_multiple

    if case.get("fresh"):
        model = build(cfg, seed=SEED).train()
    else:
        model = with_vocab_multiple(
            load_pretrained(case.get("reference", case["source"])), cfg.make_vocab_size_divisible_by
        ).train()
    if "lora" in case:
        apply_lora(model, LoRAConfig(**case["lora"]), seed=SEED)
    return model


def fill(pm, case: dict) -> LoadStats:
    """The meta path: this rank's shards read from the case's source (or initialised, "fresh"),
    then its pieces of the LoRA adapters drawn (init_adapters)."""
    if case.get("fresh"):
        stats = LoadStats(init_sharded(pm, SEED), None, 0)
    else:
        stats = load_sharded(pm, case["source"])
    if "lora" in case:
        init_adapters(pm.parts, LoRAConfig(**case["lora"]), SEED)
    return stats


def nudge_lora_b(named_parameters) -> None:
    """Every adapter's B set to the same non-zero values whatever the layout (at init B = 0, and
    A gets no gradient): the step then trains A too."""
    with torch.no_grad():
        for name, p in named_parameters:
            if ".lora_B." in name:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                local, box = local_piece(p)
                local.copy_((torch.randn(p.shape, generator=g) * 0.1)[box])


def run_case(case: dict, meshes: dict) -> dict:
    cfg = dataclasses.replace(
        source_config(case["source"]), make_vocab_size_divisible_by=case["multiple"]
    )
    pcfg = ParallelConfig(**case["parallel"])
    key = json.dumps(case["parallel"], sort_keys=True)
    mesh = meshes.setdefault(key, build_mesh(pcfg, cfg))
    model = build(cfg, device="meta")
    if "lora" in case:  # wrapped on the meta device, as the Trainer does under a layout that shards
        apply_lora(model, LoRAConfig(**case["lora"]), seed=SEED)
    pm = parallelize(model, pcfg, mesh)
    hf_read: list[str] = []
    get = HFWeights.get
    HFWeights.get = lambda self, name: hf_read.append(name) or get(self, name)
    try:
        with AllocationMeter() as meter:
            stats = fill(pm, case)
    finally:
        HFWeights.get = get
    held = local_tensors(pm)
    with AllocationMeter() as control:  # the same meter must see a whole-model load
        whole = whole_model(case, cfg)
    expected = {n: t.detach().clone() for n, t in whole.state_dict(keep_vars=True).items()}
    buffers = dict(whole.named_buffers())
    mismatched = [
        n
        for n, t in held.items()
        if not torch.equal(t.full_tensor() if isinstance(t, DTensor) else t, expected[n])
    ]
    for part in pm.parts:  # non-persistent buffers too (rotary inv_freq), recomputed after to_empty
        mismatched += [n for n, b in part.named_buffers() if not torch.equal(b, buffers[n])]
    # The meta model's tensors that no part of this rank holds must never have been allocated.
    held_ids = {id(p) for part in pm.parts for p in part.parameters()}
    allocated_elsewhere = [
        n for n, p in model.named_parameters() if id(p) not in held_ids and not p.is_meta
    ]
    all_names: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_names, sorted(held))

    # One training step: the same layout built the old way (whole model on every rank, then
    # parallelize).
    batch = make_batch(cfg, seed=1)
    with torch.no_grad():
        single = whole_model(case, cfg)
        nudge_lora_b(single.named_parameters())
        ids, labels, kwargs = batch
        single_loss = (ce_sum(single(ids, **kwargs), labels) / (labels != -100).sum()).item()
    ref_pm = parallelize(whole, pcfg, mesh)
    for laid in (pm, ref_pm):
        nudge_lora_b(named(laid))
    loss, ref_loss = parallel_step(pm, mesh, batch), parallel_step(ref_pm, mesh, batch)
    ref_grads = {n: p.grad for n, p in named(ref_pm)}
    trained = [(n, p) for n, p in named(pm) if p.requires_grad]  # LoRA: the adapters alone
    grads_differ = [
        n
        for n, p in trained
        if p.grad is None
        or ref_grads[n] is None
        or not torch.equal(_local(p.grad), _local(ref_grads[n]))
    ]
    grads_differ += [n for n, p in named(pm) if not p.requires_grad and p.grad is not None]
    if "save_checkpoint" in case:  # a training checkpoint (DCP) of these weights, for a later case
        save_checkpoint(pm, cfg, Path(case["save_checkpoint"]))
    return {
        "mismatched": mismatched,
        "grads_differ": grads_differ,
        "allocated_elsewhere": allocated_elsewhere,
        "held": sorted(held),
        "all_held": sorted({n for names in all_names for n in names}),
        "expected_names": sorted(expected),
        "loss": loss,
        "ref_loss": ref_loss,
        "single_loss": single_loss,
        "trained": sorted(n for n, _ in trained),
        "zero_grads": sorted(
            n for n, p in trained if _local(p.grad).numel() and not _local(p.grad).abs().max() > 0
        ),
        "peak_bytes": meter.peak,
        "whole_load_peak": control.peak,
        "local_bytes": stats.local_bytes,
        "read_bytes": stats.read_bytes,
        "hf_read": hf_read,
        "source_bytes": stats.source_bytes,
        "whole_bytes": sum(nbytes(t) for t in expected.values()),
        "largest_bytes": max(nbytes(t) for t in expected.values()),
        # What the parts hold, counted here: parameters and every buffer, once each.
        "local_bytes_measured": sum(
            nbytes(_local(t))
            for t in {
                id(t): t for part in pm.parts for t in [*part.parameters(), *part.buffers()]
            }.values()
        ),
    }


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def named(pm):
    return [(n, p) for part in pm.parts for n, p in part.named_parameters()]


def save_checkpoint(pm, cfg, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from lmforge.models.io import write_config

    # The base alone: a LoRA case's adapters are no part of a checkpoint its meta path reads.
    dcp.save(
        {"model": {k: v.detach() for k, v in model_state_dict(pm).items() if not is_adapter(k)}},
        checkpoint_id=str(path),
    )
    dist.barrier()
    if dist.get_rank() == 0:
        (path / "trainer.json").write_text(json.dumps({"step": 0}))
        write_config(path, cfg)
    dist.barrier()


def run_trainer(spec: dict) -> dict:
    """The Trainer on this layout from an HF folder: sharded (load_pretrained must not be
    called), then forced onto the whole-model path; the test compares their metrics.jsonl.
    Returns the peak bytes an AllocationMeter saw while each Trainer was set up (model built,
    laid out and filled; no step yet), and the bytes of the whole model and of its largest
    tensor."""
    from lmforge.train import setup, trainer
    from lmforge.train.config import load_run_config

    def forbidden(*args, **kwargs):
        raise AssertionError(
            "the sharded path called load_pretrained: a rank built the whole model"
        )

    def fit(run: str) -> int:
        with AllocationMeter() as meter:
            t = trainer.Trainer(
                load_run_config(None, [*spec["args"], f"run_dir={spec['dir']}/{run}"])
            )
        t.fit()
        return meter.peak

    original = setup.load_pretrained
    setup.load_pretrained = forbidden
    try:
        sharded = fit("sharded")
    finally:
        setup.load_pretrained = original
    init_model = trainer.init_model
    trainer.init_model = lambda cfg, num_labels=0, meta=False, **kw: init_model(
        cfg, num_labels, meta=False, **kw
    )
    try:
        whole = fit("whole")
    finally:
        trainer.init_model = init_model
    source = next(a.split("=", 1)[1] for a in spec["args"] if a.startswith("model.init_from="))
    tensors = load_pretrained(source).state_dict().values()
    return {
        "sharded_peak": sharded,
        "whole_peak": whole,
        "whole_bytes": sum(nbytes(t) for t in tensors),
        "largest_bytes": max(nbytes(t) for t in tensors),
    }


def main() -> None:
    torch.set_num_threads(1)
    spec = json.loads(Path(sys.argv[1]).read_text())
    world = init_world(timeout_minutes=2)
    meshes: dict = {}
    results = {name: run_case(case, meshes) for name, case in spec["cases"].items()}
    if "trainer" in spec:
        results["trainer"] = run_trainer(spec["trainer"])
    gathered: list = [None] * world.size
    dist.all_gather_object(gathered, results)
    if world.rank == 0:
        Path(sys.argv[2]).write_text(json.dumps(gathered))
    dist.barrier()
    finish(0)


if __name__ == "__main__":
    main()
