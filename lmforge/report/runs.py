"""A run folder read back for comparison: its metric rows, its config, and the numbers a table
shows.

The trainer writes `RUN_DIR/metrics.jsonl` (one JSON object per logged step) and
`RUN_DIR/config.yaml` (the resolved RunConfig), and `RUN_DIR/finished.json` once the run has ended
(its wall clock and tokens to the end: lmforge.train.run_files). On resume it first drops the rows a
killed run logged past its checkpoint, so step numbers only grow; a step may still appear twice when
a row is logged again with validation numbers added (a run stopped by `trainer.max_minutes`), and
those rows are merged.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmforge.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class Run:
    path: Path
    rows: list[dict[str, float]]  # one per logged step, ascending
    config: dict[str, Any] | None  # config.yaml as a plain dict; None when the folder has none
    label: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    finished: dict[str, Any] | None = None  # finished.json, where it records the end of these rows

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows that have a finite `key`."""
        pts = [
            (r["step"], r[key])
            for r in self.rows
            if isinstance(r.get(key), int | float) and math.isfinite(r[key])
        ]
        return [s for s, _ in pts], [v for _, v in pts]


# downstream evals in training (lmforge.train.downstream): "eval/<task>/<metric>"
EVAL_PREFIX = "eval/"


def eval_keys(runs: list[Run]) -> list[str]:
    """The downstream-eval metrics any of the runs logged, "eval/<task>/<metric>", sorted by task
    then metric."""
    keys = {
        k
        for run in runs
        for row in run.rows
        for k in row
        if k.startswith(EVAL_PREFIX) and k.count("/") >= 2
    }
    return sorted(keys)


def eval_title(key: str) -> str:
    """ "eval/sst2_local/acc" -> "sst2_local acc"."""
    task, _, metric = key.removeprefix(EVAL_PREFIX).rpartition("/")
    return f"{task} {metric}"


def load_run(path: str | Path) -> Run:
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not path.is_dir():
        raise UserError(
            f"'{path}' is not a directory: give the run_dir of an `lmforge pretrain`/`finetune` run"
        )
    if not metrics.is_file():
        raise UserError(
            f"'{path}' is not a run folder (no metrics.jsonl in it): give the run_dir of an "
            "`lmforge pretrain`/`finetune` run"
        )
    rows = _read_rows(metrics)
    if not rows:
        raise UserError(f"'{metrics}' has no rows yet: the run has not finished a logged step")
    config = None
    if (path / "config.yaml").is_file():
        try:
            config = yaml.safe_load((path / "config.yaml").read_text())
        except yaml.YAMLError as e:
            raise UserError(
                f"'{path / 'config.yaml'}' is not valid YAML ({str(e).splitlines()[0]})"
            ) from None
    else:
        log.warning("%s has no config.yaml: it is labelled by its folder name", path)
    from lmforge.train.run_files import read_finished

    finished = read_finished(path)
    # an older end: the run went on since
    if finished is not None and finished["step"] != rows[-1]["step"]:
        finished = None
    return Run(path, rows, config if isinstance(config, dict) else None, finished=finished)


