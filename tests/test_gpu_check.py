"""scripts/gpu_check.py, the correctness check for GPU machines, run here on the CPU: every check
passes (or says why it was skipped), the report and the table say so, and a greedy row parts from
the reference only at a tie."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _checks():
    """scripts/gpu_checks, the package of the script's checks."""
    if str(SCRIPT.parent) not in sys.path:
        sys.path.insert(0, str(SCRIPT.parent))
    return importlib.import_module("gpu_checks")


@pytest.mark.slow
def test_every_check_passes_on_the_cpu(tmp_path):
    out = tmp_path / "report.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    report = json.loads(out.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    failed = {n: c["error"] for n, c in checks.items() if c["status"] == "fail"}
    assert r.returncode == 0 and not failed, (failed, r.stderr[-3000:])
    assert report["passed"] and report["device"] == "cpu"
    assert list(checks) == list(_checks().CHECKS)  # every check ran
    for c in checks.values():
        assert c["status"] in ("pass", "skip") and c["summary"], c  # a skip says why
    assert checks["environment"]["figures"]["sdpa"]["math"] == "yes"
    train = checks["train"]["figures"]
    assert set(train) == {
        f"{p}{c}" for p in ("fp32", "bf16-mixed", "bf16-sr") for c in ("", " compiled")
    }
    assert all(run["losses"][-1] < run["losses"][0] for run in train.values())
    assert checks["resume"]["figures"]["exact"]  # the CPU resumes bit for bit
    assert "| check | result | figures | seconds |" in r.stdout
    assert all(f"| {name} | {c['status']} |" in r.stdout for name, c in checks.items())


@pytest.mark.slow
def test_a_missing_device_or_an_unknown_check_is_one_line():
    for args in (["--device", "gpu"], ["--device", "cpu", "--only", "parity,nope"]):
        r = subprocess.run(
            [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert r.stderr.startswith("error: ")


def test_greedy_rows_may_part_only_where_the_top_two_tokens_tie(monkeypatch):
    models = _checks().models
    gaps = {(1, 2, 10): 1e-6, (3, 4, 20): 0.3}  # the reference's top-2 gap after each sequence
    monkeypatch.setattr(models, "top2_gap", lambda model, ids: gaps[tuple(ids)])
    prompts, expected = [[1, 2], [3, 4], [5]], [[10, 11, 12], [20, 21, 22], [30, 31]]
    got = [[10, 99, 98], [20, 97, 96], [30, 31]]
    equal, ties, bad = models.compare_greedy(None, prompts, got, expected, tie=1e-4)
    assert (equal, ties) == (1, 1)  # row 0 parts at a tie; row 2 is equal
    assert bad == ["row 1 parts at token 1 (top-2 gap 3.0e-01)"]
