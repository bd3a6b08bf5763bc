"""`lmforge import-hf HF_DIR OUT_DIR`: a Hugging Face model folder as an lmforge model folder."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "hf_dir",
        help="folder with config.json and safetensors / pytorch_model.bin weights (and the "
        "tokenizer files, which are copied)",
    )
    p.add_argument("out_dir", help="lmforge model folder to create")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="cast weights (default: keep)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace out_dir if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.models.hf import import_hf
    from lmforge.models.io import parse_dtype
    from lmforge.models.sizes import parameter_count
    from lmforge.tokenizers import find_tokenizer_file

    cfg = import_hf(
        args.hf_dir, args.out_dir, dtype=parse_dtype(args.dtype), overwrite=args.overwrite
    )
    n = parameter_count(cfg, padded=False)
    print(
        f"imported {cfg.family} model ({n / 1e6:.1f}M parameters) from {args.hf_dir} to {args.out_dir}"
    )
    # the import is whole; what it lacks shows up only at generate
    if find_tokenizer_file(args.out_dir) is None:
        log.warning(
            "'%s' has no tokenizer (none in '%s' that import-hf copies: tokenizer.json, vocab.json + "
            "merges.txt, tokenizer.model): `lmforge generate` and `lmforge serve` will need --tokenizer PATH "
            "and `lmforge finetune` data.tokenizer=PATH, or copy the model's tokenizer files into '%s'",
            args.out_dir,
            args.hf_dir,
            args.out_dir,
        )
