"""`lmforge compare RUN_DIR... --out DIR`: plots, an HTML page and a table of several runs
(lmforge.report)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run folders (each holds metrics.jsonl)"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the PNGs and index.html")
    p.add_argument(
        "--labels", nargs="+", metavar="LABEL", help="one name per run (default: from each config)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.report.compare import compare, text_table

    report = compare(args.run_dirs, args.out, args.labels)
    print(text_table(report.runs))
    print(f"wrote {len(report.files)} plots and {report.html}")
