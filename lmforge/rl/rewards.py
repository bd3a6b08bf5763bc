"""Reward functions with TRL's signature, so that a TRL user's functions run unchanged.

A reward function is called once per batch of completions, with keyword arguments only, as TRL's
GRPOTrainer calls it:

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns,
       trainer_state=..., log_extra=..., log_metric=...) -> list[float | None]

`prompts` and `completions` are text, or for chat prompts message lists (a completion is then
`[{"role": "assistant", "content": text}]`); `columns` are the record's other fields (an `answer`,
test cases), one value per completion. A `None` leaves that completion out of that function: the
weighted sum over the functions skips it (a NaN-sum), and a completion no function scored has no
reward at all (its advantage is 0).

`grpo.rewards` names them: a built-in (`accuracy`, `format`), `module:function` (a module importable
from the working directory), or `path/to/file.py:function`. They are the user's own code, named in
the user's own config, and run in the training process as TRL runs them.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmforge.errors import UserError
from lmforge.rl.config import R1_FORMAT

RewardFn = Callable[..., list]

_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def completion_text(completion) -> str:
    """A completion's text: itself, or the content of its last message (a chat completion)."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"]) if completion else ""


def boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, braces inside it balanced; None without one."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def extract_answer(text: str) -> str | None:
    """A completion's final answer: its last `\\boxed{}`, else its last number; None when it has neither."""
    found = boxed(text)
    if found is not None:
        return found
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def reference_answer(answer) -> str | None:
    """A record's answer as compared: GSM8K's `... #### 72` is 72, a `\\boxed{}` its content, else the text."""
    if answer is None:
        return None
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    found = boxed(text)
    text = (found if found is not None else text).strip()
    return text or None


def same_answer(got: str, want: str) -> bool:
    """Numbers compare as numbers (1,000 = 1000 = 1000.0), anything else as text with outer
    spaces and a final period trimmed."""
    a, b = _number(got), _number(want)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=0.0, abs_tol=1e-9)
    return got.strip().rstrip(".") == want.strip().rstrip(".")


def accuracy(completions: Sequence, answer: Sequence | None = None, **kwargs) -> list[float | None]:
    """1.0 where the completion's final answer (last `\\boxed{}` or last number) equals the record's `answer`,
    0.0 where it does not; None for a record without an answer."""
    if answer is None:
        raise UserError(
            "the accuracy reward needs an 'answer' field in each record: add one, or choose other grpo.rewards"
        )
    out: list[float | None] = []
    for completion, want in zip(completions, answer):
        want = reference_answer(want)
        if want is None:
            out.append(None)
            continue
        got = extract_answer(completion_text(completion))
        out.append(float(got is not None and same_answer(got, want)))
    return out


