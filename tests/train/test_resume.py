"""Exact resume: kill -9 a run mid-flight, rerun the same command, get the same curve bit for
bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest


def _command(corpus, run_dir, precision, extra=()):
    return [
        sys.executable,
        "-m",
        "lmforge.cli",
        "pretrain",
        os.devnull,
        "model.preset=tiny-neox",
        f"data.paths=[{corpus}]",
        "data.seq_length=32",
        "trainer.max_steps=12",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=4",
        "trainer.val_check_interval=4",
        "trainer.val_batches=1",
        "checkpoint.every_n_steps=4",
        "checkpoint.save_top_k=-1",
        f"trainer.precision={precision}",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
        "model.dropout=0.1",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
        f"run_dir={run_dir}",
        *extra,
    ]


def _curve(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r.get("val_loss")) for r in rows]


# LoRA with dropout on the adapters: their masks, too, must be drawn again exactly after a resume.
LORA = ("lora.rank=4", "lora.targets=all-linear", "lora.dropout=0.1", "optim.lr=3e-2")


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision, extra",
    [("fp32", ()), ("bf16-sr", ()), ("fp32", LORA), ("fp32", ("data.num_workers=2",))],
    ids=["fp32", "bf16-sr", "lora", "loader-workers"],
)
def test_killed_run_resumes_bit_exactly(precision, extra, tiny_corpus, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        _command(tiny_corpus, tmp_path / "whole", precision, extra),
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _command(tiny_corpus, killed, precision, extra),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and any(
            json.loads(x)["step"] >= 6 for x in metrics.read_text().splitlines() if x
        ):
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_at_kill = max(s for s, *_ in _curve(killed))
    assert 6 <= steps_at_kill < 12
    assert [p.name for p in sorted((killed / "checkpoints").glob("step-*"))][-1] == "step-00000004"
    subprocess.run(
        _command(tiny_corpus, killed, precision, extra),
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert _curve(killed) == _curve(tmp_path / "whole")  # exact float equality, every step


def test_the_cuda_generator_is_checkpointed_with_the_others(monkeypatch):
    """Dropout on a GPU draws from the device's generator: a resume that restored only the CPU
    ones would not continue the curve bit for bit there. (A stand-in device generator: this
    machine has no CUDA.)"""
    import torch

    from lmforge.checkpoint.rng import rng_state, set_rng_state

    device_state = {"now": torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda device="cuda": device_state["now"].clone()
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda t, device="cuda": device_state.update(now=t.clone())
    )
    saved = json.loads(json.dumps(rng_state()))  # what the rng-rank file holds
    assert saved["cuda"] == list(range(16))
    device_state["now"] = torch.zeros(16, dtype=torch.uint8)
    set_rng_state(saved)
    assert device_state["now"].tolist() == list(range(16))
