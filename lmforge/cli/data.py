"""`lmforge data merge PREFIX` and `lmforge data inspect PREFIX [--tokenizer TOK]`: tokenized
datasets; `lmforge data grpo-toy OUT` and `lmforge data gsm8k-prompts IN OUT`: prompt files for
data.task=grpo.

`merge` joins the shards `lmforge preprocess --shard I/N` wrote (lmforge.data.shards); `inspect`
says what a `.bin/.idx` pair holds (lmforge.data.summary). PREFIX is a dataset prefix
(data/wiki_text_document) or the --output-prefix given to preprocess (data/wiki), which stands for
each of its keys' datasets.
"""

from __future__ import annotations

import argparse

BAR_WIDTH = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_verb", metavar="ACTION", required=True)
    merge = sub.add_parser(
        "merge",
        help="merge PREFIX's shards into one .bin/.idx, byte-identical to one run",
        description="Concatenate PREFIX.shard-0-of-N ... PREFIX.shard-(N-1)-of-N into PREFIX.bin/"
        ".idx, after checking they share a tokenizer, dtype, options and input list.",
    )
    merge.add_argument(
        "prefix", metavar="PREFIX", help="dataset prefix, or the --output-prefix of preprocess"
    )
    inspect = sub.add_parser(
        "inspect",
        help="documents, tokens, dtype, length histogram, first documents",
        description="What a .bin/.idx pair holds: counts, dtype, token lengths of documents, "
        "and its first documents (decoded with --tokenizer).",
    )
    inspect.add_argument(
        "prefix", metavar="PREFIX", help="dataset prefix, or the --output-prefix of preprocess"
    )
    inspect.add_argument(
        "--tokenizer", metavar="TOK", help="decode the first documents with this tokenizer"
    )
    inspect.add_argument(
        "--docs", type=int, default=3, metavar="K", help="documents to show (default: 3)"
    )
    inspect.add_argument(
        "--chars",
        type=int,
        default=300,
        metavar="C",
        help="characters of each decoded document to show (default: 300; 0: all)",
    )
    toy = sub.add_parser(
        "grpo-toy",
        help="the GRPO demo's tokenizer and prompts (a toy verifiable task)",
        description="Write OUT/tokenizer.json (38 words) and OUT/prompts.jsonl for "
        "configs/grpo-tiny-demo.yaml: the reward is the fraction of a completion's words equal to "
        "the record's target (lmforge.rl.toy).",
    )
    toy.add_argument("out", metavar="OUT", help="folder for tokenizer.json and prompts.jsonl")
    toy.add_argument("--records", type=int, default=64, help="prompts to write (default: 64)")
    toy.add_argument("--target", default="7", help="the word the reward asks for (default: 7)")
    gsm8k = sub.add_parser(
        "gsm8k-prompts",
        help="GSM8K records as GRPO prompts (chat turns, the answer kept)",
        description="Turn GSM8K JSON lines ({question, answer}) into data.task=grpo prompt "
        "records: a system prompt asking for <think>/<answer>, the question as the user's turn, "
        "the answer kept for the accuracy reward (lmforge.rl.gsm8k).",
    )
    gsm8k.add_argument("source", metavar="IN", help="GSM8K JSON lines (question, answer)")
    gsm8k.add_argument("out", metavar="OUT", help="the prompts file to write")
    gsm8k.add_argument("--limit", type=int, default=None, help="the first N records only")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace):
    """`data merge` returns the MergeStats, `data inspect` the DatasetSummary of each dataset."""
    verbs = {
        "merge": run_merge,
        "inspect": run_inspect,
        "grpo-toy": run_grpo_toy,
        "gsm8k-prompts": run_gsm8k,
    }
    return verbs[args.data_verb](args)


def run_grpo_toy(args: argparse.Namespace):
    from pathlib import Path

    from lmforge.errors import UserError
    from lmforge.rl.toy import WORDS, write_prompts, write_tokenizer

    if args.target not in WORDS[2:]:
        raise UserError(
            f"--target {args.target!r} is no word of the toy vocabulary: use a digit or a letter"
        )
    if args.records < 1:
        raise UserError(f"--records must be >= 1, got {args.records}")
    write_tokenizer(Path(args.out) / "tokenizer.json")
    write_prompts(Path(args.out) / "prompts.jsonl", args.records, args.target)
    print(f"wrote {args.out}/tokenizer.json and {args.out}/prompts.jsonl ({args.records} prompts)")


def run_gsm8k(args: argparse.Namespace):
    from lmforge.rl.gsm8k import convert

    written = convert(args.source, args.out, args.limit)
    print(f"wrote {written} prompts to {args.out}")
    return written


def run_merge(args: argparse.Namespace):
    from lmforge.data.shards import find_datasets, merge

    results = [merge(prefix) for prefix in find_datasets(args.prefix)]
    for s in results:
        print(
            f"merged {s.shards} shards into {s.prefix}.bin/.idx: {s.documents:,} documents, {s.tokens:,} tokens "
            f"in {s.seconds:.1f} s (the shards are left in place)"
        )
    return results


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def run_inspect(args: argparse.Namespace):
    from lmforge.data.summary import summarize_all

    summaries = summarize_all(args.prefix, args.tokenizer, max(args.docs, 0))
    for s in summaries:
        print(
            f"{s.prefix}: {s.documents:,} documents ({s.empty_documents:,} empty), {s.sequences:,} sequences, "
            f"{s.tokens:,} tokens, {s.dtype} (.bin {_size(s.bin_bytes)}, .idx {_size(s.idx_bytes)})"
        )
        if s.made_by:
            print(f"tokenized with {s.made_by} (its .tokenizer.json)")
        if not s.documents:
            continue
        if s.mismatch:
            print(f"warning: {s.mismatch}")
        print(
            f"tokens per document: min {s.min_tokens:,}, mean {s.mean_tokens:,.1f}, max {s.max_tokens:,}"
        )
        spans = [f"{b.low:,}" if b.low == b.high else f"{b.low:,}-{b.high:,}" for b in s.histogram]
        width, peak = (
            max(map(len, spans), default=0),
            max((b.documents for b in s.histogram), default=1),
        )
        if s.histogram:
            print("non-empty documents by token count:")
        for span, b in zip(spans, s.histogram):
            bar = "#" * max(1 if b.documents else 0, round(BAR_WIDTH * b.documents / peak))
            print(f"  {span:>{width}}  {b.documents:>12,}  {bar}")
        if s.first_documents:
            print(
                f"first {len(s.first_documents)} document(s)"
                + (f", decoded with {s.tokenizer}:" if s.decoded is not None else ", as token ids:")
            )
        for d, ids in enumerate(s.first_documents):
            if s.decoded is None:
                shown = " ".join(map(str, ids[:32])) + (" ..." if len(ids) > 32 else "")
            else:
                text = s.decoded[d]
                shown = repr(
                    text
                    if not args.chars or len(text) <= args.chars
                    else text[: args.chars] + " ..."
                )
            print(f"  [{d}] {len(ids):,} tokens: {shown}")
    return summaries
