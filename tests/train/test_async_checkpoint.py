"""checkpoint.async_save=true: training goes on while a checkpoint is written, and the
checkpoints are those a synchronous save writes, never torn (a kill -9 mid-write leaves the
previous one), one save in flight at a time."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemWriter

from lmforge.errors import UserError
from lmforge.train.trainer import Trainer
from tests.train.conftest import run_config

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _pretrain(corpus, run_dir, *extra) -> list[str]:
    return [
        "pretrain",
        os.devnull,
        "model.preset=tiny-neox",
        f"data.paths=[{corpus}]",
        "data.seq_length=32",
        "trainer.max_steps=12",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        "trainer.val_check_interval=4",
        "trainer.val_batches=1",
        "trainer.precision=fp32",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "model.dropout=0.1",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
        "checkpoint.every_n_steps=4",
        "checkpoint.save_top_k=-1",
        f"run_dir={run_dir}",
        *extra,
    ]


def _launch(ranks: int) -> list[str]:
    if ranks == 1:
        return [sys.executable]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
    ]


def _curve(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r.get("val_loss")) for r in rows]


def _contents(checkpoint: Path) -> dict:
    """What a checkpoint holds, less what differs between any two runs: DCP's .metadata carries a
    random save id, trainer.json the wall clock and the run's config (its run_dir and
    checkpoint.async_save), and Python's and NumPy's generators (which no step draws from) start
    unseeded."""
    files = json.loads((checkpoint / "checksums.json").read_text())["files"]
    trainer = json.loads((checkpoint / "trainer.json").read_text())
    trainer.pop("elapsed"), trainer.pop("run_config")
    out = {"trainer": trainer}
    for name, entry in files.items():
        if name.startswith("rng-rank"):
            out[name] = json.loads((checkpoint / name).read_text())["torch"]
        elif name not in (".metadata", "trainer.json"):
            out[name] = entry
    return out


# The step-8 write of each rank never finishes once its shard is written: a marker says so, and the
# test kills the run (every rank: SIGKILL, what kill -9 sends) once training has gone on past it.
KILLED_MID_WRITE = """
import os, sys, threading
from pathlib import Path
from torch.distributed.checkpoint import FileSystemWriter

real = FileSystemWriter.write_data

def write_data(self, plan, planner):
    written = real(self, plan, planner)
    if ".step-00000008.tmp" in str(self.path):
        Path(sys.argv[1], "writing-" + os.environ.get("RANK", "0")).touch()
        threading.Event().wait()
    return written