def _read_rows(metrics: Path) -> list[dict[str, float]]:
    lines = metrics.read_text().splitlines()
    by_step: dict[int, dict[str, float]] = {}
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # a run killed in the middle of writing its last row
                log.warning(
                    "%s: the last line is cut off (a run killed while writing it): skipped", metrics
                )
                continue
            raise UserError(f"{metrics}:{n}: not valid JSON: the metrics file is damaged") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UserError(
                f"{metrics}:{n}: a metrics row must be a JSON object with an integer 'step'"
            )
        by_step.setdefault(row["step"], {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


# -- the numbers of the table ------------------------------------------------------------------


def summarize(run: Run) -> dict[str, Any]:
    """Final numbers of one run. Per-step rows carry step_time, tokens/s and sequences/s, so the
    step's tokens are tokens/s x step_time; totals are sums over the logged steps.

    * throughput (tokens/s, sequences/s, MFU) is steady state: each segment's first step (the one
      carrying `time_to_first_step`, where compilation and warm-up land) is left out, unless it is
      the only step, and so are steps over 4x the median step (a recompilation for a new shape); MFU
      is weighted by step time, i.e. model FLOPs done / (peak x time).
    * time = start-up (`time_to_first_step` minus that step) + the sum of step times; validation and
      checkpoint writes are not timed by the trainer and are not included.
    * cost = the run's price an hour (usd_per_hour: every node's) x time; tokens per dollar = tokens
      / cost.
    When rows were logged every N > 1 steps, tokens and time are scaled from the logged steps
    (`estimated` is then True).
    """
    rows = run.rows
    timed = [r for r in rows if _num(r.get("step_time")) and _num(r.get("tokens_per_second"))]
    steady = [r for r in timed if "time_to_first_step" not in r] or timed
    # a step 4x the median is a recompilation (a new shape) or a stall, not the steady state
    if len(steady) >= 4:
        typical = statistics.median(r["step_time"] for r in steady)
        steady = [r for r in steady if r["step_time"] <= 4 * typical]
    steps = rows[-1]["step"]
    start = _first_step(run)
    logged = len({r["step"] for r in timed})
    scale = (steps - start) / logged if logged else 1.0
    estimated = logged > 0 and abs(scale - 1.0) > 1e-9

    def total(rs, key):
        return sum(r[key] * r["step_time"] for r in rs)

    step_time = sum(r["step_time"] for r in timed)
    steady_time = sum(r["step_time"] for r in steady)
    # None where no first step was logged (older runs logged every N steps from step N only): not a
    # 0.
    firsts = [r for r in timed if "time_to_first_step" in r]
    startup = (
        sum(max(r["time_to_first_step"] - r["step_time"], 0.0) for r in firsts) if firsts else None
    )
    tokens = total(timed, "tokens_per_second") * scale if timed else None
    train_time = step_time * scale
    total_time = (startup or 0.0) + train_time if timed else None
    usd = usd_per_hour(run)
    cost = usd * total_time / 3600 if usd and total_time else None
    _, losses = run.series("loss")
    last_val = next((r for r in reversed(rows) if _num(r.get("val_loss"))), {})
    evals = {k: v[-1] for k in eval_keys([run]) if (v := run.series(k)[1])}
    return {
        "eval": evals,  # each downstream metric's last logged value
        "steps": steps,
        "tokens": tokens,
        "final_loss": losses[-1] if losses else None,
        "min_loss": min(losses) if losses else None,
        "val_loss": last_val.get("val_loss"),
        "val_ppl": last_val.get("val_ppl"),
        "val_accuracy": last_val.get("val_accuracy"),
        "tokens_per_second": total(steady, "tokens_per_second") / steady_time
        if steady_time
        else None,
        "sequences_per_second": (
            total(steady, "sequences_per_second") / steady_time
            if steady_time and all(_num(r.get("sequences_per_second")) for r in steady)
            else None
        ),
        # trainer.float8 runs also log mfu_fp8 (against the FP8 peak): weighted the same way
        **{
            key: (
                total(steady, key) / steady_time
                if steady_time and all(_num(r.get(key)) for r in steady)
                else None
            )
            for key in ("mfu", "mfu_fp8")
        },
        "startup_s": startup,
        "train_s": train_time if timed else None,
        "time_s": total_time,
        "usd_per_hour": usd,
        "cost_usd": cost,
        "tokens_per_dollar": tokens / cost if cost and tokens else None,
        "skipped_steps": int(sum(r.get("skipped", 0) for r in rows)),
        "resumes": max(sum("time_to_first_step" in r for r in rows) - 1, 0),
        "estimated": estimated,
    }


def usd_per_hour(run: Run) -> float | None:
    """What the run's machines cost an hour: the price its logged tokens_per_dollar implies (the
    trainer's, which counts every node: cost.usd_per_hour prices one), else the configured price
    (one node); None when no price was configured."""
    for r in run.rows:
        if (
            _num(r.get("tokens_per_dollar"))
            and _num(r.get("tokens_per_second"))
            and r["tokens_per_dollar"] > 0
        ):
            return r["tokens_per_second"] * 3600 / r["tokens_per_dollar"]
    price = ((run.config or {}).get("cost") or {}).get("usd_per_hour")
    if _num(price) and price > 0:
        return float(price)
    return None


def _first_step(run: Run) -> int:
    """The step the logged history starts after (0 for a run that started from scratch)."""
    first = run.rows[0]["step"]
    every = ((run.config or {}).get("trainer") or {}).get("log_every_n_steps") or 1
    return max(first - every, 0)


def _num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# -- labels ----------------------------------------------------------------------------------


def _model_name(cfg: dict) -> str:
    model = cfg.get("model") or {}
    name = model.get("preset") or (
        Path(str(model["init_from"])).name if model.get("init_from") else "custom"
    )
    shape = [
        f"{model[k]}{tag}" for k, tag in (("num_layers", "L"), ("hidden_size", "d")) if k in model
    ]
    return f"{name} {'/'.join(shape)}" if shape and model.get("preset") else name


def _get(cfg: dict, section: str, key: str):
    return (cfg.get(section) or {}).get(key)


def _checkpointing_label(mode) -> str:
    """trainer.activation_checkpointing as a label part; runs from before the modes wrote
    true/false."""
    mode = {True: "full", False: "none", None: "none"}.get(mode, mode)
    # not "no-ckpt": no checkpoints
    return {"none": "no-act-ckpt", "full": "act-ckpt"}.get(mode, f"act-ckpt-{mode}")


def _layout_label(config: dict) -> str:
    """The parallel layout as a label part (tp2 pp2 ep2 fsdp); plain data parallelism or one
    process: "ddp"."""
    parts = [
        f"{short}{n}"
        for short, key in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert"))
        if _num(n := _get(config, "parallel", key)) and n > 1
    ]
    if _get(config, "trainer", "data_parallel") == "fsdp":
        parts.append("fsdp")
    return " ".join(parts) or "ddp"


def _lora_label(lora) -> str:
    """The lora section as a label part: full fine-tuning, or the adapters' rank (QLoRA over an
    NF4 base)."""
    if not isinstance(lora, dict):
        return "full-weights"
    return f"{'qlora' if lora.get('base_dtype') == 'nf4' else 'lora'}-r{lora.get('rank')}"


# What tells runs apart, in the order a label names it.
LABEL_FIELDS = (
    ("model", _model_name),
    ("task", lambda c: _get(c, "data", "task")),
    ("lora", lambda c: _lora_label(c.get("lora"))),
    ("precision", lambda c: _get(c, "trainer", "precision")),
    ("compile", lambda c: "compiled" if _get(c, "trainer", "compile") else "eager"),
    (
        "activation_checkpointing",
        lambda c: _checkpointing_label(_get(c, "trainer", "activation_checkpointing")),
    ),
    ("layout", _layout_label),
    ("global_batch_size", lambda c: f"global={_get(c, 'trainer', 'global_batch_size')}"),
    ("micro_batch_size", lambda c: f"micro={_get(c, 'trainer', 'micro_batch_size')}"),
    ("seq_length", lambda c: f"seq={_get(c, 'data', 'seq_length')}"),
    ("lr", lambda c: f"lr={_get(c, 'optim', 'lr'):g}" if _num(_get(c, "optim", "lr")) else None),
    ("seed", lambda c: f"seed={_get(c, 'trainer', 'seed')}"),
)


def derive_labels(runs: list[Run]) -> list[str]:
    """Each run named by the config fields that differ between the runs (precision, compile,
    model, ...); with nothing differing (or one run): model and precision. Runs without a config,
    or still indistinguishable, get their folder name."""
    configs = [r.config for r in runs if r.config is not None]
    differing = [(name, fn) for name, fn in LABEL_FIELDS if len({str(fn(c)) for c in configs}) > 1]
    fallback = not differing
    if fallback:
        differing = [f for f in LABEL_FIELDS if f[0] in ("model", "precision")]
    labels = []
    for run in runs:
        if run.config is None:
            labels.append(run.path.name)
            continue
        parts = [str(v) for _, fn in differing if (v := fn(run.config)) is not None]
        if fallback and _get(run.config, "trainer", "compile"):
            parts.append("compiled")
        labels.append(" ".join(parts) or run.path.name)
    repeated = {label for label in labels if labels.count(label) > 1}
    return [
        f"{label} ({run.path.name})" if label in repeated else label
        for label, run in zip(labels, runs)
    ]
