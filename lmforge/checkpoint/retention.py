"""Which checkpoints a run keeps: the `save_top_k` best by the monitored metric plus the newest
(`save_last`), and a stop's until a newer one is written (lmforge.checkpoint.manager). A
checkpoint it drops is renamed `.step-N.deleting` before its files go, so a kill mid-deletion
leaves no half checkpoint under a checkpoint's name. A save retention would delete at once
(scored, not among the top k, no save_last) is not written at all (would_drop)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from lmforge.checkpoint.hold import hold_for_test

# its lines are the manager's, as before they moved here
log = logging.getLogger("lmforge.checkpoint.manager")

NAME = re.compile(r"^step-(\d{8})$")
# What a save or a deletion cut short leaves: the folder being written, the folder being deleted.
LEFTOVER = re.compile(r"^\.step-\d{8}\.(tmp|deleting)$")


class Retention:
    """The retention half of CheckpointManager: its `checkpoints()`, `save_top_k`, `monitor`,
    `mode`, `save_last`."""

    def would_drop(self, step: int, metrics: dict) -> bool:
        """Whether checkpoint `step` with `metrics` would go as soon as written: scored, and
        save_top_k checkpoints scored at least as well (retention keeps the older of equals);
        says so. (save_last and a stop's checkpoint keep it: the caller's to check.)"""
        value = metrics.get(self.monitor)
        if not isinstance(value, (int, float)):
            return False
        as_good = [
            v
            for _, path in self.checkpoints()
            if (v := self._metric(path)) is not None
            and (v <= value if self.mode == "min" else v >= value)
        ]
        if len(as_good) < self.save_top_k:
            return False
        log.info(
            "step %d not saved: %s %.6g is not among the best %d checkpoint%s (checkpoint.save_top_k, "
            "save_last=false)",
            step,
            self.monitor,
            value,
            self.save_top_k,
            "s" * (self.save_top_k != 1),
        )
        return True

    def _metric(self, path: Path) -> float | None:
        return self._metrics(path).get(self.monitor)

    @staticmethod
    def _metrics(path: Path) -> dict:
        try:
            metrics = json.loads((path / "trainer.json").read_text()).get("metrics", {})
        except (OSError, ValueError, AttributeError):
            return {}
        return metrics if isinstance(metrics, dict) else {}

    def _apply_retention(self, resume_point: Path | None = None) -> None:
        found = self.checkpoints()
        if self.save_top_k < 0 or not found:
            return
        scored = [(value, path) for _, path in found if (value := self._metric(path)) is not None]
        # The newest is kept as last; where it has no score (saved between validations, or at
        # Ctrl-C) it is kept anyway until a newer one is written: it is where a resume starts.
        keep = (
            {found[-1][1]}
            if self.save_last or found[-1][1] not in {p for _, p in scored}
            else set()
        )
        if not scored and not self._said_unmonitored:
            held = self._metrics(found[-1][1])
            # metrics were recorded, the monitored one is not among them: a typo, or
            # never measured
            if held:
                self._said_unmonitored = True
                log.warning(
                    "checkpoint.monitor=%s is not among the metrics the checkpoints record (%s): retention "
                    "keeps the newest",
                    self.monitor,
                    ", ".join(sorted(held)),
                )
        scored.sort(key=lambda x: x[0], reverse=self.mode == "max")
        keep |= {path for _, path in scored[: self.save_top_k]}
        if not scored and not self.save_last:
            keep.add(found[-1][1])  # never delete everything
        if resume_point is not None:
            keep.add(resume_point)
        for _, path in found:
            if path not in keep:
                self._delete(path)
                log.info("removed checkpoint %s (retention)", path.name)

    @staticmethod
    def _delete(path: Path) -> None:
        """Rename, then delete: a kill mid-deletion leaves `.step-N.deleting`, which the next
        start removes, never a `step-N` with some of its files gone."""
        trash = path
        if not LEFTOVER.match(path.name):
            trash = path.with_name(f".{path.name}.deleting")
            # an earlier deletion of the same step, cut short
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(path, trash)
            if m := NAME.match(path.name):
                hold_for_test(
                    "retention", int(m.group(1)), dist.get_rank() if dist.is_initialized() else 0
                )
        if trash.is_dir():
            shutil.rmtree(trash)
        else:
            trash.unlink(missing_ok=True)
