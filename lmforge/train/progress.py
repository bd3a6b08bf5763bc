"""How a run shows its progress: a tqdm bar on a terminal; elsewhere (a log file, a Slurm job, a
pipe) a plain log line at most every `interval` seconds, since a bar's carriage returns pile up
there into one endless line."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger(__name__)

PLAIN_INTERVAL = 30.0  # seconds between plain progress lines


class Progress:
    """Steps `initial` .. `total`; `update(step, metrics)` after each (step = steps done so far)."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        terminal: bool | None = None,
        interval: float = PLAIN_INTERVAL,
        max_seconds: float | None = None,
    ):
        """`max_seconds`: the run stops (trainer.max_minutes) that long after it started, at
        whatever step: the ETA is the sooner of that and the steps' own."""
        self.total, self.initial, self.interval, self.max_seconds = (
            total,
            initial,
            interval,
            max_seconds,
        )
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.started = time.perf_counter()
        # the end of the first step: start-up and compilation are before it
        self.first_done: float | None = None
        self.logged_at: float | None = None  # when the last plain line was written
        self.pending: tuple[int, dict] | None = None  # the last step not shown as a plain line yet
        self.bar = None
        if self.terminal:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total,
                initial=initial,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                mininterval=1.0,
            )

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                loss=f"{metrics['loss']:.3f}",
                tok_s=f"{metrics['tokens_per_second']:.0f}",
                **({"val": f"{metrics['val_loss']:.3f}"} if "val_loss" in metrics else {}),
            )
            return
        now = time.perf_counter()
        if self.first_done is None:
            self.first_done = now
        # The first step, each validation and the last step are always shown; others once per
        # interval.
        if (
            self.logged_at is None
            or "val_loss" in metrics
            or step >= self.total
            or now - self.logged_at >= self.interval
        ):
            self._line(step, metrics, now)
        else:
            self.pending = (step, metrics)

    def _line(self, step: int, metrics: dict[str, float], now: float) -> None:
        done = step - self.initial
        # The steps after the first give the rate: the first holds the start-up (a compiled run's
        # minutes).
        later = done > 1 and self.first_done is not None and now > self.first_done
        rate = (
            (now - self.first_done) / (done - 1)
            if later
            else (now - self.started) / done
            if done > 0
            else 0.0
        )
        parts = [
            f"step {step}/{self.total} ({step / self.total:.0%})",
            f"loss {metrics['loss']:.4f}",
        ]
        for key in ("val_loss", "val_accuracy"):
            if key in metrics:
                parts.append(f"{key} {metrics[key]:.4f}")
        parts.append(f"{metrics['tokens_per_second']:,.0f} tokens/s")
        if step < self.total and rate > 0:
            eta = rate * (self.total - step)
            if self.max_seconds is not None and self.max_seconds - (now - self.started) < eta:
                parts.append(
                    f"ETA {_clock(max(0.0, self.max_seconds - (now - self.started)))} (trainer.max_minutes)"
                )
            else:
                parts.append(
                    f"ETA {_clock(eta)}"
                    + ("" if later else " (at the first step's pace, start-up in it)")
                )
        log.info("%s", ", ".join(parts))
        self.logged_at, self.pending = now, None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.pending is not None:  # a run stopped early (max_minutes) shows where it stopped
            self._line(*self.pending, time.perf_counter())


def _clock(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
