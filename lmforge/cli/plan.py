"""`lmforge plan CONFIG [key=value ...] [--world-size N] [--device cuda] [--device-memory 80GiB]
[--json]`: one training step of the recipe traced for N ranks on fake tensors
(lmforge.train.plan): per-rank memory, and the device bugs a real run would hit at step 1, before
paying for the devices."""

from __future__ import annotations

import argparse
import json
import logging


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML recipe (see configs/)")
    p.add_argument(
        "overrides", nargs="*", default=[], help="key=value overrides, e.g. parallel.tensor=8"
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="number of processes (devices) of the run (default: the fewest the recipe's layout needs, "
        "parallel.tensor x pipeline x expert)",
    )
    p.add_argument(
        "--device", default="cuda", help="the device type the run computes on (default cuda)"
    )
    p.add_argument(
        "--device-memory",
        default=None,
        help="each device's memory (80GiB, 80GB; a bare number is GiB): fail if a rank's peak exceeds it",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.errors import UserError
    from lmforge.train.config import load_run_config
    from lmforge.train.plan import CATEGORIES, GiB, check_memory, parse_memory, plan_run
    from lmforge.train.plan_context import fit_line

    memory = parse_memory(args.device_memory) if args.device_memory is not None else None
    cfg = load_run_config(args.config, args.overrides)
    par = cfg.parallel
    world = args.world_size or par.tensor * par.pipeline * max(par.expert, 1) * par.context
    # The layout's log lines (mesh, parallelized) would come once per traced rank: the plan below
    # says it once.
    quiet = [
        logging.getLogger(name) for name in ("lmforge.parallel.mesh", "lmforge.parallel.compose")
    ]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.WARNING)
    try:
        plan = plan_run(cfg, world, args.device)
        if memory is not None:
            plan.device_memory = memory
            plan.context_fit = context_fit(cfg, plan, world, args.device, memory)
            try:
                check_memory(plan, memory, cfg.trainer)
            except UserError as e:
                if plan.context_fit is None or not plan.context_fit["smallest_context"]:
                    raise
                raise UserError(f"{e}; or {fit_line(plan.context_fit)}") from None
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
        return
    where = (
        plan.device
        if plan.traced_on == plan.device
        else (
            f"{plan.device} (traced on the stand-in device {plan.traced_on}: no {plan.device} device is touched)"
        )
    )
    lay = plan.layout
    print(f"plan: {args.config} on {plan.world_size} processes, {where}")
    schedule = f", {lay['pipeline_schedule']}" if lay["pipeline_schedule"] else ""
    if lay.get("expert", 1) > 1:
        schedule += f", experts over {lay['expert']} data ranks"
    if lay.get("context", 1) > 1:
        schedule += f", context {lay['context']} ({lay['context_method']})"
    print(
        f"layout: pipeline {lay['pipeline']} x data {lay['data_replicate']}x{lay['data_shard']} "
        f"(replicate x shard) x tensor {lay['tensor']}{' + sequence parallel' if lay['sequence_parallel'] else ''}"
        f"{schedule}; {plan.microbatches} micro-batches per step and data rank (traced {plan.traced_microbatches})"
    )
    for note in plan.notes:  # what was sized: full training or LoRA, DPO's reference
        print(note)
    if len(plan.traced_layers) > 1:
        print(
            f"traced at {' and '.join(map(str, plan.traced_layers))} blocks per stage, extrapolated to {plan.layers}"
        )
    print(f"{'rank':>6} {'stage':>5} " + " ".join(f"{k:>12}" for k in CATEGORIES) + "   (GiB)")
    for r in plan.ranks:
        print(
            f"{r.rank:>6} {r.stage:>5} "
            + " ".join(f"{getattr(r, k) / GiB:>12.2f}" for k in CATEGORIES)
        )
    peak = plan.per_rank_bytes()["peak"]
    fits = (
        f"; fits --device-memory {plan.device_memory / GiB:.1f} GiB" if plan.device_memory else ""
    )
    print(
        f"peak per device: {peak / GiB:.2f} GiB{fits} (tensors only: leave room for the CUDA context and "
        f"communication buffers); traced in {plan.seconds:.1f} s"
    )
    if plan.context_fit is not None:
        print(fit_line(plan.context_fit))


def context_fit(cfg, plan, world: int, device: str, memory: int) -> dict | None:
    """fit_context's answer where the recipe splits its sequences (parallel.context > 1), or
    where its peak does not fit and activations are the most of it (what splitting the sequence
    divides); None elsewhere, or where the model cannot be split by context."""
    from lmforge.errors import UserError
    from lmforge.parallel.context import refuse_unsupported
    from lmforge.train.plan import CATEGORIES, plan_run
    from lmforge.train.plan_context import fit_context

    worst = max(plan.ranks, key=lambda r: r.peak)
    largest = max(CATEGORIES[:-1], key=lambda k: getattr(worst, k))
    if cfg.parallel.context == 1 and (worst.peak <= memory or largest != "activations"):
        return None
    try:
        refuse_unsupported(cfg.model.resolve())
    except UserError:
        return None
    fit = fit_context(cfg, world, device, memory, plan_run)
    return fit if len(fit["micro_batch_by_context"]) > 1 else None
