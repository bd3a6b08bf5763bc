"""scripts/gpu_session.py (scripts/dev/gpu_session.py, through the path sessions call), a GPU
lease's work in one call, run here on the CPU: the stages it would run, and a stage cut at its
time limit killed with everything it started while the report still comes back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_session.py"


def test_the_dry_run_lists_each_stage_with_its_limit_and_an_unknown_stage_is_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [
        "check",
        "train",
        "generate",
        "moe",
        "optim",
        "lora",
        "fp8",
        "eval",
    ]
    assert f"--out {tmp_path}/gpu_check.json" in lines[0]
    assert "--write" in lines[1] and "--device cuda" in lines[1]
    assert (
        "benchmarks/lora.py --device cuda --write --precision bf16 --qlora --shape pythia-410m"
        in lines[5]
    )
    assert lines[5].endswith("(limit 150 s)")
    assert "--shape pythia-1.4b" in lines[6] and "fp8" in lines[6]
    # --quick: the same stages on tiny shapes, nothing written to BENCHMARKS.md.
    r = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--dry-run",
            "--quick",
            "--device",
            "cpu",
            "--stages",
            "lora",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "benchmarks/lora.py --device cpu --quick --precision bf16 --qlora (limit" in r.stdout
    assert "--write" not in r.stdout
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--stages", "train,nope", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "unknown nope" in r.stderr.strip().splitlines()[-1]
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--limit", "train", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "give STAGE=SECONDS" in r.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_stage_past_its_limit_is_killed_with_its_children_and_the_rest_reported(tmp_path):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    # The check stage limited to 5 s (its quick CPU round takes 25 s or more), the budget to 34:
    # optim is left 29 s, under the 30 s a stage needs to start.
    r = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--quick",
            "--budget",
            "34",
            "--limit",
            "check=5",
            "--stages",
            "check,optim",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert time.perf_counter() - t0 < 120
    assert r.returncode == 1 and "stages not passed: check, optim (skipped)" in r.stdout
    report = json.loads((out / "session.json").read_text())
    check, optim = report["stages"]
    assert check["timed_out"] and check["rc"] is None and 4 <= check["seconds"] < 15
    assert "skipped" in optim
    assert "== check" in (out / "session.log").read_text()
    # This test's stage only (its --out): another test may be running gpu_check.py beside it (pytest
    # -n).
    left = subprocess.run(
        ["pgrep", "-f", f"scripts/gpu_check.py --device cpu --out {out}/"], capture_output=True
    )
    assert left.returncode == 1, left.stdout  # no process of the stage outlived it
