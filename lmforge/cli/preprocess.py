"""`lmforge preprocess --input PATH... --output-prefix PREFIX --tokenizer TOK`: Megatron .bin/.idx files.

What is written, and how, is lmforge.data.preprocess's docstring.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `lmforge preprocess` arguments (the CLI contract)."""
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="JSONL (.jsonl/.json/.ndjson, optionally .gz) or .txt files, or folders of them")
    parser.add_argument("--output-prefix", required=True, metavar="PREFIX",
                        help="writes PREFIX_<key>_document.bin/.idx for each json key")
    parser.add_argument("--tokenizer", required=True, metavar="TOK",
                        help="tokenizer.json, vocab.json (+ merges.txt), a SentencePiece .model, or a folder")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="JSON keys to tokenize, one output per key (default: text)")
    parser.add_argument("--append-eod", action="store_true", help="append the end-of-document id to each document")
    parser.add_argument("--workers", type=int, default=1,
                        help="tokenizer processes (default: 1, which tokenizes on the tokenizer's own threads)")
    parser.add_argument("--on-error", choices=["fail", "skip"], default="fail",
                        help="on a bad line: stop (default) or skip it and count it")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace):
    """Preprocess as asked, print one line of totals; returns the PreprocessStats."""
    from lmforge.data.preprocess import preprocess

    stats = preprocess(args.input, args.output_prefix, args.tokenizer, json_keys=args.json_keys,
                       append_eod=args.append_eod, workers=args.workers, on_error=args.on_error,
                       progress=getattr(args, "progress", True))
    skipped = f", skipped {stats.skipped} bad line(s)" if stats.skipped else ""
    print(f"wrote {stats.documents} documents, {stats.tokens} tokens in {stats.seconds:.1f} s "
          f"({stats.documents_per_second:,.0f} docs/s, {stats.tokens_per_second:,.0f} tokens/s){skipped}: "
          + ", ".join(f"{p}.bin/.idx" for p in stats.outputs.values()))
    return stats
