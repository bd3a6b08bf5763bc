"""Running lm-evaluation-harness offline: tasks by name (lmforge's local ones, yours, lm-eval's),
built one by one so a failure names its task, then lm-eval's own evaluation and results.

    tasks = load_tasks(["sst2_local"], data_dir="/data")
    results = evaluate(LMForgeLM("model_dir"), tasks, num_fewshot=5, limit=200)
    print(results_table(results))

Nothing is downloaded: the Hub is switched off before lm-eval or datasets is imported (set
HF_HUB_OFFLINE=0 yourself to let lm-eval's own tasks fetch their datasets). lm-eval indexes its ~15k
task files in seconds, so names are first looked up among lmforge's tasks and --include-path folders
alone.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.errors import UserError
from lmforge.eval.data import PACKAGED_TASKS

log = logging.getLogger(__name__)

TASKS_DIR = PACKAGED_TASKS  # lmforge's task YAMLs over local files
INSTALL_HINT = (
    'lm-eval is not installed: pip install -e ".[eval]" (or pip install "lm-eval>=0.4.13")'
)
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
LOCAL_HOWTO = (
    "copy its splits to JSONL/TSV files and point a task YAML at them with custom_dataset: "
    "!function lmforge.eval.data.local_dataset (docs/evaluation.md)"
)


def require_lm_eval() -> None:
    """Hub access off (unless the environment already says otherwise), and lm-eval importable."""
    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(INSTALL_HINT) from None


def task_manager(
    names: Sequence[str],
    include_paths: Sequence[str | Path] = (),
    data_dir: str | Path | None = None,
):
    """An lm-eval TaskManager that knows every name in `names` (lmforge's tasks and
    `include_paths` first, lm-eval's own only when a name needs them); an unknown name is a
    UserError with the closest ones."""
    from lm_eval.tasks import TaskManager

    for folder in include_paths:
        if not Path(folder).is_dir():
            raise UserError(
                f"--include-path {folder} is not a folder: give the folder holding your task YAMLs"
            )
    paths = [str(TASKS_DIR), *map(str, include_paths)]
    metadata = {"data_dir": str(data_dir)} if data_dir else {}
    manager = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    if not _unknown(manager, names):
        return manager
    log.info("indexing lm-eval's own tasks (takes a few seconds)")
    manager = TaskManager(include_path=paths, metadata=metadata)
    for name in _unknown(manager, names):
        close = difflib.get_close_matches(name, manager.all_tasks, n=3, cutoff=0.6)
        hint = f" (closest: {', '.join(close)})" if close else ""
        raise UserError(
            f"unknown task '{name}'{hint}: see `lm_eval ls tasks`, or add a task YAML with "
            "--include-path DIR"
        )
    return manager


def _unknown(manager, names: Sequence[str]) -> list[str]:
    return [
        n for n in names if not (manager.match_tasks([n]) if "*" in n else n in manager.all_tasks)
    ]


@dataclass
class Tasks:
    """lm-eval Task and Group objects, their data loaded, and the TaskManager that built them."""

    objects: list
    manager: Any


def load_tasks(
    names: Sequence[str],
    include_paths: Sequence[str | Path] = (),
    data_dir: str | Path | None = None,
) -> Tasks:
    """The named tasks, built one name at a time: a task whose data is not on this machine is a
    UserError naming the task and what it wanted."""
    require_lm_eval()
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise UserError(
            "no tasks given: pass --tasks NAME[,NAME...] (lmforge's own: "
            f"{', '.join(local_task_names())})"
        )
    manager = task_manager(names, include_paths, data_dir)
    built = []
    for pattern in names:
        for name in manager.match_tasks([pattern]) if "*" in pattern else [pattern]:
            try:
                with _quiet_lm_eval():
                    loaded = manager.load([name])
            except UserError as e:
                raise UserError(f"task {name}: {e}") from None
            except Exception as e:  # lm-eval and datasets raise whatever their loaders raise
                raise _task_error(manager, name, e) from e
            groups = loaded.get("groups") or {}
            built += [groups[name]] if name in groups else list(loaded["tasks"].values())
    return Tasks(built, manager)


def _task_error(manager, name: str, error: Exception) -> UserError:
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    entry = manager.task_index.get(name)
    cfg = (getattr(entry, "cfg", None) or {}) if entry is not None else {}
    path = cfg.get("dataset_path")
    if isinstance(error, (ConnectionError, FileNotFoundError)) or "offline" in reason.lower():
        wanted = f"the Hugging Face dataset '{path}'" + (
            f" ({cfg['dataset_name']})" if cfg.get("dataset_name") else ""
        )
        if not path:
            wanted = "a dataset"
        return UserError(
            f"task {name} needs {wanted}, which is not on this machine ({reason}): {LOCAL_HOWTO}"
        )
    return UserError(
        f"task {name} could not be loaded ({type(error).__name__}: {reason}): check its YAML"
    )


def local_task_names() -> list[str]:
    return sorted(p.stem for p in TASKS_DIR.glob("*.yaml"))


def evaluate(
    lm,
    tasks: Tasks,
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    bootstrap_iters: int = 100000,
    log_samples: bool = False,
) -> dict[str, Any]:
    """lm-eval's results dict (results, groups, configs, versions, n-shot, ...) for `tasks` on
    `lm`.

    What lm-eval's simple_evaluate does, with its seeds and few-shot rules, less its environment
    report: that runs torch's collect_env (pip, nvidia-smi, ... in subprocesses), seconds per
    call, in every in-training eval. The config part says what was run instead."""
    import lm_eval
    import numpy as np
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.evaluator import evaluate as run_tasks
    from lm_eval.utils import set_torch_seed

    from lmforge import __version__

    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    if limit is not None and limit <= 0:
        raise UserError(f"--limit must be > 0, got {limit}")
    start = time.time()
    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    set_torch_seed(DEFAULT_OTHER_SEED)
    with _quiet_lm_eval():
        loaded = tasks.manager.load(tasks.objects)
        for task in loaded["tasks"].values():
            shots = task.get_config("num_fewshot")
            # a task that says 0 keeps 0, as in simple_evaluate
            if num_fewshot is not None and shots != 0:
                task.set_config(key="num_fewshot", value=num_fewshot)
            elif shots is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
        results = run_tasks(
            lm=lm,
            task_dict=loaded,
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            log_samples=log_samples,
        )
    results["config"] = {
        "model": "lmforge",
        "model_args": getattr(lm, "name", None),
        "batch_size": getattr(lm, "batch_size", None),
        "device": str(lm.device),
        "limit": limit,
        "num_fewshot": num_fewshot,
        "bootstrap_iters": bootstrap_iters,
        "random_seed": DEFAULT_RANDOM_SEED,
        "numpy_seed": DEFAULT_OTHER_SEED,
        "torch_seed": DEFAULT_OTHER_SEED,
        "fewshot_seed": DEFAULT_OTHER_SEED,
        "lmforge_version": __version__,
        "lm_eval_version": lm_eval.__version__,
    }
    results["date"] = start
    return results


@contextlib.contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval logs a line per task setting at INFO, and warns about every custom_dataset that
    its metadata could pass arguments (which is how data_dir arrives): keep its other warnings."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    hint = _DropMessage("Custom kwargs can be passed")
    task_logger = logging.getLogger("lm_eval.api.task")
    task_logger.addFilter(hint)
    try:
        yield
    finally:
        logger.setLevel(level)
        task_logger.removeFilter(hint)


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def quiet_task_bars() -> Iterator[None]:
    """lm-eval's bar over each task's documents as it builds their requests, off: an eval inside
    training logs one line, not unlabelled bars between the training lines."""
    import functools

    import lm_eval.api.task as task_module
    from tqdm import tqdm

    saved = task_module.tqdm
    task_module.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        task_module.tqdm = saved


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Python, NumPy and torch random states as they were: lm-eval seeds all three, which must
    not change what a training run draws after an evaluation."""
    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    accel = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if accel is not None:
            torch.cuda.set_rng_state_all(accel)


def results_table(results: dict) -> str:
    """lm-eval's results table (and its groups table, when there are groups), as its CLI prints
    them."""
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text


def results_json(results: dict) -> str:
    """The results as lm-eval's CLI writes them (samples left out)."""
    from lm_eval.utils import handle_non_serializable

    kept = {k: v for k, v in results.items() if k != "samples"}
    return json.dumps(kept, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n"


def check_results_path(path: str | Path, param: str = "--output-path") -> Path:
    """`path` as a results file that can be written: checked before any model is loaded, so a bad
    path is one line at once, not a traceback after the whole evaluation. Its missing folders are
    made only when it is written."""
    path = Path(path).expanduser()
    # the rename that writes the file would replace the link: write where it points
    if path.is_symlink():
        path = path.resolve()
    if path.is_dir():
        raise UserError(
            f"{param} {path} is a folder: give a file name such as {path / 'results.json'}"
        )
    # a device or pipe: the rename that writes it would replace it
    if path.exists() and not path.is_file():
        raise UserError(
            f"{param} {path} is not a regular file: give a file name for the results JSON"
        )
    folder = path.parent
    # the nearest folder that is there, or a file in the way
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(
            f"{param} {path} cannot be written: '{folder}' is a file, not a folder: give a path in "
            "another folder (or move that file away)"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        made = "" if folder == path.parent else f" (to make {path.parent})"
        raise UserError(
            f"{param} {path} cannot be written: this user cannot write in '{folder}'{made}: give a path "
            "in a folder you can write"
        )
    return path


def write_results(path: Path, results: dict, param: str = "--output-path") -> None:
    """The results JSON at `path`, written whole or not at all (a temporary sibling renamed over
    it)."""
    from lmforge.fsutil import atomic_write, out_of_space

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, results_json(results))
    except OSError as e:  # the folder changed since check_results_path, or the disk is full
        raise out_of_space(e, path) or UserError(
            f"{param} {path} cannot be written ({e.strerror or e}): give "
            "a path in a folder you can write"
        ) from None


def scalar_metrics(results: dict, prefix: str = "eval/") -> dict[str, float]:
    """Each task's numeric metrics, flat: {"eval/sst2_local/acc": 0.61, ...} (stderr left out)."""
    flat = {}
    for task, metrics in {**results.get("results", {}), **results.get("groups", {})}.items():
        for key, value in metrics.items():
            # lm-eval names them "acc,none": metric, filter ("alias", "sample_len":
            # not)
            metric = key.split(",")[0]
            if (
                "," not in key
                or "_stderr" in metric
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
            ):
                continue
            flat[f"{prefix}{task}/{metric}"] = float(value)
    return flat