def format_reward(pattern: str = R1_FORMAT) -> RewardFn:
    """A reward of 1.0 for a completion whose whole text (outer spaces trimmed) matches
    `pattern`, else 0.0."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise UserError(
            f"grpo.format_pattern is not a valid regular expression ({e}): fix it"
        ) from None

    def format(completions: Sequence, **kwargs) -> list[float | None]:  # noqa: A001 (the reward's name in logs)
        return [
            float(compiled.fullmatch(completion_text(c).strip()) is not None) for c in completions
        ]

    return format


BUILTIN = ("accuracy", "format")


def load_reward(spec: str | RewardFn, format_pattern: str = R1_FORMAT) -> tuple[str, RewardFn]:
    """(name, function) for one entry of grpo.rewards: a built-in, `module:function` or
    `file.py:function`; from Python, a function itself (as TRL's reward_funcs takes one)."""
    if callable(spec):
        return getattr(spec, "__name__", type(spec).__name__), spec
    if spec == "accuracy":
        return "accuracy", accuracy
    if spec == "format":
        return "format", format_reward(format_pattern)
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise UserError(
            f"grpo.rewards: '{spec}' is not a reward function: give a built-in ({', '.join(BUILTIN)}), "
            "module:function or path/to/file.py:function"
        )
    module = _load_module(where, spec)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(
            f"grpo.rewards: '{where}' has no function {name}: check the name after the colon"
        )
    return name, fn


def _load_module(where: str, spec: str):
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise UserError(f"grpo.rewards: file {path} not found (from '{spec}'): check the path")
        unique = f"lmforge_reward_{abs(hash(str(path.resolve())))}"
        loader = importlib.util.spec_from_file_location(unique, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[unique] = module  # dataclasses and pickling look a module up by name
        loader.loader.exec_module(module)
        return module
    cwd = str(Path.cwd())
    if cwd not in sys.path:  # `python -m`'s rule: a module beside the config the user runs from
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name and where.startswith(e.name):
            raise UserError(
                f"grpo.rewards: no module {where} (from '{spec}') in {cwd} or the installed "
                "packages: check its name, or give a path/to/file.py:function"
            ) from None
        raise


@dataclass
class RewardState:
    """What a reward function sees of the run as `trainer_state` (the fields of transformers'
    TrainerState that reward shaping reads)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0


@dataclass
class Scores:
    """The rewards of a batch of completions."""

    # (completions, functions) float32, NaN where a function returned None
    per_function: torch.Tensor
    # (completions,): the weighted NaN-sum over functions; NaN where no function scored
    total: torch.Tensor
    names: list[str]
    # columns the functions logged with log_extra
    extra: dict[str, list] = field(default_factory=dict)
    # scalars they logged with log_metric
    metrics: dict[str, list[float]] = field(default_factory=dict)


class Rewards:
    """The run's reward functions and their weights (grpo.rewards, grpo.reward_weights)."""

    def __init__(
        self,
        specs: Sequence[str | RewardFn],
        weights: Sequence[float] | None = None,
        format_pattern: str = R1_FORMAT,
    ):
        loaded = [load_reward(spec, format_pattern) for spec in specs]
        self.names = [name for name, _ in loaded]
        self.functions = [fn for _, fn in loaded]
        for name, fn in loaded:
            if inspect.iscoroutinefunction(fn):
                raise UserError(f"grpo.rewards: {name} is an async function: give a plain function")
        self.weights = torch.tensor(
            [1.0] * len(specs) if weights is None else list(weights), dtype=torch.float32
        )
        if len(self.weights) != len(self.functions):
            raise UserError(
                f"grpo.reward_weights has {len(self.weights)} weights for {len(self.functions)} "
                "reward functions: give one per function, or none (1.0 each)"
            )

    def __call__(
        self,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        columns: dict[str, list],
        state: RewardState | None = None,
    ) -> Scores:
        """Score completion i of `completions` (with prompts[i] and each column's value i) by
        every function."""
        n = len(completions)
        extra: dict[str, list] = {}
        metrics: dict[str, list[float]] = {}
        kwargs = {
            **columns,
            "trainer_state": state or RewardState(),
            "log_extra": lambda column, values: extra.setdefault(column, []).extend(values),
            "log_metric": lambda name, value: metrics.setdefault(name, []).append(float(value)),
        }
        per_function = torch.zeros(n, len(self.functions), dtype=torch.float32)
        for j, (name, fn) in enumerate(zip(self.names, self.functions)):
            got = fn(
                prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs
            )
            if got is None or len(got) != n:
                raise UserError(
                    f"reward function {name} returned {'None' if got is None else len(got)} rewards for "
                    f"{n} completions: return one per completion (None to leave one out)"
                )
            try:
                per_function[:, j] = torch.tensor(
                    [math.nan if r is None else float(r) for r in got]
                )
            except (TypeError, ValueError):
                bad = next(r for r in got if not isinstance(r, (int, float, type(None))))
                raise UserError(
                    f"reward function {name} returned {bad!r}: return numbers (or None)"
                ) from None
        total = (per_function * self.weights[None]).nansum(dim=1)
        total[per_function.isnan().all(dim=1)] = math.nan
        return Scores(per_function, total, list(self.names), extra, metrics)
