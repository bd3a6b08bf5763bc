"""scripts/slurm/preprocess.sbatch: the array tasks, then the merge job they submit, under stand-in
srun/sbatch.

As in test_slurm.py, `srun` runs its command once; `sbatch` records what it was asked to submit, and
the test then runs that job itself, as Slurm would once the array has succeeded. lmforge is the real
one, so the merged files are checked against one preprocess run over the whole input, byte for byte.
"""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.data.preprocess import preprocess
from tests.launch.test_slurm import SRUN

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "preprocess.sbatch"
SBATCH = """#!/usr/bin/env bash
n=$(ls "$SBATCH_LOG" | wc -l)
printf '%s\\0' "$@" > "$SBATCH_LOG/$n"
echo $((9000 + n))
"""


@pytest.fixture
def slurm(tmp_path):
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in (("srun", SRUN), ("sbatch", SBATCH)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    (tmp_path / "sbatch-log").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        PATH=f"{shims}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        SBATCH_LOG=str(tmp_path / "sbatch-log"),
        SLURM_JOB_NAME="lmforge-preprocess",
    )
    return env


def _submitted(log: Path) -> list[list[str]]:
    return [
        (log / name).read_bytes().decode().split("\0")[:-1]
        for name in sorted(os.listdir(log), key=int)
    ]


@pytest.mark.slow  # four lmforge processes
def test_array_then_merge_job_give_the_one_shot_files(tmp_path, slurm, shared_data):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    wiki = (
        (shared_data / "corpora" / "wikitext-2" / "valid.articles.jsonl")
        .read_bytes()
        .splitlines(keepends=True)
    )
    (corpus / "a.jsonl").write_bytes(b"".join(wiki[:6]))
    (corpus / "b.jsonl.gz").write_bytes(gzip.compress(b"".join(wiki[6:9])))
    tok = shared_data / "tokenizers" / "gpt2"
    args = [
        "--input",
        str(corpus / "*.json*"),
        "--output-prefix",
        str(tmp_path / "out" / "wiki"),
        "--tokenizer",
        str(tok),
        "--append-eod",
    ]
    array = dict(
        slurm, SLURM_ARRAY_JOB_ID="4242", SLURM_ARRAY_TASK_MIN="0", SLURM_ARRAY_TASK_COUNT="3"
    )
    for task in range(3):
        r = subprocess.run(
            ["bash", str(SCRIPT), *args],
            cwd=tmp_path,
            env=dict(array, SLURM_ARRAY_TASK_ID=str(task)),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"shard {task}/3: wrote" in r.stdout
    (job,) = _submitted(Path(slurm["SBATCH_LOG"]))  # only the first task submits the merge
    assert "--dependency=afterok:4242" in job and "--job-name=lmforge-preprocess-merge" in job
    script = job.index(str(SCRIPT))
    assert job[script + 1 :] == [*args, "--merge"]
    r = subprocess.run(
        ["bash", *job[script:]],
        cwd=tmp_path,
        env=slurm,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "merged 3 shards" in r.stdout
    one = preprocess(corpus / "*.json*", tmp_path / "one", tok, append_eod=True, progress=False)
    for ext in (".bin", ".idx"):
        merged = (tmp_path / "out" / f"wiki_text_document{ext}").read_bytes()
        assert merged == Path(one.outputs["text"] + ext).read_bytes()


def test_the_script_must_run_as_an_array_of_ids_below_the_shard_count(tmp_path, slurm):
    r = subprocess.run(
        ["bash", str(SCRIPT), "--input", "x"],
        cwd=tmp_path,
        env=slurm,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "submit this script as an array" in r.stderr
    env = dict(
        slurm,
        SLURM_ARRAY_JOB_ID="1",
        SLURM_ARRAY_TASK_ID="3",
        SLURM_ARRAY_TASK_MIN="1",
        SLURM_ARRAY_TASK_COUNT="3",
    )  # --array=1-3: ids must start at 0
    r = subprocess.run(
        ["bash", str(SCRIPT), "--input", "x"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 2 and "array task 3 is not below 3 shards: give --array=0-2" in r.stderr
    assert _submitted(Path(slurm["SBATCH_LOG"])) == []
