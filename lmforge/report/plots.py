"""The comparison figures, drawn with matplotlib's object API on the Agg canvas.

No pyplot: it would switch the process-wide backend and keep figures alive in its registry; a
Figure with a FigureCanvasAgg renders the same PNG and leaves the caller's matplotlib alone.
"""

from __future__ import annotations

import io
import math
import textwrap

from lmforge.report.runs import Run, eval_keys, eval_title

COLORS = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#7f7f7f",
    "#bcbd22",
)
SMOOTH_FROM = 60  # points: above this a curve is drawn raw (thin) and smoothed (thick)


def _figure(width: float = 9.0, height: float = 4.8, panels: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=9)
    return fig, axes


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def ema(values: list[float], span: int) -> list[float]:
    """Exponential moving average with bias correction, so the first points are not pulled to 0."""
    alpha, avg, out = 2.0 / (span + 1), 0.0, []
    for n, v in enumerate(values, start=1):
        avg = alpha * v + (1 - alpha) * avg
        out.append(avg / (1 - (1 - alpha) ** n))
    return out


def _span(n: int) -> int:
    return max(5, n // 40)


def _width(i: int) -> float:
    """Later runs are drawn thinner on top of earlier ones: runs that agree (the point of comparing
    precisions) still show every colour, as a coloured edge along the curve on top."""
    return max(2.6 - 0.5 * i, 1.0)


def _curve(ax, steps, values, i: int):
    """Raw values, and when there are many, a thick EMA over them."""
    c = color(i)
    if len(values) > SMOOTH_FROM:
        ax.plot(steps, values, color=c, lw=0.7, alpha=0.3)
        ax.plot(steps, ema(values, _span(len(values))), color=c, lw=_width(i))
    else:
        ax.plot(
            steps, values, color=c, lw=_width(i) * 0.8, marker="." if len(values) < 20 else None
        )


def _legend(fig, runs: list[Run], extra=()):
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=color(i), lw=2) for i in range(len(runs))]
    labels = [r.label for r in runs]
    for style, text in extra:
        handles.append(Line2D([], [], color="0.3", **style))
        labels.append(text)
    longest = max(len(t) for t in labels)
    # long labels: fewer columns, never cut off
    ncols = 1 if longest > 45 else 2 if longest > 25 else 3
    fig.legend(
        handles,
        labels,
        loc="outside lower center",
        ncols=min(len(labels), ncols),
        fontsize=9,
        frameon=False,
    )


def _smoothing_note(runs: list[Run], key: str) -> str:
    n = max(len(r.series(key)[1]) for r in runs)
    return f" (thin: every step; thick: EMA over ~{_span(n)} steps)" if n > SMOOTH_FROM else ""


def loss_figure(runs: list[Run]):
    """Train loss (and validation loss) per step: the whole run, and its second half enlarged, where
    runs that should agree (precisions, compile) show how far apart they are."""
    fig, (full, tail) = _figure(12.0, 5.0, panels=2)
    has_val = any(r.series("val_loss")[0] for r in runs)
    last = max(r.rows[-1]["step"] for r in runs)
    shown = []  # what falls in the enlarged window, which the longest run sets
    for i, run in enumerate(runs):
        steps, loss = run.series("loss")
        vs, vl = run.series("val_loss")
        for ax in (full, tail):
            _curve(ax, steps, loss, i)
            if vs:
                ax.plot(vs, vl, color=color(i), lw=1.2, ls="--", marker="o", ms=4)
        shown += [v for s, v in zip(steps + vs, loss + vl) if s >= last / 2]
    tail.set_xlim(last / 2, last * 1.01)
    if shown:
        pad = 0.05 * (max(shown) - min(shown) or 1.0)
        tail.set_ylim(min(shown) - pad, max(shown) + pad)
    full.set_title("loss per step" + _smoothing_note(runs, "loss"), fontsize=10)
    tail.set_title("second half, enlarged", fontsize=10)
    for ax in (full, tail):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (cross-entropy, nats)")
    extra = [({"lw": 2}, "train")]
    if has_val:
        extra.append(({"lw": 1.2, "ls": "--", "marker": "o", "ms": 4}, "validation"))
    _legend(fig, runs, extra)
    return fig


