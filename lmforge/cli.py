"""`lmforge <verb>`: parses arguments and calls the library; nothing else lives here."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from lmforge import __version__
from lmforge.errors import UserError

# The verbs of the CLI contract, in the order `--help` lists them; BUILT maps each to its arguments.
VERBS = {
    "quickstart": "train a tiny model end to end on text already on this machine",
    "preprocess": "tokenize JSONL/text into Megatron .bin/.idx files",
    "tokenizer": "tokenizer tools: `lmforge tokenizer train` trains a byte-level BPE tokenizer",
    "pretrain": "pretrain or continue pretraining from a YAML recipe",
    "finetune": "fine-tune (SFT, classification, MLM) from a YAML recipe",
    "compile": "warm the torch.compile cache that a following run reuses",
    "import-hf": "convert a Hugging Face model folder into an lmforge model folder",
    "export-hf": "write an lmforge model folder as a Hugging Face folder",
    "generate": "generate text from a model folder",
    "serve": "serve a model over an OpenAI-compatible HTTP API with a chat page",
    "compare": "plot and tabulate several runs side by side",
    "bench": "benchmarks: train, preprocess, generate, scaling",
}


def _import_hf(args: argparse.Namespace) -> None:
    from lmforge.models import build, num_parameters
    from lmforge.models.hf import import_hf
    from lmforge.models.io import parse_dtype

    cfg = import_hf(args.hf_dir, args.out_dir, dtype=parse_dtype(args.dtype), overwrite=args.overwrite)
    n = num_parameters(build(cfg, device="meta"))
    print(f"imported {cfg.family} model ({n / 1e6:.1f}M parameters) from {args.hf_dir} to {args.out_dir}")


def _export_hf(args: argparse.Namespace) -> None:
    from lmforge.models.hf import export_hf
    from lmforge.models.io import parse_dtype

    hf = export_hf(args.checkpoint_dir, args.out_dir, dtype=parse_dtype(args.dtype), overwrite=args.overwrite)
    print(f"exported {hf['architectures'][0]} to {args.out_dir}")


def _pretrain(args: argparse.Namespace) -> None:
    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    cfg = load_run_config(args.config, args.overrides)
    finetune = args.verb == "finetune"
    if finetune == (cfg.data.task == "pretrain"):
        fix = "set data.task=sft|classification|mlm" if finetune else "use `lmforge finetune`"
        raise UserError(f"`lmforge {args.verb}` got data.task={cfg.data.task}: {fix}")
    trainer = Trainer(cfg)
    last = trainer.fit()
    if trainer.world.is_main:
        shown = {k: round(v, 4) for k, v in last.items() if k in ("loss", "val_loss", "val_ppl", "tokens_per_second")}
        print(f"finished at step {trainer.state['step']}: {shown}; run folder {cfg.run_dir}")


def _compile(args: argparse.Namespace) -> None:
    import dataclasses
    import shutil
    import time
    from pathlib import Path

    from lmforge.train.config import load_run_config
    from lmforge.train.trainer import Trainer

    cfg = load_run_config(args.config, args.overrides)
    cache = cfg.trainer.compile_cache_dir or str(Path(cfg.run_dir) / "compile_cache")
    job = Path(cfg.run_dir) / ".compile-job"
    steps = args.steps
    # The compile job trains a few throwaway steps (and one validation, which compiles the eval graphs)
    # with the run's shapes, writing only the cache the real run reads.
    cfg = dataclasses.replace(
        cfg, run_dir=str(job),
        trainer=dataclasses.replace(cfg.trainer, compile=True, compile_cache_dir=cache, max_steps=steps,
                                    val_check_interval=steps if cfg.trainer.val_check_interval else 0,
                                    val_batches=min(1, cfg.trainer.val_batches)),
        checkpoint=dataclasses.replace(cfg.checkpoint, every_n_steps=0, convert_to_hf=False))
    shutil.rmtree(job, ignore_errors=True)
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    trainer.fit()
    if trainer.world.is_main:
        shutil.rmtree(job, ignore_errors=True)
        print(f"compiled {steps} step(s) in {time.perf_counter() - t0:.1f} s; cache {cache}: run the same "
              "config with trainer.compile=true to reuse it")


def _add_compile(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML recipe of the run to prepare")
    p.add_argument("overrides", nargs="*", help="the same key=value overrides the run will get")
    p.add_argument("--steps", type=int, default=2, help="throwaway training steps to compile (default 2)")
    p.set_defaults(func=_compile)


def _add_pretrain(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML recipe (see configs/)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.max_steps=100")
    p.set_defaults(func=_pretrain)


def _add_import_hf(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", help="folder with config.json and safetensors / pytorch_model.bin weights")
    p.add_argument("out_dir", help="lmforge model folder to create")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast weights (default: keep)")
    p.add_argument("--overwrite", action="store_true", help="replace out_dir if it exists")
    p.set_defaults(func=_import_hf)


def _add_export_hf(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint_dir", help="lmforge model folder (lmforge.json + safetensors)")
    p.add_argument("out_dir", help="Hugging Face folder to create")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast weights (default: keep)")
    p.add_argument("--overwrite", action="store_true", help="replace out_dir if it exists")
    p.set_defaults(func=_export_hf)


def _add_preprocess(p: argparse.ArgumentParser) -> None:
    from lmforge.data.preprocess import add_arguments

    add_arguments(p)


def _add_tokenizer(p: argparse.ArgumentParser) -> None:
    from lmforge.data.tokenizer_train import add_arguments

    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    add_arguments(actions.add_parser("train", help="train a byte-level BPE tokenizer (tokenizer.json)"))


def _add_generate(p: argparse.ArgumentParser) -> None:
    from lmforge.inference.generate import add_arguments, run

    add_arguments(p)
    p.set_defaults(func=run)


def _add_serve(p: argparse.ArgumentParser) -> None:
    from lmforge.serve.cli import add_arguments

    add_arguments(p)


def _add_quickstart(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="quickstart", help="folder for everything it makes (default: quickstart)")
    p.add_argument("--minutes", type=float, default=3.0, help="training time budget (default: 3)")
    p.add_argument("--max-steps", type=int, default=600, help="training steps at most (default: 600)")

    def run(args: argparse.Namespace) -> None:
        from lmforge.quickstart import run as quickstart

        quickstart(args.out, args.minutes, say=print, max_steps=args.max_steps)

    p.set_defaults(func=run)


def _add_compare(p: argparse.ArgumentParser) -> None:
    from lmforge.report.compare import add_arguments

    add_arguments(p)


def _add_bench(p: argparse.ArgumentParser) -> None:
    from lmforge.bench import add_arguments

    add_arguments(p)


BUILT: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "bench": _add_bench,
    "compare": _add_compare,
    "quickstart": _add_quickstart,
    "compile": _add_compile,
    "finetune": _add_pretrain,
    "generate": _add_generate,
    "serve": _add_serve,
    "tokenizer": _add_tokenizer,
    "preprocess": _add_preprocess,
    "pretrain": _add_pretrain,
    "import-hf": _add_import_hf,
    "export-hf": _add_export_hf,
}


def parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `lmforge` parser. With `only`, only that verb's arguments are built: each builder imports its
    module (generate's imports torch, ~1.5 s), which a verb like `preprocess` should not wait for."""
    p = argparse.ArgumentParser(prog="lmforge", description="From raw text to a trained, served language model.")
    p.add_argument("--version", action="version", version=f"lmforge {__version__}")
    p.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = p.add_subparsers(dest="verb", metavar="VERB")

    for verb, text in VERBS.items():
        verb_parser = sub.add_parser(verb, help=text, description=text)
        if only in (None, verb):
            BUILT[verb](verb_parser)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verb = next((a for a in argv if not a.startswith("-")), None)  # top-level options take no value
    args = parser(verb if verb in BUILT else None).parse_args(argv)
    if args.verb is None:
        parser().print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except UserError as e:
        if args.debug:
            raise
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fails alike: say it once
            print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
