"""tests/conftest.py reports a test that fails with lmforge's refusal of this torch as skipped,
and only that one: a refusal naming a release this torch already is (a wrong refusal) stays a
failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.parallel.mesh import torch_version

ROOT = Path(__file__).resolve().parents[1]


# its failure quotes the refusals of its cases: a failure here stays one
@pytest.mark.no_refusal_skip
def test_only_a_refusal_of_this_torch_is_a_skip(tmp_path):
    major, minor = torch_version()
    (tmp_path / "test_cases.py").write_text(f"""
import pytest
from lmforge.errors import UserError

def test_refused_for_a_later_release():
    raise UserError("X needs torch {major}.{minor + 1} or later (the schedule's why); this is ...: upgrade torch")

def test_refused_for_this_release():
    raise UserError("pipeline parallelism on the CPU needs torch {major}.{minor} or later: upgrade torch")

def test_refused_as_this_release():
    raise UserError("FSDP2 on the CPU needs a newer torch than {major}.{minor}.0 (why): upgrade torch")

def test_refused_as_an_older_release():
    raise UserError("FSDP2 on the CPU needs a newer torch than {major}.{minor - 1}.0 (why): upgrade torch")

@pytest.fixture
def refused():
    raise UserError("tracing needs torch {major}.{minor + 3} or later (a backend); this is ...")

def test_refused_in_a_fixture(refused):
    pass

def test_other_failure():
    assert False, "needs torch"
""")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-q",
            "-rA",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_cases.py"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    lines = run.stdout.splitlines()
    # CI adds " - why"
    failed = {line.split("::")[-1].split(" - ")[0] for line in lines if line.startswith("FAILED")}
    skipped = [line for line in lines if line.startswith("SKIPPED")]
    assert failed == {
        "test_refused_for_this_release",
        "test_refused_as_an_older_release",
        "test_other_failure",
    }, run.stdout
    assert len(skipped) == 3 and all("refused on torch" in line for line in skipped), run.stdout
    assert any(
        f"needs torch {major}.{minor + 1} or later (the schedule's why); this is ...: upgrade torch"
        in s
        for s in skipped
    )
