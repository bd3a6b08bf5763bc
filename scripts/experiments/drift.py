"""How far runs drift from a reference run, step by step (experiment 2: precisions).

    python scripts/experiments/drift.py REF_RUN RUN... [--last N]

All runs must see the same data in the same order (same seed, batch and data), so the loss of step s
differs only by what the runs change (the precision). Prints a Markdown table: per run, the mean
|loss - reference loss| over all steps and over the last N steps (default: the last 20%), the mean
loss and gradient norm over those last N steps, and the last validation loss.
"""

from __future__ import annotations

import argparse
import sys

from lmforge.report import derive_labels, load_run


def _by_step(run, key):
    return dict(zip(*run.series(key)))


def _mean(values):
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def drift_table(paths, last: int | None = None) -> list[dict]:
    runs = [load_run(p) for p in paths]
    labels = derive_labels(runs)
    ref_loss = _by_step(runs[0], "loss")
    out = []
    for run, label in zip(runs, labels):
        loss, norm = _by_step(run, "loss"), _by_step(run, "grad_norm")
        common = sorted(set(loss) & set(ref_loss))
        n = last or max(len(common) // 5, 1)
        tail = common[-n:]
        _, val = run.series("val_loss")
        out.append(
            {
                "run": label,
                "steps": len(common),
                "mean_abs_dloss_all": _mean(abs(loss[s] - ref_loss[s]) for s in common),
                "mean_abs_dloss_last": _mean(abs(loss[s] - ref_loss[s]) for s in tail),
                "mean_dloss_last": _mean(loss[s] - ref_loss[s] for s in tail),
                "loss_last": _mean(loss[s] for s in tail),
                "grad_norm_last": _mean(norm[s] for s in tail if s in norm),
                "val_loss": val[-1] if val else float("nan"),
                "last": n,
            }
        )
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs", nargs="+", help="reference run first")
    p.add_argument(
        "--last", type=int, help="steps at the end to average over (default: the last 20%%)"
    )
    args = p.parse_args(argv)
    rows = drift_table(args.runs, args.last)
    n = rows[0]["last"]
    print(
        f"| run | mean abs dloss, all steps | mean abs dloss, last {n} | mean dloss, last {n} | "
        f"train loss, last {n} | grad norm, last {n} | final val loss |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['run']} | {r['mean_abs_dloss_all']:.4f} | {r['mean_abs_dloss_last']:.4f} | "
            f"{r['mean_dloss_last']:+.4f} | {r['loss_last']:.4f} | {r['grad_norm_last']:.4f} | {r['val_loss']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
