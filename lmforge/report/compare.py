"""`lmforge compare RUN_DIR... --out DIR`: PNG plots, one self-contained HTML page and a table.

loss.png        train (and validation) loss per step, overlaid; the second half enlarged
loss_difference.png  each run's loss minus the first run's, step by step (two runs or more)
grad_norm.png   gradient norm per step
accuracy.png    validation accuracy per step (only when a run has it)
downstream.png  one panel per downstream-eval metric (eval/<task>/<metric>, from eval.tasks) over steps
throughput.png  tokens/s per step; steady-state tokens/s and sequences/s
time.png        start-up + training time
cost.png        total $ and tokens per $ (from cost.usd_per_hour)
index.html      all of the above, the images embedded as base64, plus the table
"""

from __future__ import annotations

import base64
import html
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lmforge.errors import UserError
from lmforge.fsutil import atomic_write
from lmforge.report.runs import Run, derive_labels, eval_keys, eval_title, load_run, summarize

log = logging.getLogger(__name__)

# (summary key, column title, format); a None value prints as "-".
COLUMNS = (
    ("steps", "steps", "{:,d}"),
    ("tokens", "tokens", "{:,.0f}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("min_loss", "min loss", "{:.4f}"),
    ("val_loss", "val loss", "{:.4f}"),
    ("val_ppl", "val ppl", "{:,.2f}"),
    ("val_accuracy", "val acc", "{:.2%}"),
    ("tokens_per_second", "tokens/s", "{:,.0f}"),
    ("sequences_per_second", "seq/s", "{:,.2f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("mfu_fp8", "MFU vs FP8 peak", "{:.1%}"),
    ("startup_s", "start-up (s)", "{:,.1f}"),
    ("time_s", "time (s)", "{:,.1f}"),
    ("cost_usd", "cost ($)", "{:.4f}"),
    ("tokens_per_dollar", "tokens/$", "{:,.0f}"),
)

EVAL_FORMAT = "{:.4g}"  # downstream metrics: accuracies, perplexities, bits per byte


@dataclass
class Report:
    runs: list[Run]
    files: dict[str, Path]  # plot name -> PNG written
    html: Path


def compare(
    run_dirs: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None
) -> Report:
    if not run_dirs:
        raise UserError("no run folders given: pass one or more RUN_DIRs")
    if labels is not None and len(labels) != len(run_dirs):
        raise UserError(
            f"--labels has {len(labels)} names for {len(run_dirs)} runs: give one label per run"
        )
    runs = [load_run(d) for d in run_dirs]
    for run, label in zip(runs, labels or derive_labels(runs)):
        run.label = label
        run.summary = wall_clock(run, summarize(run))
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out '{out}' is a file: give a folder for the report")
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, image in figures(runs).items():
        files[name] = out / f"{name}.png"
        atomic_write(files[name], image)
    page = out / "index.html"
    atomic_write(page, render_html(runs, {n: p.read_bytes() for n, p in files.items()}))
    log.debug("wrote %d plots and %s", len(files), page)
    return Report(runs, files, page)


def wall_clock(run: Run, summary: dict) -> dict:
    """Prefer the trainer's wall clock over the sum of step times: the run's end (finished.json:
    set-up, steps, validation, checkpoint writes and the export, with the whole run's tokens: the
    figures of the run's last line), else `elapsed` on the last row (a run stopped or still
    going: the time to that row's step). A resumed run's clock goes on from its checkpoint."""
    end = run.finished or {}
    elapsed = end.get("elapsed") if _number(end.get("elapsed")) else run.rows[-1].get("elapsed")
    if not _number(elapsed) or summary.get("time_s") is None:
        return summary
    out = dict(
        summary,
        time_s=elapsed,
        train_s=max(elapsed - (summary.get("startup_s") or 0.0), 0.0),
        wall_clock=True,
    )
    # counted step by step: exact, where rows logged every N steps are scaled up
    if _number(end.get("tokens")):
        out.update(tokens=end["tokens"], estimated=False)
    usd = (
        end["usd_per_hour"]
        if _number(end.get("usd_per_hour")) and end["usd_per_hour"] > 0
        else summary.get("usd_per_hour")
    )
    out["usd_per_hour"] = usd
    out["cost_usd"] = usd * elapsed / 3600 if usd else None
    out["tokens_per_dollar"] = (
        out["tokens"] / out["cost_usd"] if out["cost_usd"] and out["tokens"] else None
    )
    return out


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def figures(runs: list[Run]) -> dict[str, bytes]:
    from lmforge.report import plots

    makers = {"loss": plots.loss_figure}
    if len(runs) > 1:
        makers["loss_difference"] = plots.loss_difference_figure
    makers["grad_norm"] = plots.grad_norm_figure
    if any(r.series("val_accuracy")[0] for r in runs):
        makers["accuracy"] = plots.val_accuracy_figure
    if eval_keys(runs):
        makers["downstream"] = plots.downstream_figure
    makers.update(
        throughput=plots.throughput_figure, time=plots.time_figure, cost=plots.cost_figure
    )
    return {name: plots.png_bytes(make(runs)) for name, make in makers.items()}


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    return fmt.format(value)


def table_rows(runs: list[Run]) -> list[list[str]]:
    """Header row, then one row per run, every number formatted as the table shows it; after the
    fixed columns, one per downstream-eval metric (its last logged value)."""
    evals = eval_keys(runs)
    # MFU against the FP8 peak only where a run trained with trainer.float8
    columns = [
        c
        for c in COLUMNS
        if c[0] != "mfu_fp8" or any(r.summary.get("mfu_fp8") is not None for r in runs)
    ]
    rows = [["run", *(title for _, title, _ in columns), *map(eval_title, evals)]]
    for run in runs:
        cells = [_cell(run.summary.get(key), fmt) for key, _, fmt in columns]
        # logged every N steps: totals scaled up from the logged ones
        if run.summary.get("estimated"):
            scaled = (
                ("tokens",) if run.summary.get("wall_clock") else ("tokens", "time_s", "cost_usd")
            )
            cells = [
                ("~" + c if key in scaled and c != "-" else c)
                for (key, _, _), c in zip(columns, cells)
            ]
        last = run.summary.get("eval") or {}
        rows.append([run.label, *cells, *(_cell(last.get(k), EVAL_FORMAT) for k in evals)])
    return rows


def text_table(runs: list[Run]) -> str:
    rows = table_rows(runs)
    keep = [j for j in range(len(rows[0])) if j == 0 or any(r[j] != "-" for r in rows[1:])]
    rows = [[r[j] for j in keep] for r in rows]
    widths = [max(len(r[j]) for r in rows) for j in range(len(keep))]
    lines = [
        "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths)))
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if not any(r.summary.get("usd_per_hour") for r in runs):
        lines.append("cost: no price configured (set cost.usd_per_hour)")
    return "\n".join(lines)


TITLES = {
    "loss": "Loss",
    "loss_difference": "Loss difference to the first run",
    "grad_norm": "Gradient norm",
    "accuracy": "Validation accuracy",
    "downstream": "Downstream evals (eval.tasks)",
    "throughput": "Throughput",
    "time": "Total training time",
    "cost": "Cost",
}

CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1250px;color:#222}
table{border-collapse:collapse;font-size:14px;margin:1em 0}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child,th:first-child{text-align:left}
th{background:#f2f2f2}img{max-width:100%;border:1px solid #eee;margin:.5em 0}
code{background:#f5f5f5;padding:1px 4px}.note{color:#555;font-size:13px}"""


def render_html(runs: list[Run], images: dict[str, bytes]) -> str:
    esc = html.escape
    rows = table_rows(runs)
    head = "".join(f"<th>{esc(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    listing = "".join(
        f"<li><b>{esc(r.label)}</b>: <code>{esc(str(r.path))}</code>{_config_line(r)}</li>"
        for r in runs
    )
    figs = "".join(
        f'<h2>{esc(TITLES.get(name, name))}</h2>\n<img alt="{esc(name)}" '
        f'src="data:image/png;base64,{base64.b64encode(data).decode()}">\n'
        for name, data in images.items()
    )
    no_price = (
        ""
        if any(r.summary.get("usd_per_hour") for r in runs)
        else (
            "<p class=note>Cost: no price configured (set <code>cost.usd_per_hour</code> in the run's config).</p>"
        )
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>lmforge compare: {esc(", ".join(r.label for r in runs))}</title>
<style>{CSS}</style></head><body>
<h1>Run comparison</h1>
<ul>{listing}</ul>
<h2>Final numbers</h2>
<table><tr>{head}</tr>{body}</table>{no_price}
<p class=note>Final/min loss: the train loss of the last step and the lowest over the run; val numbers: the last
validation. tokens/s, seq/s and MFU: steady state (each start's first step, where compilation and warm-up land,
left out; MFU = model FLOPs done / (peak x time)). Start-up: trainer setup (model, data, peak) before the first
step ("-" where the first step was not logged). Time: the trainer's wall clock: for a run that ended, to its end
(<code>finished.json</code>: start-up, steps, validation, checkpoint writes and the Hugging Face export); for a run
stopped or still going, to its last logged row (<code>elapsed</code>); for older runs, start-up plus every step's
time (validation and checkpoint writes not timed). Time and tokens are the whole run's, over its resumes: for a run
never resumed, the figures of its last line (which, after a resume, counts that invocation alone).
Cost: <code>cost.usd_per_hour</code> x time; tokens/$ = tokens / cost. A leading ~ marks totals scaled up from rows
logged every N steps. Columns named by a task and a metric: the downstream eval (<code>eval.tasks</code>) at the
last step it ran.</p>
{figs}</body></html>
"""


def _config_line(run: Run) -> str:
    c = run.config
    if c is None:
        return " (no config.yaml)"
    t, o, d = c.get("trainer") or {}, c.get("optim") or {}, c.get("data") or {}
    bits = [
        f"task {d.get('task')}",
        f"precision {t.get('precision')}",
        "compiled" if t.get("compile") else "eager",
        f"global batch {t.get('global_batch_size')} (micro {t.get('micro_batch_size')})",
        f"seq {d.get('seq_length')}",
        f"lr {o.get('lr')}",
    ]
    resumes = run.summary.get("resumes")
    if resumes:
        bits.append(f"resumed {resumes}x")
    return " &middot; " + html.escape(", ".join(bits))
