"""scripts/slurm: the compile job then the run job, run for real under stand-in srun/scontrol.

The stand-ins do what Slurm would on a one-node allocation: `srun` runs its command once,
`scontrol show hostnames` names this host, `scontrol requeue` is recorded. torchrun, the
rendezvous and lmforge are the real ones, so the sbatch scripts' commands are tested as written.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "scripts" / "slurm"

SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done   # srun's own options
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") echo 127.0.0.1 ;;
  *) echo "$@" >> "$SCONTROL_LOG" ;;
esac
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def slurm_env(tmp_path):
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(
        os.environ,
        PATH=f"{shims}:{torchrun.parent}:{os.environ['PATH']}",
        SLURM_JOB_NODELIST="node0",
        SLURM_NNODES="1",
        SLURM_JOB_ID="4242",
        GPUS_PER_NODE="1",
        RDZV_PORT=str(_free_port()),
        COMPILE_CACHE=str(tmp_path / "cache"),
        SCONTROL_LOG=str(tmp_path / "scontrol.log"),
        FI_PROVIDER="",
    )
    return env


def _args(corpus, run_dir, *extra):
    return [
        os.devnull,
        "model.preset=tiny-neox",
        f"data.paths=[{corpus}]",
        "data.seq_length=32",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=4",
        "trainer.val_check_interval=2",
        "trainer.val_batches=1",
        "trainer.precision=fp32",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
        f"run_dir={run_dir}",
        *extra,
    ]


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_compile_job_then_run_job_reuses_the_cache(tiny_corpus, slurm_env, tmp_path):
    run_dir = tmp_path / "run"
    for script, extra in (("compile.sbatch", []), ("pretrain.sbatch", ["trainer.max_steps=2"])):
        r = subprocess.run(
            ["bash", str(SLURM / script), *_args(tiny_corpus, run_dir, *extra)],
            cwd=tmp_path,
            env=slurm_env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, f"{script}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        if script == "compile.sbatch":
            compiled = _files(tmp_path / "cache")
            assert compiled, "the compile job left no cache"
    # The run job found every graph in the cache: it added nothing to it, and it finished.
    assert _files(tmp_path / "cache") == compiled
    assert (run_dir / "checkpoints").is_dir() or any(run_dir.glob("**/trainer.json"))
    assert (run_dir / "metrics.jsonl").read_text().count('"step"') >= 2


@pytest.mark.slow
def test_run_job_requeues_itself_before_the_time_limit(tiny_corpus, slurm_env, tmp_path):
    # Slurm sends USR1 to the batch shell (--signal=B:USR1@300); the script must requeue its own
    # job.
    args = _args(tiny_corpus, tmp_path / "run", "trainer.max_steps=100000")
    out = tmp_path / "job.out"
    with out.open("wb") as sink:
        p = subprocess.Popen(
            ["bash", str(SLURM / "pretrain.sbatch"), *args],
            cwd=tmp_path,
            env=slurm_env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        time.sleep(3)  # the script has set its trap and started srun
        p.send_signal(signal.SIGUSR1)
        p.wait(timeout=60)
    finally:  # the training it started is still running: stop the whole group
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    log = Path(slurm_env["SCONTROL_LOG"])
    assert log.exists() and log.read_text().split() == ["requeue", "4242"], out.read_text()[-2000:]


def test_scripts_parse():
    for script in (*SLURM.glob("*.sbatch"), SLURM / "common.sh"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script


@pytest.mark.parametrize("script", ["compile.sbatch", "pretrain.sbatch"])
def test_overrides_with_spaces_reach_lmforge_whole(slurm_env, tmp_path, script):
    # bash -c re-splits what it is given: an override such as a system prompt must still arrive as
    # one argument.
    shims = Path(slurm_env["PATH"].split(":")[0])
    (shims / "torchrun").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ARGV_LOG"\n')
    (shims / "torchrun").chmod(0o755)
    env = dict(slurm_env, ARGV_LOG=str(tmp_path / "argv"), COMPILE_CACHE=str(tmp_path / "a cache"))
    args = ["my config.yaml", "sft.system=You are terse.", "data.paths=[a, b]", "x='quoted'"]
    r = subprocess.run(
        ["bash", str(SLURM / script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    start = argv.index("lmforge.cli") + 2  # after the verb
    assert argv[start : start + 4] == args
    assert f"trainer.compile_cache_dir={tmp_path / 'a cache'}" in argv


def test_a_spooled_copy_submitted_from_elsewhere_finds_its_helpers(slurm_env, tmp_path):
    """sbatch runs a copy of the script from its spool folder: the copy found common.sh only when
    the job was submitted from the checkout (scripts/slurm/common.sh relative to the working
    folder)."""
    shims = Path(slurm_env["PATH"].split(":")[0])
    (shims / "torchrun").write_text("#!/usr/bin/env bash\n")
    (shims / "torchrun").chmod(0o755)
    spool = tmp_path / "spool"
    spool.mkdir()
    (spool / "slurm_script").write_text((SLURM / "pretrain.sbatch").read_text())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run(
        ["bash", str(spool / "slurm_script"), "my.yaml"],
        cwd=elsewhere,
        env=slurm_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr


def test_the_training_jobs_ask_for_the_gpus_they_start_ranks_for():
    """Without a GPU request, a cluster that confines a job to the devices it asked for shows its
    ranks none, and trainer.device=auto trains on the CPU."""
    per_node = re.search(r"GPUS_PER_NODE:=(\d+)", (SLURM / "common.sh").read_text()).group(1)
    for script in ("compile.sbatch", "pretrain.sbatch"):
        assert f"#SBATCH --gpus-per-node={per_node}\n" in (SLURM / script).read_text(), script
