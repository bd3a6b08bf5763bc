"""`lmforge quickstart [--out DIR] [--minutes N] [--resume]`: raw text to a trained, exported model
(lmforge.quickstart)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        default="quickstart",
        help="folder for everything it makes: a new or empty one, or an "
        "earlier quickstart's (default: quickstart)",
    )
    p.add_argument("--minutes", type=float, default=3.0, help="training time budget (default: 3)")
    p.add_argument(
        "--max-steps", type=int, default=600, help="training steps at most (default: 600)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run an earlier quickstart left in --out (default: start afresh)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from lmforge.quickstart import run as quickstart

    quickstart(args.out, args.minutes, say=print, max_steps=args.max_steps, resume=args.resume)
