"""`lmforge export-hf CHECKPOINT_DIR OUT_DIR`: an lmforge model folder or a training checkpoint
as a Hugging Face folder."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint_dir",
        help="lmforge model folder (lmforge.json + safetensors) or training checkpoint "
        "(RUN_DIR/checkpoints/step-N)",
    )
    p.add_argument(
        "out_dir",
        help="Hugging Face folder to create (a LoRA run's checkpoint: the merged model, and its "
        "PEFT adapter in OUT_DIR-adapter)",
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="cast weights (default: keep)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace out_dir if it exists")
    p.add_argument(
        "--tokenizer",
        help="a checkpoint's tokenizer to export instead of the copy it holds (or, for "
        "older checkpoints, the one its run's config names)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from pathlib import Path

    from lmforge.models.export import export_folder
    from lmforge.models.io import parse_dtype
    from lmforge.models.source import checkpoint_lora, is_checkpoint

    hf = export_folder(
        args.checkpoint_dir,
        args.out_dir,
        dtype=parse_dtype(args.dtype),
        overwrite=args.overwrite,
        tokenizer=args.tokenizer,
    )
    out = Path(args.out_dir)
    lora = (
        is_checkpoint(Path(args.checkpoint_dir))
        and checkpoint_lora(Path(args.checkpoint_dir)) is not None
    )
    adapter = (
        f" (LoRA merged; the PEFT adapter in {out.with_name(out.name + '-adapter')})"
        if lora
        else ""
    )
    print(f"exported {hf['architectures'][0]} to {args.out_dir}{adapter}")