def loss_difference_figure(runs: list[Run]):
    """Each run's train loss minus the first run's at the same step. With the same data order
    (same seed and batches) a step's batch noise cancels, leaving what the runs change
    (precision, compile): the drift the overlaid curves are too noisy to show."""
    fig, (ax,) = _figure()
    ref = dict(zip(*runs[0].series("loss")))
    ax.axhline(0.0, color=color(0), lw=_width(0))
    for i, run in enumerate(runs[1:], start=1):
        pts = [(s, v - ref[s]) for s, v in zip(*run.series("loss")) if s in ref]
        if pts:
            _curve(ax, [s for s, _ in pts], [d for _, d in pts], i)
    ax.set_title(
        f"train loss minus {runs[0].label}'s at the same step" + _smoothing_note(runs, "loss"),
        fontsize=10,
    )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss difference (nats)")
    _legend(fig, runs)
    return fig


def grad_norm_figure(runs: list[Run]):
    fig, (ax,) = _figure()
    values = []
    for i, run in enumerate(runs):
        steps, norms = run.series("grad_norm")
        if steps:
            _curve(ax, steps, norms, i)
            values += norms
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 20:  # spans orders of magnitude (early spikes)
        ax.set_yscale("log")
    ax.set_title("gradient norm per step" + _smoothing_note(runs, "grad_norm"), fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gradient L2 norm (before clipping)")
    _legend(fig, runs)
    return fig


def val_accuracy_figure(runs: list[Run]):
    fig, (ax,) = _figure()
    for i, run in enumerate(runs):
        steps, acc = run.series("val_accuracy")
        if steps:
            ax.plot(steps, [100 * a for a in acc], color=color(i), lw=1.5, marker="o", ms=4)
    ax.set_title("validation accuracy", fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("accuracy (%)")
    _legend(fig, runs)
    return fig


def downstream_figure(runs: list[Run]):
    """One panel per downstream-eval metric ("eval/<task>/<metric>", logged by eval.tasks in
    training) over the steps it was measured at, every run in its colour; the values as logged
    (no smoothing, no rescaling)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    keys = eval_keys(runs)
    ncols = min(len(keys), 3)
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(4.2 * ncols + 0.6, 3.2 * nrows + 0.8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, key in zip(axes, keys):
        values = []
        for i, run in enumerate(runs):
            steps, ys = run.series(key)
            if steps:
                ax.plot(steps, ys, color=color(i), lw=_width(i) * 0.7, marker="o", ms=4)
                values += ys
        positive = [v for v in values if v > 0]
        # perplexities early on
        if len(positive) == len(values) and positive and max(positive) / min(positive) > 20:
            ax.set_yscale("log")
        ax.set_title(eval_title(key), fontsize=10)
        ax.set_xlabel("optimizer step", fontsize=9)
        # evals run every N steps: no step 2.25
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=9)
    for ax in axes[len(keys) :]:
        ax.set_axis_off()
    _legend(fig, runs)
    return fig


def _bars(ax, runs: list[Run], values: list[float | None], fmt, xlabel: str, missing: str = "n/a"):
    """Horizontal bars (run labels can be long), each with its value written at its end."""
    ys = list(range(len(runs)))[::-1]  # first run on top
    top = max((v for v in values if v is not None), default=0.0) or 1.0
    for y, (i, v) in zip(ys, enumerate(values)):
        if v is None:
            ax.text(0.01 * top, y, missing, va="center", fontsize=9, color="0.4")
            continue
        ax.barh(y, v, color=color(i), height=0.6)
        ax.text(v + 0.01 * top, y, fmt(v), va="center", fontsize=9)
    ax.set_yticks(ys, [_wrap(r.label) for r in runs], fontsize=9)
    ax.set_xlim(0, top * 1.3)  # room for the value written past the longest bar
    if top >= 1e4:
        from matplotlib.ticker import EngFormatter

        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 20M, not 2e7 in an offset label
    ax.set_ylim(-0.6, len(runs) - 0.4)
    ax.set_xlabel(xlabel)
    ax.grid(True, axis="x", alpha=0.3)
    ax.grid(False, axis="y")


def _wrap(label: str) -> str:
    """Bar labels wrapped, so that long ones (many differing config fields) do not squeeze the
    bars."""
    return textwrap.fill(label, 30)


def _bar_height(runs: list[Run]) -> float:
    lines = max(_wrap(r.label).count("\n") + 1 for r in runs)
    return 1.6 + (0.3 + 0.17 * lines) * len(runs)


def throughput_figure(runs: list[Run]):
    """Tokens/s per step (warm-up and noise visible), then the steady-state averages of the
    table."""
    fig = _figure(12.0, max(4.2, _bar_height(runs)), panels=3)[0]
    per_step, tok, seq = fig.axes
    for i, run in enumerate(runs):
        steps, tps = run.series("tokens_per_second")
        if steps:
            _curve(per_step, steps, tps, i)
    per_step.set_ylim(bottom=0)
    per_step.set_xlabel("optimizer step")
    per_step.set_ylabel("tokens / s")
    per_step.set_title("per step", fontsize=10)
    _bars(
        tok,
        runs,
        [r.summary.get("tokens_per_second") for r in runs],
        _count,
        "tokens / s (steady state)",
    )
    _bars(
        seq,
        runs,
        [r.summary.get("sequences_per_second") for r in runs],
        lambda v: f"{v:,.2f}",
        "sequences / s (steady state)",
    )
    tok.set_title("tokens per second", fontsize=10)
    seq.set_title("sequences per second", fontsize=10)
    seq.set_yticks(seq.get_yticks(), [""] * len(runs))  # the middle panel already names the runs
    _legend(fig, runs)
    return fig


def time_figure(runs: list[Run]):
    """Start-up (setup, data, first step's wait) and the training steps, stacked."""
    fig, (ax,) = _figure(9.0, _bar_height(runs) + 0.6)
    totals = [r.summary.get("time_s") for r in runs]
    unit, div = ("min", 60.0) if max((t or 0) for t in totals) > 300 else ("s", 1.0)
    ys = list(range(len(runs)))[::-1]
    top = max((t or 0) for t in totals) / div or 1.0
    for y, run in zip(ys, runs):
        s = run.summary
        if s.get("time_s") is None:
            ax.text(0.01 * top, y, "n/a", va="center", fontsize=9, color="0.4")
            continue
        startup, train = s["startup_s"] / div, s["train_s"] / div
        ax.barh(y, startup, color="0.7", height=0.6)
        ax.barh(y, train, left=startup, color=color(runs.index(run)), height=0.6)
        ax.text(
            startup + train + 0.01 * top,
            y,
            f"{startup + train:,.1f} {unit}",
            va="center",
            fontsize=9,
        )
    ax.set_yticks(ys, [_wrap(r.label) for r in runs], fontsize=9)
    ax.set_xlim(0, top * 1.3)
    ax.set_ylim(-0.6, len(runs) - 0.4)
    ax.set_xlabel(f"time ({unit}): grey = start-up to the first step, colour = training steps")
    ax.set_title("total training time (validation and checkpoint writes not timed)", fontsize=10)
    ax.grid(False, axis="y")
    return fig


def cost_figure(runs: list[Run]):
    fig = _figure(12.0, max(3.6, _bar_height(runs)), panels=2)[0]
    usd, per_dollar = fig.axes
    priced = [r for r in runs if r.summary.get("usd_per_hour")]
    if not priced:
        for ax in (usd, per_dollar):
            ax.set_axis_off()
        fig.text(
            0.5,
            0.5,
            "no price configured: set cost.usd_per_hour in the run's config",
            ha="center",
            va="center",
            fontsize=12,
            color="0.3",
        )
        return fig
    missing = "no price configured"
    _bars(
        usd, runs, [r.summary.get("cost_usd") for r in runs], _dollars, "total cost (US$)", missing
    )
    _bars(
        per_dollar,
        runs,
        [r.summary.get("tokens_per_dollar") for r in runs],
        _count,
        "tokens per US$",
        missing,
    )
    per_dollar.set_yticks(per_dollar.get_yticks(), [""] * len(runs))
    prices = sorted({f"${r.summary['usd_per_hour']:g}/h" for r in priced})
    usd.set_title(f"cost of the run's time at {', '.join(prices)}", fontsize=10)
    per_dollar.set_title("tokens per dollar", fontsize=10)
    return fig


def _count(v: float) -> str:
    if v >= 1e9:
        return f"{v / 1e9:,.2f} G"
    if v >= 1e6:
        return f"{v / 1e6:,.2f} M"
    return f"{v:,.0f}"


def _dollars(v: float) -> str:
    if v == 0 or not math.isfinite(v):
        return "$0"
    return f"${v:,.2f}" if v >= 0.1 else f"${v:.3g}"
