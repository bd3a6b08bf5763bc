"""`lmforge preprocess --input PATH... --output-prefix PREFIX --tokenizer TOK`: Megatron .bin/.idx
files.

What is written, and how, is lmforge.data.preprocess's docstring; inputs, lmforge.data.inputs';
shards and their merge, lmforge.data.shards'.
"""

from __future__ import annotations

import argparse

# lmforge.data.preprocess.MAX_DOCUMENT_BYTES, which this module does not import: parsing stays
# light.
MAX_DOCUMENT_BYTES = 8 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `lmforge preprocess` arguments (the CLI contract)."""
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="JSON lines (.jsonl/.json/.ndjson) or .txt files, plain, .gz or .zst; .parquet files; "
        "Hugging Face datasets folders (save_to_disk); folders or quoted glob patterns of them",
    )
    parser.add_argument(
        "--output-prefix",
        required=True,
        metavar="PREFIX",
        help="writes PREFIX_<key>_document.bin/.idx for each json key",
    )
    parser.add_argument(
        "--tokenizer",
        required=True,
        metavar="TOK",
        help="tokenizer.json, vocab.json (+ merges.txt), a SentencePiece .model, or a folder",
    )
    parser.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        metavar="KEY",
        help="JSON keys (Parquet/Arrow: columns) to tokenize, one output per key (default: text)",
    )
    parser.add_argument(
        "--append-eod", action="store_true", help="append the end-of-document id to each document"
    )
    parser.add_argument(
        "--prepend-bos",
        action="store_true",
        help="start each document with the tokenizer's bos id (<s> for Llama 2, <|begin_of_text|> "
        "for Llama 3), as Megatron's Llama tokenizers do and Llama was pretrained; GPT-2/NeoX "
        "BPE data has none",
    )
    parser.add_argument(
        "--parse-special-tokens",
        action="store_true",
        help="turn special-token text in documents (<|endoftext|>) into its control id, as "
        "Megatron's tool does; by default it stays text, so no document can forge a boundary",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="tokenizer processes (default: 1, which tokenizes on the tokenizer's own threads)",
    )
    parser.add_argument(
        "--on-error",
        choices=["fail", "skip"],
        default="fail",
        help="on a bad line (or a document over --max-document-bytes): stop (default) or skip it "
        "and count it",
    )
    parser.add_argument(
        "--max-document-bytes",
        type=int,
        default=MAX_DOCUMENT_BYTES,
        metavar="N",
        help="refuse (or with --on-error skip, skip) a document over N bytes: a JSON line, a .txt "
        f"file, a row's text (default: {MAX_DOCUMENT_BYTES:,}, 8 MiB); tokenizing one takes up to "
        "~170 times its size in memory, per worker",
    )
    parser.add_argument(
        "--shard",
        metavar="I/N",
        help="tokenize only slice I of N (I from 0) into PREFIX_<key>_document.shard-I-of-N; "
        "`lmforge data merge PREFIX` (or --merge) joins the N shards afterwards",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="instead of tokenizing, merge the shards these same arguments wrote, checking they "
        "were made with them",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bar"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace):
    """Preprocess (or merge) as asked, print one line of totals; returns the PreprocessStats (or
    MergeStats)."""
    from lmforge.data.preprocess import merge_shards, preprocess
    from lmforge.errors import UserError

    parse_special = getattr(args, "parse_special_tokens", False)
    if getattr(args, "merge", False):
        if args.shard is not None:
            raise UserError("--merge joins every shard: drop --shard")
        results = merge_shards(
            args.input,
            args.output_prefix,
            args.tokenizer,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            parse_special_tokens=parse_special,
            prepend_bos=getattr(args, "prepend_bos", False),
        )
        for s in results:
            print(
                f"merged {s.shards} shards into {s.prefix}.bin/.idx: {s.documents:,} documents, {s.tokens:,} "
                f"tokens in {s.seconds:.1f} s (the shards are left in place)"
            )
        return results
    stats = preprocess(
        args.input,
        args.output_prefix,
        args.tokenizer,
        json_keys=args.json_keys,
        append_eod=args.append_eod,
        workers=args.workers,
        on_error=args.on_error,
        progress=getattr(args, "progress", True),
        shard=getattr(args, "shard", None),
        parse_special_tokens=parse_special,
        prepend_bos=getattr(args, "prepend_bos", False),
        max_document_bytes=getattr(args, "max_document_bytes", MAX_DOCUMENT_BYTES),
    )
    too_large = f", {stats.too_large} of them over --max-document-bytes" if stats.too_large else ""
    skipped = f", skipped {stats.skipped} bad line(s){too_large}" if stats.skipped else ""
    shard = f"shard {stats.shard[0]}/{stats.shard[1]}: " if stats.shard else ""
    keys = f" (over its {len(stats.outputs)} keys' datasets)" if len(stats.outputs) > 1 else ""
    print(
        f"{shard}wrote {stats.documents} documents, {stats.tokens} tokens{keys} in {stats.seconds:.1f} s "
        f"({stats.documents_per_second:,.0f} docs/s, {stats.tokens_per_second:,.0f} tokens/s){skipped}: "
        + ", ".join(f"{p}.bin/.idx" for p in stats.outputs.values())
    )
    return stats
