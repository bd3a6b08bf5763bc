"""Runs `lmforge plan` cases in a process of its own (the stand-in device it registers on a
CPU-only torch must come before the process's first backward, and stays registered):
plan_worker.py SPEC.json OUT.json.

SPEC: {"cases": {name: {"config", "overrides", "world", "device_memory"?, "patch"?, "shallow"?}}}
(patch: one of the functions here); OUT: per name {"plan": Plan.to_json()} or {"error": exception
type, "message": first line}."""

from __future__ import annotations

import json
import sys

import torch


def cpu_counts():
    """The defect of the first GPU audit: the step's label count reduced as a CPU tensor."""
    from lmforge.parallel.mesh import all_reduce_data_parallel
    from lmforge.train.step import ParallelTraining
    from lmforge.train.tasks import count_tokens

    def global_counts(self, micro):
        counts = torch.tensor(
            [sum(self.task.count(b) for b in micro), sum(count_tokens(b) for b in micro)],
            dtype=torch.float64,
        )
        return all_reduce_data_parallel(counts, self.mesh).tolist()

    ParallelTraining.global_counts = global_counts


def cpu_term():
    """A one-element CPU tensor (no scalar: torch mixes 0-d CPU tensors in) added to the device
    loss."""
    from lmforge.train.tasks.pretrain import Pretrain

    loss = Pretrain.loss

    def with_cpu_term(self, model, batch, fused=True):
        value, count, correct = loss(self, model, batch, fused)
        return (value.reshape(1) + torch.ones(1)).sum(), count, correct

    Pretrain.loss = with_cpu_term


def no_torchao():
    """A machine without torchao (QLoRA's NF4 base is then sized in bf16)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name == "torchao" else find_spec(name, *a)


def main(spec_path: str, out_path: str) -> None:
    import lmforge.train.plan as plan_module
    from lmforge.train.config import load_run_config

    cases = json.loads(open(spec_path).read())["cases"]
    results = {}
    import importlib.util

    from lmforge.train.step import ParallelTraining
    from lmforge.train.tasks.pretrain import Pretrain

    originals = (
        ParallelTraining.global_counts,
        Pretrain.loss,
        plan_module.SHALLOW,
        importlib.util.find_spec,
    )
    for name, case in cases.items():
        (
            ParallelTraining.global_counts,
            Pretrain.loss,
            plan_module.SHALLOW,
            importlib.util.find_spec,
        ) = originals
        if case.get("patch"):
            globals()[case["patch"]]()
        if case.get("shallow"):
            plan_module.SHALLOW = case["shallow"]
        try:
            cfg = load_run_config(case["config"], case.get("overrides", []))
            plan = plan_module.plan_run(
                cfg, case["world"], case.get("device", "cuda"), case.get("device_memory")
            )
            results[name] = {"plan": plan.to_json()}
        except Exception as e:  # noqa: BLE001 - the test reads which one
            results[name] = {
                "error": type(e).__name__,
                "message": str(e).splitlines()[0] if str(e) else "",
            }
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
