"""data.task=grpo under tensor and pipeline parallelism on 2 gloo ranks equals one process: every
rank rolls out the tokens one process rolls out (on its whole copy of the live weights), and each
step's loss, rewards, KL and gradient norm, and the trained parameters, are one process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.parallel.launch import torchrun
from tests.train.test_grpo import _args, _rows, toy_task  # noqa: F401 (a fixture)

# A reward that records what each rank rolled out, then scores as the toy task does.
RECORDER = """
import json, os
from lmforge.rl.toy import target_fraction

def reward(completions, completion_ids, **kwargs):
    path = os.path.join(os.environ["GRPO_TOKENS"], "rank" + os.environ.get("RANK", "0") + ".jsonl")
    with open(path, "a") as f:
        f.write(json.dumps(completion_ids) + "\\n")
    return target_fraction(completions, completion_ids=completion_ids, **kwargs)
"""

COMMON = (
    "trainer.max_steps=2",
    "trainer.dist_backend=gloo",
    "trainer.device=cpu",
    "grpo.beta=0.04",
    "model.make_vocab_size_divisible_by=256",  # the padded vocabulary splits over 2 TP ranks
    # Adam divides by sqrt(v) + eps: at 1e-8 an element of gradient ~1e-9 moves by ~lr on
    # summation-order noise; 1e-3 keeps the update a smooth function of the gradient
    "optim.eps=1e-3",
)
KEYS = ("loss", "grad_norm", "reward", "reward_std", "kl", "entropy", "completions/mean_length")


def _run(task_dir: Path, run: Path, world: int, *layout: str) -> list[list]:
    """A run's metrics rows and what each of its ranks rolled out."""
    tokens = run / "tokens"
    tokens.mkdir(parents=True)
    (run / "recorder.py").write_text(RECORDER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPO_TOKENS": str(tokens)}
    args = _args(task_dir, run, *COMMON, f"grpo.rewards=[{run}/recorder.py:reward]", *layout)
    command = ["-m", "lmforge.cli", "finetune", os.devnull, *args]
    if world == 1:
        subprocess.run([sys.executable, *command], check=True, env=env, capture_output=True)
    else:
        done = torchrun(world, command, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    ranks = sorted(tokens.iterdir())
    assert len(ranks) == world
    return [[json.loads(line) for line in r.read_text().splitlines()] for r in ranks]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from lmforge.models.source import load_pretrained

    model = load_pretrained(run / "checkpoints" / "step-00000002", dtype=torch.float32)
    return model.state_dict()


LORA = ("lora.rank=4", "lora.targets=all-linear", "optim.lr=5e-2")


@pytest.fixture(scope="module")
def one_process(toy_task, tmp_path_factory):  # noqa: F811
    """One process's run (and its rollout tokens), with or without LoRA, each made once."""
    runs = {}

    def run(lora: bool):
        if lora not in runs:
            path = tmp_path_factory.mktemp("grpo-one") / "run"
            (tokens,) = _run(toy_task, path, 1, *(LORA if lora else ()))
            runs[lora] = path, tokens
        return runs[lora]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [("parallel.tensor=2",), ("parallel.pipeline=2",), ("parallel.pipeline=2", *LORA)],
    ids=["tp2", "pp2", "pp2-lora"],
)
def test_two_ranks_equal_one_process(toy_task, one_process, tmp_path, layout):  # noqa: F811
    """Under LoRA the reference is the policy's stages with their adapters off, and the rollout
    copy holds the adapters too."""
    one, tokens = one_process(LORA[0] in layout)
    two = tmp_path / "run"
    for rank_tokens in _run(toy_task, two, 2, *layout):
        assert rank_tokens == tokens  # every rank, every step's every micro-batch
    a, b = _rows(one), _rows(two)
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        for key in KEYS:
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), key
    assert b[-1]["kl"] > 0  # the reference was scored
    want, got = _weights(one), _weights(two)
    assert want.keys() == got.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-5, msg=name)
