"""Eager vs torch.compile training steps, interleaved in one process (experiment 1's throughput).

    python scripts/experiments/compile_speed.py CONFIG.yaml [key=value ...] [--steps N] [--warmup W]

Builds two trainers from the same recipe (same seed, so the same initial weights), one eager and one
with trainer.compile=true, and alternates their steps on the same batches (eager, compiled,
compiled, eager, ...), so whatever else the machine is doing slows both alike: the ratio holds on a
shared machine where two separate runs' tokens/s do not. The first W steps of each (compilation,
warm-up) are timed apart. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def measure(config: str, overrides: list[str], steps: int, warmup: int) -> dict:
    from lmforge.train.config import load_run_config
    from lmforge.train.data import micro_batches
    from lmforge.train.tasks import count_tokens
    from lmforge.train.trainer import Trainer

    cfg = load_run_config(
        config, [*overrides, "trainer.progress_bar=false", "cost.peak_flops=1e12"]
    )
    if cfg.trainer.global_batch_size != cfg.trainer.micro_batch_size:
        raise SystemExit(
            "give micro_batch_size = global_batch_size: one batch per step keeps the steps comparable"
        )
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for name, compiled in (("eager", False), ("compiled", True)):
            t = dataclasses.replace(
                cfg.trainer, compile=compiled, compile_cache_dir=str(Path(tmp) / "cache")
            )
            trainers[name] = Trainer(
                dataclasses.replace(cfg, trainer=t, run_dir=str(Path(tmp) / name))
            )
        data = trainers["eager"].data
        total = (warmup + steps) * cfg.trainer.global_batch_size
        batches = list(
            micro_batches(data.train, 0, total, cfg.trainer.micro_batch_size, 0, 1, 0, data.collate)
        )
        times = {name: [] for name in trainers}
        tokens = []
        for i, batch in enumerate(batches):
            order = ("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")
            for name in order:
                t0 = time.perf_counter()
                out = trainers[name].train_step(iter([batch]))
                times[name].append(time.perf_counter() - t0)
                if name == "eager":
                    tokens.append(count_tokens(batch))
                    loss_eager = out["loss"]
                else:
                    loss_compiled = out["loss"]
        measured = {name: ts[warmup:] for name, ts in times.items()}
        result = {
            "steps": steps,
            "warmup": warmup,
            "batch": cfg.trainer.global_batch_size,
            "tokens_per_step": statistics.mean(tokens[warmup:]),
            "last_loss": {"eager": loss_eager, "compiled": loss_compiled},
        }
        for name, ts in measured.items():
            result[name] = {
                "warmup_s": sum(times[name][:warmup]),
                "median_step_s": statistics.median(ts),
                "tokens_per_second": sum(tokens[warmup:]) / sum(ts),
            }
        result["compiled_over_eager_tokens_per_second"] = (
            result["compiled"]["tokens_per_second"] / result["eager"]["tokens_per_second"]
        )
        # The ratio to read: per step, eager's time over compiled's on the same batch, the median
        # over the timed steps. The sums above take in a recompilation (a new shape) landing in the
        # timed steps whole; a slow step of either side (another process's burst on a busy machine)
        # moves this median little.
        result["compiled_speedup_median_paired"] = statistics.median(
            e / c for e, c in zip(measured["eager"], measured["compiled"], strict=True)
        )
        slow = 3 * result["compiled"]["median_step_s"]
        # recompilations
        result["compiled_steps_over_3x_median"] = sum(c > slow for c in measured["compiled"])
        return result


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=40, help="timed steps of each (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps of each (default 5)")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.config, args.overrides, args.steps, args.warmup), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
