"""`lmforge bench NAME [options]`: runs benchmarks/NAME.py from the source checkout.

The benchmarks compare lmforge with other tools (transformers, Megatron-LM) side by side and write
their tables into BENCHMARKS.md beside them, so they live with the source, not in the installed
package; this verb finds them from an editable install (`pip install -e .`) or LMFORGE_BENCHMARKS.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from lmforge.errors import UserError

BENCHMARKS = {
    "train": "training step tokens/s and MFU vs transformers, fp32 and bf16, with the measured GEMM peak",
    "preprocess": "preprocessing tokens/s vs Megatron-LM's tools/preprocess_data.py",
    "preprocess_scale": "preprocessing: Parquet/zstd/datasets inputs, shards on N processes, memory, vs Megatron-LM",
    "generate": "greedy decode tokens/s vs transformers' generate",
    "lora": "LoRA fine-tuning tokens/s and peak memory vs PEFT + a plain transformers loop",
    "scaling": "throughput and tokens per dollar across process counts and parallel layouts",
    "optim": "optimizer step: stochastic-rounding AdamWSR (bf16-sr) vs torch's fused and foreach AdamW",
    "rotary": "partial rotary: full-head rotation vs slicing",
    "moe": "mixture-of-experts MLP forward+backward vs transformers' Mixtral and Qwen3-MoE blocks",
    "serve_load": "200 concurrent streams against lmforge serve: errors, latency p50/p99, tokens/s",
    "prefill": "the serving engine's batched prefill vs one request a forward: time to first token, tokens/s",
    "eval": "lmforge eval vs lm-eval's hf backend on the same model and tasks, equal results first",
    "sft_attention": "packed SFT at seq 2048: per-document attention vs the dense (b, 1, s, s) mask, same loss",
    "activation_checkpointing": "step time of trainer.activation_checkpointing none / selective / full",
    "sdpa_layout": "attention inputs on the CPU: strided q/k/v views vs copies made contiguous before SDPA",
    "softcap_loss": "Gemma's soft-capped cross-entropy: chunked vs full logits, peak memory and time",
    "kv_cache": "KV cache memory with rings for sliding-window layers vs a slot per position, and decode speed",
}


def benchmarks_dir() -> Path:
    env = os.environ.get("LMFORGE_BENCHMARKS")
    # lmforge/cli/ -> checkout
    folder = Path(env) if env else Path(__file__).resolve().parents[2] / "benchmarks"
    if not (folder / "report.py").is_file():
        raise UserError(
            f"no benchmarks folder at {folder}: the benchmarks ship with the source; clone the "
            "repository and `pip install -e .`, or set LMFORGE_BENCHMARKS to its benchmarks/ folder"
        )
    return folder


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "name",
        choices=sorted(BENCHMARKS),
        metavar="NAME",
        help="; ".join(f"{k}: {v}" for k, v in BENCHMARKS.items()),
    )
    p.add_argument(
        "options", nargs=argparse.REMAINDER, help="options of that benchmark (see NAME --help)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    script = benchmarks_dir() / f"{args.name}.py"
    if not script.is_file():
        raise UserError(
            f"benchmark '{args.name}' is not in {script.parent} yet: see BENCHMARKS.md for those built"
        )
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(script), *args.options]
    sys.path.insert(0, str(script.parent))  # the scripts import their sibling report.py
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:  # argparse --help / errors inside the benchmark
        if e.code not in (0, None):
            raise
    finally:
        sys.argv, sys.path[:] = argv, path
