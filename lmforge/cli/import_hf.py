"""`lmforge import-hf HF_DIR OUT_DIR`: a Hugging Face model folder as an lmforge model folder."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", help="folder with config.json and safetensors / pytorch_model.bin weights")
    p.add_argument("out_dir", help="lmforge model folder to create")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast weights (default: keep)")
    p.add_argument("--overwrite", action="store_true", help="replace out_dir if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.models import build, num_parameters
    from lmforge.models.hf import import_hf
    from lmforge.models.io import parse_dtype

    cfg = import_hf(args.hf_dir, args.out_dir, dtype=parse_dtype(args.dtype), overwrite=args.overwrite)
    n = num_parameters(build(cfg, device="meta"))
    print(f"imported {cfg.family} model ({n / 1e6:.1f}M parameters) from {args.hf_dir} to {args.out_dir}")
