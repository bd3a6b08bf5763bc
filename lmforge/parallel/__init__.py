"""Parallelism applied to a model from outside: data (DDP, FSDP2/HSDP), tensor + sequence, pipeline,
expert and context.

    world = init_world()                                      # the process group, with timeouts
    mesh = build_mesh(parallel_cfg, model.config)             # ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    pm = parallelize(model, parallel_cfg, mesh)               # plans applied to the model, not rewrites
    loss = pipeline_step(pm, tokens, labels, loss_fn)         # forward + backward (all microbatches)
    norm = clip_grad_norm_(pm, 1.0)

Names are imported on first use: `import lmforge.parallel.data_parallel` (the trainer) stays cheap,
without torch's tensor-parallel and pipelining modules.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "World": "data_parallel",
    "init_world": "data_parallel",
    "ParallelConfig": "mesh",
    "all_reduce_data_parallel": "mesh",
    "build_mesh": "mesh",
    "check_model": "mesh",
    "data_parallel_rank": "mesh",
    "ParallelModel": "compose",
    "parallelize": "compose",
    "pipeline_eval": "pipeline",
    "pipeline_step": "pipeline",
    "with_router_loss": "router",
    "init_sharded": "load",
    "load_sharded": "load",
    "materialize_empty": "load",
    "meta_model": "load",
    "clip_grad_norm_": "state",
    "grad_norm": "state",
    "load_model_state_dict": "state",
    "model_state_dict": "state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lmforge.parallel' has no attribute '{name}'")
    value = getattr(importlib.import_module(f"lmforge.parallel.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
