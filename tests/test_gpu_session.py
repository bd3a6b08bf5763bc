"""scripts/gpu_session.py, a GPU lease's work in one call, run here on the CPU: the stages it would run, and a stage
cut at its time limit killed with everything it started while the report still comes back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_session.py"


def test_the_dry_run_lists_each_stage_with_its_limit_and_an_unknown_stage_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["check", "train", "generate", "moe", "optim", "fp8", "eval"]
    assert f"--out {tmp_path}/gpu_check.json" in lines[0]
    assert "--write" in lines[1] and "--device cuda" in lines[1]
    assert "--shape pythia-1.4b" in lines[5] and "fp8" in lines[5]
    r = subprocess.run([sys.executable, str(SCRIPT), "--stages", "train,nope", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown nope" in r.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_stage_past_its_limit_is_killed_with_its_children_and_the_rest_reported(tmp_path):
    out = tmp_path / "out"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--budget", "40", "--stages",
                        "generate,optim", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert time.perf_counter() - t0 < 120  # not the ~3 minutes generate takes whole
    assert r.returncode == 1 and "stages not passed: generate" in r.stdout
    report = json.loads((out / "session.json").read_text())
    generate, optim = report["stages"]
    assert generate["timed_out"] and generate["rc"] is None and 39 <= generate["seconds"] < 60
    assert "skipped" in optim  # nothing left of the budget
    assert "== generate" in (out / "session.log").read_text()
    left = subprocess.run(["pgrep", "-f", "benchmarks/generate.py --device cpu --quick"], capture_output=True)
    assert left.returncode == 1, left.stdout  # no process of the stage outlived it
