"""A test hook for aiming kills at a checkpoint's moments (tests/train/test_soak.py); it does
nothing unless LMFORGE_TEST_HOLD is set.

With LMFORGE_TEST_HOLD=POINT:STEP, rank 0 stops at POINT of checkpoint STEP, writes its PID to the
file that LMFORGE_TEST_HOLD_FILE names and waits there to be killed. POINT is `save` (nothing
written yet), `written` (the files are in `.step-N.tmp`, not yet checksummed nor renamed), `renamed`
(in place, retention not yet run) or `retention` (checkpoint STEP renamed `.step-N.deleting` by
retention, its files not yet deleted).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def hold_for_test(point: str, step: int, rank: int) -> None:
    if os.environ.get("LMFORGE_TEST_HOLD") != f"{point}:{step}" or rank != 0:
        return
    Path(os.environ["LMFORGE_TEST_HOLD_FILE"]).write_text(f"{os.getpid()}\n")
    while True:
        time.sleep(60)
