"""`lmforge tokenizer train --input PATH... --vocab-size N --out DIR`: a byte-level BPE tokenizer.

What is trained, and how, is lmforge.data.tokenizer_train's docstring.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    add_train_arguments(
        actions.add_parser("train", help="train a byte-level BPE tokenizer (tokenizer.json)")
    )


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The `lmforge tokenizer train` arguments (the CLI contract)."""
    from lmforge.data.tokenizer_train import ENDOFTEXT

    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="JSONL (.jsonl/.json/.ndjson) or .txt files, optionally .gz, or folders of them",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        metavar="N",
        help="tokens in the vocabulary, the 256 byte symbols and special tokens included",
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="folder to write tokenizer.json into"
    )
    parser.add_argument(
        "--special-tokens",
        nargs="*",
        default=[ENDOFTEXT],
        metavar="TOK",
        help=f"special tokens, given the first ids; the first is bos/eos (default: {ENDOFTEXT})",
    )
    parser.add_argument(
        "--min-frequency", type=int, default=2, help="least count of a pair to merge (default: 2)"
    )
    # (preprocess's spelling too)
    parser.add_argument(
        "--json-key",
        "--json-keys",
        dest="json_key",
        default="text",
        help="key holding the text in JSON lines (default: text)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace):
    """Train as asked and print where the tokenizer went; returns the `tokenizers.Tokenizer`."""
    from lmforge.data.tokenizer_train import train_tokenizer

    tok = train_tokenizer(
        args.input,
        args.vocab_size,
        args.out,
        special_tokens=args.special_tokens,
        min_frequency=args.min_frequency,
        json_key=args.json_key,
        overwrite=args.overwrite,
        progress=sys.stdout.isatty(),
    )
    print(
        f"trained a {tok.get_vocab_size()}-token byte-level BPE tokenizer: {Path(args.out) / 'tokenizer.json'}"
    )
    return tok
