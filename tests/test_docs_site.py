"""The docs site builds with `mkdocs build --strict`: a broken link or anchor, a page missing
from the nav, or a missing included file (BENCHMARKS.md) fails here, before a reader meets it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip(
        "mkdocs", reason="mkdocs is not installed (pip install -e '.[test]' brings it)"
    )
    pytest.importorskip(
        "material", reason="mkdocs-material is not installed (pip install -e '.[test]' brings it)"
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    site = tmp_path / "site"
    for page in (
        "data",
        "pretraining",
        "fine-tuning",
        "serving",
        "reference/config",
        "reference/cli",
        "benchmarks",
    ):
        assert (site / page / "index.html").is_file(), page
    # The benchmarks page is BENCHMARKS.md itself, included whole.
    assert (
        "Training step: lmforge vs transformers" in (site / "benchmarks" / "index.html").read_text()
    )
