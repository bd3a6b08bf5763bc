"""`lmforge compile CONFIG.yaml [key=value ...]`: warm the torch.compile cache that the run then
reuses.

The compile job trains a few throwaway steps (and one validation, which compiles the eval graphs)
with the run's shapes, writing only the cache the real run reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML recipe of the run to prepare")
    p.add_argument(
        "overrides", nargs="*", default=[], help="the same key=value overrides the run will get"
    )
    p.add_argument(
        "--steps", type=int, default=2, help="throwaway training steps to compile (default 2)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.cli.pretrain import leave_process_group
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    cfg = load_run_config(args.config, args.overrides)
    cache = cfg.trainer.compile_cache_dir or str(Path(cfg.run_dir) / "compile_cache")
    job = Path(cfg.run_dir) / ".compile-job"
    steps = args.steps
    planned, cfg = (
        cfg,
        dataclasses.replace(
            cfg,
            run_dir=str(job),
            trainer=dataclasses.replace(
                cfg.trainer,
                compile=True,
                compile_cache_dir=cache,
                max_steps=steps,
                val_check_interval=steps if cfg.trainer.val_check_interval else 0,
                val_batches=min(1, cfg.trainer.val_batches),
            ),
            checkpoint=dataclasses.replace(cfg.checkpoint, every_n_steps=0, convert_to_hf=False),
        ),
    )
    shutil.rmtree(job, ignore_errors=True)
    t0 = time.perf_counter()
    try:
        trainer = Trainer(cfg, planned)
        # no checkpoint: nothing resumes from throwaway steps (neox-20b's: ~165 GB)
        trainer.save_at_end = False
        trainer.fit()
    finally:  # the job's folder goes, failed or not (only rank 0 ever writes in it)
        if int(os.environ.get("RANK", "0")) == 0:
            shutil.rmtree(job, ignore_errors=True)
    leave_process_group()
    if trainer.world.is_main:
        print(
            f"compiled {steps} step(s) in {time.perf_counter() - t0:.1f} s; cache {cache}: run the same "
            "config with trainer.compile=true to reuse it"
        )
