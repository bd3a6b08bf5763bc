"""What the training loop asks after each step: log it? validate? save a checkpoint? stop? Each
policy holds its settings and answers for a step count (`done`: steps trained so far); the loop
(Trainer._fit) only asks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmforge.errors import UserError
from lmforge.train.stopping import StopSignals


@dataclass
class LogCadence:
    every: int  # trainer.log_every_n_steps
    # the step this start trains first: logged whatever `every` says (its time_to_first_step)
    first: int

    def due(self, done: int) -> bool:
        return done % self.every == 0 or done == self.first + 1


@dataclass
class ValidationDue:
    enabled: bool  # validation data, and trainer.val_check_interval > 0
    interval: int
    max_steps: int

    @classmethod
    def of(cls, valid, interval: int, max_steps: int) -> ValidationDue:
        return cls(valid is not None and bool(interval), interval, max_steps)

    def due(self, done: int) -> bool:
        """Every `interval` steps and at the last one."""
        return self.enabled and (done % self.interval == 0 or done == self.max_steps)

    def before_stop(self, metrics: dict[str, float]) -> bool:
        """A run stopped by its time limit validates the step it stops at, unless that step did
        already."""
        return self.enabled and "val_loss" not in metrics


@dataclass
class CheckpointCadence:
    every: int  # checkpoint.every_n_steps (0: at the end only)
    max_steps: int

    def due(self, done: int, out_of_time: bool) -> bool:
        """A periodic checkpoint; not at the last step nor at the time limit, whose save the
        run's end writes."""
        return (
            bool(self.every)
            and done % self.every == 0
            and done != self.max_steps
            and not out_of_time
        )


class TimeLimit:
    """trainer.max_minutes, counted from the loop's start on `clock` (seconds)."""

    def __init__(self, max_minutes: float, max_steps: int, clock: Callable[[], float]):
        self.seconds = 60 * max_minutes if max_minutes else None
        self.max_steps, self.clock = max_steps, clock
        self.started = clock()

    def up(self, done: int) -> bool:
        """Whether the time is up before the last step (which ends the run anyway)."""
        return (
            self.seconds is not None
            and self.clock() - self.started > self.seconds
            and done < self.max_steps
        )


@dataclass
class StopCheck:
    """Whether the run stops after a step: a signal on any rank (Ctrl-C, SIGTERM: save this step,
    stop) or the time limit on any rank's clock (validate, save, stop); every rank gets the same
    answer (StopSignals.agree)."""

    signals: StopSignals
    device: torch.device
    limit: TimeLimit

    def after(self, done: int) -> tuple[int | None, bool]:
        """(the signal that stops the run, or None; whether its time is up)."""
        return self.signals.agree(self.device, self.limit.up(done))

    def signal(self) -> int | None:
        """A signal that came since (during a checkpoint's write): it stops the run at this step,
        not a step later."""
        return self.signals.agree(self.device, False)[0]


def check_skips(consecutive: int, limit: int, step: int, latest: Callable[[], object]) -> None:
    """A UserError once `limit` steps in a row skipped their update for a non-finite loss or
    gradient; `latest` names the last good checkpoint (asked only then)."""
    if consecutive >= limit:
        raise UserError(
            f"{limit} steps in a row had a non-finite loss or gradient (step {step}): lower optim.lr or "
            f"check the data; the last good checkpoint is {latest()}"
        )
