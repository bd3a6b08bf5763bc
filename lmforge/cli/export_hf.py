"""`lmforge export-hf CHECKPOINT_DIR OUT_DIR`: an lmforge model folder or a training checkpoint as a Hugging Face
folder."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint_dir", help="lmforge model folder (lmforge.json + safetensors) or training checkpoint "
                                          "(RUN_DIR/checkpoints/step-N)")
    p.add_argument("out_dir", help="Hugging Face folder to create")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast weights (default: keep)")
    p.add_argument("--overwrite", action="store_true", help="replace out_dir if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.models.export import export_folder
    from lmforge.models.io import parse_dtype

    hf = export_folder(args.checkpoint_dir, args.out_dir, dtype=parse_dtype(args.dtype), overwrite=args.overwrite)
    print(f"exported {hf['architectures'][0]} to {args.out_dir}")
