"""The run folder's files beside its checkpoints: metric rows trimmed on resume, leftovers of killed
writes, and `finished.json`, the record of how the run's last invocation ended.

`finished.json` is written once a run has trained, saved and exported (not when it is stopped by a
signal): {"step", "elapsed" (the run's wall clock at its end, on from the checkpoint's across
resumes: set-up, steps, validation, checkpoint writes, the export), "tokens" (the whole run's; null
when it resumed from a checkpoint of an older lmforge), "usd_per_hour" (every node's), "checkpoint"
(the newest checkpoint it left)}. `lmforge compare` reads its time and tokens from it, so the table
and the run's last line give one figure. A rerun reads its step: with checkpoint.save_last=false
retention may remove the final step's checkpoint (it is not among the top k), and the run is
finished all the same. A run that trains again removes it first.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from lmforge.fsutil import atomic_write, out_of_space, remove_leftovers

log = logging.getLogger(__name__)

FINISHED = "finished.json"


def begin_training(
    run_dir: Path,
    start: int,
    config_yaml: str,
    resumed_from: Path | None,
    changes: dict,
    consumed_samples: int,
) -> None:
    """The run folder as a start trains on from step `start`: its config, the changes since the
    checkpoint it resumed from (lmforge.train.resume), no finished.json (the end recorded is not
    its end), no metric rows past `start`."""
    from lmforge.checkpoint.manager import DISK_FIX
    from lmforge.train.resume import record_changes

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        record_changes(run_dir, start, resumed_from, changes, consumed_samples)
        atomic_write(run_dir / "config.yaml", config_yaml)
        forget_finished(run_dir)
        truncate_metrics(run_dir / "metrics.jsonl", start)
    except OSError as e:  # a full disk is one line here too, as for a checkpoint
        if (full := out_of_space(e, run_dir, fix=DISK_FIX)) is None:
            raise
        raise full from None


def write_finished(
    run_dir: Path,
    step: int,
    elapsed: float,
    tokens: float | None,
    usd_per_hour: float,
    newest: Path | None,
) -> None:
    record = {
        "step": step,
        "elapsed": elapsed,
        "tokens": tokens,
        "usd_per_hour": usd_per_hour,
        "checkpoint": newest.name if newest is not None else None,
    }
    atomic_write(Path(run_dir) / FINISHED, json.dumps(record, indent=1) + "\n")


def read_finished(run_dir: Path) -> dict | None:
    """The record of the run's last end, or None where there is none (or it is not a record)."""
    try:
        record = json.loads((Path(run_dir) / FINISHED).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def finished_already(cfg) -> str | None:
    """A rerun's last line, said before anything is read or built, where its folder records an
    end (finished.json) at or past trainer.max_steps under the very config it ran with
    (config.yaml, to the byte), with its export in place and the checkpoint it ended with still
    there; else None, and the Trainer decides (it resumes, checking the checkpoint's files and
    the config's changes): a finished 7B run's rerun read its source and checked a 90 GB
    checkpoint to say there was nothing to do."""
    from lmforge.train.config import to_yaml

    run_dir = Path(cfg.run_dir)
    record = read_finished(run_dir)
    if record is None or record["step"] < cfg.trainer.max_steps:
        return None
    try:
        if (run_dir / "config.yaml").read_text() != to_yaml(cfg):
            return None
    except OSError:
        return None
    kept = record.get("checkpoint")
    if not isinstance(kept, str) or not (run_dir / "checkpoints" / kept / "trainer.json").is_file():
        return None
    if cfg.checkpoint.convert_to_hf and not (run_dir / "hf").is_dir():
        return None
    return (
        f"the run is at step {record['step']} already (trainer.max_steps={cfg.trainer.max_steps}): nothing to "
        "train, nothing written; raise trainer.max_steps to train it further"
    )


def forget_finished(run_dir: Path) -> None:
    (Path(run_dir) / FINISHED).unlink(missing_ok=True)


def end_step(run_dir: Path, step: int, max_steps: int, say: bool) -> int:
    """The step the run ended at: its record's, where retention removed that step's checkpoint
    (not one the run kept and that is gone since: a copy, a hand's deletion), else `step`, the
    checkpoint's it resumes at. Where the run is to train on from an older checkpoint, say
    (`say`) that those steps are trained again."""
    record = read_finished(run_dir)
    removed = record is not None and record.get("checkpoint") != f"step-{record['step']:08d}"
    ended = max(step, record["step"]) if removed else step
    if say and step < ended < max_steps:
        log.warning(
            "the run had reached step %d, whose checkpoint retention removed (checkpoint.save_last=false): "
            "it goes on from step %d, training steps %d-%d again",
            ended,
            step,
            step + 1,
            ended,
        )
    return ended


def truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop metric rows past the checkpoint (a killed run may have logged beyond it)
    and any line that is not a whole row (one cut off when the run was killed while writing it)."""
    if not path.exists():
        return
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line: the killed run was writing it
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            rows.append(line)
    atomic_write(path, "".join(r + "\n" for r in rows))


def remove_run_leftovers(run_dir: Path, held: bool) -> None:
    """What a killed run's writes left in its folder and the folders it exports
    (`.model.tmp-PID`, ...: see fsutil.remove_leftovers); checkpoints/ has names of its own,
    cleaned by the resume. All of them where this run holds the folder (`held`), else only those
    of processes no longer running."""
    if not run_dir.is_dir():
        return
    for folder in [
        run_dir,
        *(p for p in sorted(run_dir.iterdir()) if p.is_dir() and p.name not in SKIP_LEFTOVERS),
    ]:
        for path in remove_leftovers(folder, only_dead=not held):
            log.warning("cleaned up %s, left by a run killed while writing it", path)


# Not ours to clean: checkpoints (their own names, the resume cleans them) and torch.compile's
# cache.
SKIP_LEFTOVERS = ("checkpoints", "compile_cache", "tensorboard")
