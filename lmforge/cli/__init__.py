"""`lmforge <verb>`: one module per verb in this package, each with `add_arguments(p)` and
`run(args)`.

A verb's module parses its arguments, calls the library and prints what the library returns: library
code logs, only the CLI prints. A verb's module imports the library inside `run`, and `main` builds
only the parser of the verb it was given, so `lmforge preprocess` never waits for torch to import.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from types import ModuleType
from typing import NamedTuple

from lmforge import __version__
from lmforge.errors import UserError
from lmforge.launcher import end_with_launcher


class Verb(NamedTuple):
    module: str  # lmforge.cli.<module> holds its add_arguments and run
    help: str


# The verbs of the CLI contract, in the order `--help` lists them.
VERBS = {
    "quickstart": Verb(
        "quickstart", "train a tiny model end to end on text already on this machine"
    ),
    "preprocess": Verb(
        "preprocess", "tokenize JSONL/Parquet/text into Megatron .bin/.idx files (or one shard)"
    ),
    "data": Verb(
        "data",
        "tokenized datasets: `lmforge data merge` joins shards, `lmforge data inspect` describes one",
    ),
    "tokenizer": Verb(
        "tokenizer", "tokenizer tools: `lmforge tokenizer train` trains a byte-level BPE tokenizer"
    ),
    "pretrain": Verb("pretrain", "pretrain or continue pretraining from a YAML recipe"),
    "finetune": Verb(
        "pretrain", "fine-tune (SFT, LoRA/QLoRA, DPO, classification, MLM) from a YAML recipe"
    ),
    "plan": Verb(
        "plan",
        "trace one training step for N ranks on fake tensors: memory per device, device bugs",
    ),
    "compile": Verb("compile", "warm the torch.compile cache that a following run reuses"),
    "import-hf": Verb(
        "import_hf", "convert a Hugging Face model folder into an lmforge model folder"
    ),
    "export-hf": Verb(
        "export_hf",
        "write an lmforge model folder or a training checkpoint as a Hugging Face folder",
    ),
    "generate": Verb("generate", "generate text from a model folder"),
    "serve": Verb("serve", "serve a model over an OpenAI-compatible HTTP API with a chat page"),
    "eval": Verb(
        "eval", "lm-evaluation-harness tasks on a model folder or training checkpoint, offline"
    ),
    "compare": Verb("compare", "plot and tabulate several runs side by side"),
    "bench": Verb(
        "bench", "benchmarks side by side with the reference (lmforge bench --help lists them)"
    ),
}


def verb_module(verb: str) -> ModuleType:
    """The module behind a verb (imported on first use)."""
    return importlib.import_module(f"{__name__}.{VERBS[verb].module}")


class Parser(argparse.ArgumentParser):
    """argparse's parser (and, as add_subparsers makes them of its parent's class, every verb's),
    which leaves on the namespace the innermost parser that read the words (`_verb_parser`: an
    error about a verb's words shows that verb's usage, not lmforge's), and whose errors first
    name an option spelt with underscores that this parser spells with dashes (lm-eval's and
    torchrun's habit: --num_fewshot, --batch_size, --output_path)."""

    def parse_known_args(self, args=None, namespace=None):
        self.argv = list(sys.argv[1:] if args is None else args)
        parsed, extra = super().parse_known_args(args, namespace)
        # a verb's parser returns before the one that called it
        if not hasattr(parsed, "_verb_parser"):
            parsed._verb_parser = self
        return parsed, extra

    def error(self, message: str):
        for arg in getattr(self, "argv", ()):
            if arg == "--":  # what follows is positional
                break
            name = arg.split("=", 1)[0]
            dashed = "--" + name[2:].replace("_", "-")
            if (
                name.startswith("--")
                and name not in self._option_string_actions
                and dashed in self._option_string_actions
            ):
                message = f"unknown option {name}: {self.prog} spells it {dashed}"
                break
        super().error(message)


def parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `lmforge` parser. With `only`, only that verb's arguments are built (its module
    imported)."""
    p = Parser(prog="lmforge", description="From raw text to a trained, served language model.")
    p.add_argument("--version", action="version", version=f"lmforge {__version__}")
    p.add_argument("--debug", action="store_true", help="show full tracebacks for errors")
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    for verb, (_, text) in VERBS.items():
        verb_parser = sub.add_parser(verb, help=text, description=text)
        if only in (None, verb):
            verb_module(verb).add_arguments(verb_parser)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, timeout, Slurm, a supervisor) in a verb that has no handler of its own:
    unwound as Ctrl-C is, so worker pools are stopped and temporary files removed (the default
    action ended the process at once, orphaning preprocess's workers and leaving its partial
    output behind)."""

    signum = signal.SIGTERM


def _terminate_as_interrupt(owner: int):
    def handle(signum, frame):
        # a forked worker inherited this: it ends as SIGTERM ends it by default
        if os.getpid() != owner:
            os._exit(128 + signum)
        raise Terminated()

    return handle


def main(argv: list[str] | None = None) -> int:
    end_with_launcher()  # first: a torchrun worker whose launcher is killed must not train on alone
    argv = sys.argv[1:] if argv is None else argv
    verb = next((a for a in argv if not a.startswith("-")), None)  # top-level options take no value
    p = parser(verb if verb in VERBS else None)
    args, extra = p.parse_known_args(argv)
    # the verb's (`lmforge data merge`: merge's): its usage
    verb_parser = vars(args).pop("_verb_parser", p)
    # argparse takes a positional list only before the options: key=value overrides after them
    # (`lmforge plan cfg.yaml --world-size 8 parallel.tensor=8`) are the overrides' too.
    if (
        extra
        and isinstance(getattr(args, "overrides", None), list)
        and all("=" in a and not a.startswith("-") for a in extra)
    ):
        args.overrides += extra
    elif extra:
        dashed = [a for a in extra if a.startswith("--") and "." in a.split("=", 1)[0]]
        # torchtitan/NeMo habit: --trainer.x=3
        if dashed and isinstance(getattr(args, "overrides", None), list):
            fixed = dashed[0].lstrip("-") if "=" in dashed[0] else f"{dashed[0].lstrip('-')}=VALUE"
            verb_parser.error(
                f"unrecognized argument {dashed[0]}: config overrides are key=value without dashes, "
                f"e.g. {fixed}"
            )
        verb_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.verb is None:
        parser().print_help()
        return 2
    # Under torchrun only rank 0 logs INFO (the others would repeat it; Lightning/NeMo's rank-zero
    # logging), the rest warnings and errors. LMFORGE_LOG_ALL_RANKS=1 logs every rank's.
    quiet = os.environ.get("RANK", "0") != "0" and os.environ.get("LMFORGE_LOG_ALL_RANKS", "0") in (
        "0",
        "",
    )
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    # Training verbs replace it while they train (lmforge.train.stopping), serve while uvicorn runs.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = (
        signal.signal(signal.SIGTERM, _terminate_as_interrupt(os.getpid())) if main_thread else None
    )
    try:
        args.func(args)
    except UserError as e:
        if args.debug:
            raise
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fails alike: say it once
            print(f"error: {e}", file=sys.stderr)
        return 1
    # Ctrl-C; a training run saves a checkpoint first and says where (Stopped)
    except KeyboardInterrupt as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    finally:
        # main() called in a process that goes on (tests, a notebook): its handler as it
        # was
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    return 0
