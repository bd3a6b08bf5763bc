"""`lmforge generate MODEL_DIR --prompt TEXT`: completions of text prompts, printed one after another."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from lmforge.errors import UserError

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="lmforge model folder or Hugging Face folder, with its tokenizer files, or a "
                                     "training checkpoint (RUN_DIR/checkpoints/step-N: its run's tokenizer)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--lora", default=None, metavar="DIR",
                   help="a PEFT LoRA adapter folder (e.g. a run's hf-adapter/), merged into MODEL_DIR on load")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: smallest set with mass >= p")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (1.0 = off)")
    p.add_argument("--stop", action="append", default=[], help="stop at this text (not printed); repeatable")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="cast weights (default: keep)")
    p.add_argument("--device", default="auto",
                   help="auto (the accelerator torch reports, else cpu; the default), cpu, cuda, cuda:1 ...")
    p.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                   choices=["default", "reduce-overhead", "max-autotune"],
                   help="torch.compile the decode step: faster per token after a one-off compile (needs a C++ "
                        "compiler on CPU); worth it for long generations. MODE reduce-overhead: a static-shape step "
                        "replayed as CUDA graphs on CUDA (default: plain compile)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.cli.serve import load_served
    from lmforge.devices import resolve_device
    from lmforge.inference import generate_text
    from lmforge.inference.generate import check_fits
    from lmforge.models.io import parse_dtype
    from lmforge.models.source import tokenizer_source
    from lmforge.tokenizers import load_tokenizer

    if not Path(args.model_dir).is_dir():
        raise UserError(f"model folder '{args.model_dir}' does not exist")
    device = resolve_device(args.device)
    tokenizer = load_tokenizer(tokenizer_source(args.model_dir))
    model, _ = load_served(Path(args.model_dir), args.lora, device, parse_dtype(args.dtype))
    # generate() checks the same, but this line can name the flag.
    longest = max(len(ids) for ids in tokenizer.encode_batch(args.prompt, add_bos=tokenizer.add_bos_token))
    if longest and args.max_new_tokens > 0:
        check_fits(longest, args.max_new_tokens, model.config.max_position_embeddings, "--max-new-tokens")
    start = time.perf_counter()
    texts = generate_text(
        model, tokenizer, args.prompt, args.max_new_tokens, stop=args.stop, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
        compile=args.compile or False,
    )
    log.info("generated %d completion(s) in %.2f s", len(texts), time.perf_counter() - start)
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- completion {i + 1} of {len(texts)} ---")
        print(text)
