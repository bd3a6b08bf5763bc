"""lmforge.train.policies: what the training loop asks after each step, answered for a whole
run's steps."""

from __future__ import annotations

import pytest

from lmforge.errors import UserError
from lmforge.train.policies import (
    CheckpointCadence,
    LogCadence,
    TimeLimit,
    ValidationDue,
    check_skips,
)


def test_validation_every_interval_and_at_the_last_step_only_with_data():
    due = ValidationDue.of(valid=[0], interval=4, max_steps=10)
    assert [done for done in range(1, 11) if due.due(done)] == [4, 8, 10]
    assert not any(ValidationDue.of(None, 4, 10).due(d) for d in range(1, 11))  # no validation data
    # val_check_interval=0
    assert not any(ValidationDue.of([0], 0, 10).due(d) for d in range(1, 11))
    assert due.before_stop({"loss": 1.0}) and not due.before_stop({"val_loss": 1.0})


def test_checkpoints_every_n_steps_but_not_at_the_end_or_the_time_limit():
    cadence = CheckpointCadence(every=3, max_steps=9)
    # 9: the end's save
    assert [done for done in range(1, 10) if cadence.due(done, out_of_time=False)] == [3, 6]
    assert not cadence.due(6, out_of_time=True)
    assert not any(CheckpointCadence(0, 9).due(d, False) for d in range(1, 10))


def test_the_first_step_of_each_start_is_logged():
    logged = LogCadence(every=5, first=7)  # resumed at step 7
    assert [done for done in range(8, 21) if logged.due(done)] == [8, 10, 15, 20]


def test_the_time_limit_counts_from_its_start_and_never_stops_the_last_step():
    now = [100.0]
    limit = TimeLimit(max_minutes=1, max_steps=5, clock=lambda: now[0])
    assert not limit.up(2)
    now[0] = 161.0
    assert limit.up(2) and not limit.up(5)
    assert not TimeLimit(None, 5, clock=lambda: now[0]).up(2)


def test_too_many_skipped_steps_in_a_row_is_one_line_naming_the_last_good_checkpoint():
    asked = []
    check_skips(2, 3, 10, lambda: asked.append(1))
    assert not asked  # the checkpoint is looked for only when the run stops
    with pytest.raises(
        UserError, match=r"^3 steps in a row .* \(step 11\): .* checkpoint is step-00000008$"
    ):
        check_skips(3, 3, 11, lambda: "step-00000008")