FileSystemWriter.write_data = write_data
from lmforge.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "two-fsdp-ranks"])
def test_async_checkpoints_equal_sync_ones_and_a_kill_mid_write_resumes(
    ranks, tiny_corpus, tmp_path
):
    layout = ("trainer.data_parallel=fsdp",) if ranks > 1 else ()

    def run(run_dir: Path, *extra: str) -> None:
        proc = subprocess.run(
            [
                *_launch(ranks),
                "-m",
                "lmforge.cli",
                *_pretrain(tiny_corpus, run_dir, *layout, *extra),
            ],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=420,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]

    run(tmp_path / "sync")
    run(tmp_path / "async", "checkpoint.async_save=true")
    for step in (4, 8, 12):
        name = f"checkpoints/step-{step:08d}"
        # every shard's SHA-256
        assert _contents(tmp_path / "async" / name) == _contents(tmp_path / "sync" / name)
    assert _curve(tmp_path / "async") == _curve(tmp_path / "sync")

    killed, markers = tmp_path / "killed", tmp_path / "markers"
    markers.mkdir()
    script = tmp_path / "killed_mid_write.py"
    script.write_text(KILLED_MID_WRITE)
    launch = _launch(ranks)
    proc = subprocess.Popen(
        [
            *launch,
            str(script),
            str(markers),
            *_pretrain(tiny_corpus, killed, *layout, "checkpoint.async_save=true"),
        ],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # The held write never ends by itself: whatever fails below, the run is killed (torchrun's
    # workers sit in sessions of their own and die with their launcher through PR_SET_PDEATHSIG), so
    # no test leaves it behind.
    try:
        deadline = time.time() + 300
        metrics = killed / "metrics.jsonl"
        held = False
        while time.time() < deadline and proc.poll() is None:
            rows = metrics.read_text().splitlines() if metrics.exists() else []
            stepped = any(json.loads(x)["step"] >= 9 for x in rows if x)
            if stepped and len(list(markers.iterdir())) == ranks:
                held = True
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be killed"
        assert held, "step 9 was not trained with step 8's write held within 300 s"
    finally:
        # Step 9 was trained while step 8's write was in flight; kill every process of the run.
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    ckpts = killed / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".step-00000008.tmp", "step-00000004"]
    assert not (ckpts / ".step-00000008.tmp" / "checksums.json").exists()
    rerun = subprocess.run(
        [
            *launch,
            "-m",
            "lmforge.cli",
            *_pretrain(tiny_corpus, killed, *layout, "checkpoint.async_save=true"),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from" in rerun.stderr and "step-00000004 at step 4" in rerun.stderr
    assert _curve(killed) == _curve(tmp_path / "sync")  # steps 5-12 again, bit for bit
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "step-00000004",
        "step-00000008",
        "step-00000012",
    ]


class _Events(logging.Handler):
    """What happened, in order, from the training loop and from the checkpoint writer's thread."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("saved checkpoint"):
            self.seen.append("sealed " + Path(record.args[0]).name)


@pytest.mark.slow
def test_training_goes_on_while_a_checkpoint_is_written_one_save_at_a_time(
    tiny_corpus, tmp_path, monkeypatch
):
    """The step-2 write holds until step 3 has been trained: with a save that blocked the loop,
    step 3 could never come (the write would give up waiting, and the order below would not
    hold). The step-4 save starts only once step 2's is in place."""
    events = _Events()
    stepped = threading.Event()
    real_write, real_step = FileSystemWriter.write_data, Trainer.train_step
    waited: list[bool] = []

    def write_data(self, plan, planner):
        step = Path(str(self.path)).name
        events.seen.append(f"writing {step}")
        if step == ".step-00000002.tmp":
            waited.append(stepped.wait(timeout=120))
        return real_write(self, plan, planner)

    def train_step(self, batches):
        out = real_step(self, batches)
        events.seen.append(f"trained {self.state['step'] + 1}")
        if self.state["step"] + 1 == 3:
            stepped.set()
        return out

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    monkeypatch.setattr(Trainer, "train_step", train_step)
    logger = logging.getLogger("lmforge.checkpoint.manager")
    logger.addHandler(events)
    level = logger.level
    # (setLevel, not the attribute: it clears the cached answer of an earlier test's)
    logger.setLevel(logging.INFO)
    try:
        Trainer(
            run_config(
                tiny_corpus,
                tmp_path / "run",
                "trainer.max_steps=6",
                "checkpoint.every_n_steps=2",
                "checkpoint.save_top_k=-1",
                "checkpoint.async_save=true",
            )
        ).fit()
    finally:
        logger.removeHandler(events)
        logger.setLevel(level)
    seen = events.seen
    assert waited == [True]
    assert (
        seen.index("writing .step-00000002.tmp")
        < seen.index("trained 3")
        < seen.index("sealed step-00000002")
    )
    assert seen.index("sealed step-00000002") < seen.index("writing .step-00000004.tmp")
    assert seen.index("sealed step-00000004") < seen.index("writing .step-00000006.tmp")
    assert seen[-1] == "sealed step-00000006"  # the end of the run waits for the last one
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step-00000002",
        "step-00000004",
        "step-00000006",
    ]


def test_a_failed_background_write_is_one_error_at_the_next_save(
    tiny_corpus, tmp_path, monkeypatch
):
    """A full disk met by the write in the background: the run stops at its next save (here the
    last) with the one line a synchronous save gives, the temporary folder removed."""
    import errno

    real_write = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if ".step-00000002.tmp" in str(self.path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    trainer = Trainer(
        run_config(
            tiny_corpus,
            tmp_path / "run",
            "trainer.max_steps=3",
            "checkpoint.every_n_steps=2",
            "trainer.val_check_interval=0",
            "checkpoint.async_save=true",
        )
    )
    with pytest.raises(
        UserError, match=f"disk full writing '{tmp_path / 'run' / 'checkpoints' / 'step-00000002'}'"
    ):
        trainer.fit()
    assert trainer.state["step"] == 3  # step 3 was trained while the write failed
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []
