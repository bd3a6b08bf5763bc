"""What a resume may change: the run's config at its checkpoint against the config it is resumed
with.

A checkpoint carries the model's config (lmforge.json) and the run's (trainer.json's `run_config`;
for checkpoints written before it, RUN_DIR/config.yaml stands in). Before its tensors are loaded the
two are compared:

* Refused, in one line naming each key (old -> new): what would make the checkpoint another run's.
  - The model's architecture (every ModelConfig field but those in RESUMABLE_MODEL_FIELDS). DCP
    loads only the tensors the new model asks for: a 1-layer model took layer 0 of a 2-layer
    checkpoint and dropped the rest, and a rotary_pct change loaded every weight into a model that
    computes something else, both with exit 0.
  - The task (another head, another loss) and the LoRA adapters' shape (on/off, rank, alpha,
    targets).
  - trainer.global_batch_size and data.seq_length: they change what a step is. The steps taken were
    of the old size, and the run's place in the data is a count of samples (consumed_samples, as
    Megatron keeps it) that the learning-rate schedule and the sample total were laid out with; a
    sample of another length is another sample stream. Neither NeMo nor torchtitan users expect a
    resume to change them under the same step counter: a context extension or a new batch size is a
    new phase, started from the checkpoint's weights (model.init_from=CHECKPOINT in a new run_dir),
    with its own schedule. (micro_batch_size and the parallel layout may change: they regroup the
    same global batch.)
* Allowed, listed in one warning and appended to RUN_DIR/history.jsonl: everything else (optim.lr,
  trainer.max_steps, validation and checkpoint cadence, dropout, precision, the layout, ...). A new
  data mix (data.paths, data.split, data.train_file) or trainer.seed is how a run is annealed on
  other data in Megatron/NeMo practice: the sample order is rebuilt for the new values and the run
  goes on at the same sample count, which the warning says. So is another number of processes
  (trainer.json's `processes`): the same global batches, regrouped, continue the curve but not bit
  for bit.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from lmforge.config import from_dict
from lmforge.errors import UserError
from lmforge.fsutil import atomic_write
from lmforge.models.config import ModelConfig
from lmforge.models.io import read_config
from lmforge.models.source import CONTEXT_OVERRIDES, RUN_OVERRIDES, checkpoint_run, run_path
from lmforge.train.config import RunConfig, run_dict

log = logging.getLogger(__name__)

# ModelConfig fields a resume may change: no weight's shape or meaning depends on them. Those a run
# may set on top of model.init_from (dropout, the router losses' coefficients) but the vocabulary
# padding, which shapes the embedding, and the rotary context, which changes what the model
# computes; and those used only at initialisation or by generation.
RESUMABLE_MODEL_FIELDS = (
    *(
        f
        for f in RUN_OVERRIDES
        if f != "make_vocab_size_divisible_by" and f not in CONTEXT_OVERRIDES
    ),
    "init_std",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
# ModelConfig fields the task sets (a classification head): a change there is another task, not
# another model.
TASK_FIELDS = ("num_labels", "pooler")
# Run keys a resume refuses, and why (see the module docstring).
REFUSED = {
    "data.task": "another task",
    "lora": "other LoRA adapters",
    "lora.rank": "other LoRA adapters",
    "lora.alpha": "other LoRA adapters",
    "lora.targets": "other LoRA adapters",
    "trainer.global_batch_size": "another step size",
    "data.seq_length": "another sample length",
}
# Allowed changes after which the samples come in another order (the warning says so).
DATA_ORDER = (
    "data.paths",
    "data.split",
    "data.valid_paths",
    "data.train_file",
    "data.max_train_examples",
    "trainer.seed",
)
HISTORY = "history.jsonl"
# Not part of what the run is: the folder it is in (a relative or an absolute spelling of the same
# one).
IGNORED = ("run_dir",)


@dataclass
class ConfigDiff:
    """The check a resume runs on the checkpoint it chose, before loading it
    (CheckpointManager.resume's `check`): raises a UserError for a refused change, keeps the
    allowed ones in `changes`."""

    cfg: RunConfig
    model_config: ModelConfig
    run_dir: Path
    # this run's world size: another than the checkpoint's is listed as a change
    processes: int | None = None
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def __call__(self, checkpoint: Path) -> None:
        refused, self.changes = compare(
            saved_run_config(checkpoint, self.run_dir),
            read_config(checkpoint),
            self.cfg,
            self.model_config,
        )
        saved_processes = checkpoint_processes(checkpoint)
        if None not in (saved_processes, self.processes) and saved_processes != self.processes:
            self.changes["processes"] = (saved_processes, self.processes)
        moved = self.changes.pop("model.init_from", None)
        if moved is not None and not same_source(checkpoint, *moved):
            # Another starting model of the same shape is refused (the resume would never read it);
            # a source no longer where the run found it (moved, renamed) is only noted.
            old = run_path(checkpoint, moved[0]) if moved[0] else None
            (refused if old is not None and old.exists() else self.changes)["model.init_from"] = (
                moved
            )
        if refused:
            raise UserError(refusal(refused, self.run_dir, checkpoint))


def same_source(checkpoint: Path, old: str | None, new: str | None) -> bool:
    """Whether two spellings of model.init_from (the checkpoint's run's, relative to where it
    ran; this run's) name the same folder."""
    if not old or not new:
        return old == new
    return run_path(checkpoint, old).resolve() == Path(new).resolve()


def checkpoint_processes(checkpoint: Path) -> int | None:
    """How many processes wrote the checkpoint (trainer.json's `processes`), None where it does
    not say (older)."""
    try:
        processes = json.loads((checkpoint / "trainer.json").read_text()).get("processes")
    except (OSError, ValueError, AttributeError):
        return None
    return processes if isinstance(processes, int) else None


def saved_run_config(checkpoint: Path, run_dir: Path) -> dict | None:
    """The run config a checkpoint was written under: trainer.json's, else the run folder's
    config.yaml (older checkpoints), else None."""
    saved = checkpoint_run(checkpoint)
    if saved is None and (run_dir / "config.yaml").is_file():
        try:
            saved = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
        except Exception as e:  # noqa: BLE001 - OmegaConf and YAML errors: compare the model alone
            log.warning(
                "cannot read %s (%s): only the model is compared with the checkpoint",
                run_dir / "config.yaml",
                e,
            )
            saved = None
    return saved if isinstance(saved, dict) else None


def compare(
    saved_run: dict | None, saved_model: ModelConfig, cfg: RunConfig, model_config: ModelConfig
) -> tuple[dict[str, tuple[Any, Any]], dict[str, tuple[Any, Any]]]:
    """(refused, allowed) changes from the saved run to `cfg`, each `dotted key -> (old, new)`."""
    changes: dict[str, tuple[Any, Any]] = {}
    old_model, new_model = dataclasses.asdict(saved_model), dataclasses.asdict(model_config)
    for name in new_model:
        if old_model.get(name) != new_model[name]:
            changes[f"model.{name}"] = (old_model.get(name), new_model[name])
    if saved_run is not None:
        old, new = _normalized(saved_run), run_dict(cfg)
        for key in ("preset", "init_from"):  # the model itself is compared above, resolved
            if old.get("model", {}).get(key) != new["model"].get(key):
                changes[f"model.{key}"] = (old.get("model", {}).get(key), new["model"].get(key))
        if (old.get("lora") is None) != (new.get("lora") is None):
            changes["lora"] = (old.get("lora"), new.get("lora"))
            old, new = {**old, "lora": None}, {**new, "lora": None}
        flat_old, flat_new = _flat(old), _flat(new)
        for key in sorted(flat_old.keys() | flat_new.keys()):
            if key.split(".")[0] not in ("model", *IGNORED) and flat_old.get(key) != flat_new.get(
                key
            ):
                changes[key] = (flat_old.get(key), flat_new.get(key))
    refused = {
        k: v
        for k, v in changes.items()
        if k in REFUSED
        or (
            k.startswith("model.")
            and k.removeprefix("model.") not in (*RESUMABLE_MODEL_FIELDS, "preset", "init_from")
        )
    }
    return refused, {k: v for k, v in changes.items() if k not in refused}


def _normalized(saved: dict) -> dict:
    """A saved run config with today's defaults filled in (a key added since it was written is no
    change), or as saved where it no longer parses (a key since renamed: compared as it stands)."""
    rest = {k: v for k, v in saved.items() if k != "model"}
    try:
        return {**run_dict(from_dict(RunConfig, rest)), "model": saved.get("model") or {}}
    except (UserError, TypeError, ValueError):
        return {**saved, "model": saved.get("model") or {}}


def _flat(data: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool | int | float | str):
        return str(value)
    return json.dumps(value)


def listing(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} {show(old)} -> {show(new)}" for k, (old, new) in changes.items())


def refusal(refused: dict[str, tuple[Any, Any]], run_dir: Path, checkpoint: Path) -> str:
    """One line: what differs from the checkpoint, and the two ways on."""

    def reason(key: str) -> str:
        if key.startswith("model."):
            return "another task" if key.removeprefix("model.") in TASK_FIELDS else "another model"
        return REFUSED[key]

    reasons = sorted({reason(k) for k in refused})
    # Only the vocabulary's padding (a tensor-parallel degree it does not divide): the weights carry
    # over re-padded.
    padding = set(refused) == {"model.make_vocab_size_divisible_by"}
    model = "another model" in reasons and not padding
    fix = (
        "give a new run_dir to train the changed model"
        if model
        else f"continue from its weights in a new run_dir with model.init_from={checkpoint}"
        + (" (it re-pads the vocabulary)" if padding else "")
    )
    them = "it" if len(refused) == 1 else "them"
    return (
        f"cannot resume '{run_dir}' from {checkpoint.name} with {' and '.join(reasons)}: {listing(refused)}. "
        f"Set {them} back to resume this run, or {fix}"
    )


def record_changes(
    run_dir: Path,
    step: int,
    checkpoint: Path | None,
    changes: dict[str, tuple[Any, Any]],
    consumed_samples: int,
) -> None:
    """The allowed changes of a resume: one warning, and a line appended to
    RUN_DIR/history.jsonl."""
    if not changes:
        return
    order = [k for k in changes if k in DATA_ORDER]
    note = (
        f"; {', '.join(order)} rebuild{'s' if len(order) == 1 else ''} the sample order: the run goes on at "
        f"sample {consumed_samples:,} of the new order"
        if order
        else ""
    )
    if "processes" in changes:  # the same global batch, regrouped: its sums add up in another order
        note += (
            "; other processes regroup the same global batches: the curve goes on, not bit for bit"
        )
    log.warning(
        "resuming '%s' at step %d with changed settings: %s%s (recorded in %s)",
        run_dir,
        step,
        listing(changes),
        note,
        run_dir / HISTORY,
    )
    row = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "step": step,
        "checkpoint": checkpoint.name if checkpoint is not None else None,
        "changes": {k: {"old": old, "new": new} for k, (old, new) in changes.items()},
    }
    path = run_dir / HISTORY
    before = path.read_text() if path.is_file() else ""
    if before and not before.endswith("\n"):
        before += "\n"
    atomic_write(path, before + json.dumps(row) + "\n")
