"""data.task=grpo in the trainer: a tiny model learns the toy task; one step's loss and gradients
equal the same step computed by hand with lmforge.rl (whose parts are checked against TRL in
tests/rl); DDP equals one process; a stopped run resumes exactly; LoRA's reference is the base
without adapters; the refusals are one line."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lmforge.errors import UserError
from lmforge.rl import toy
from lmforge.rl.advantages import group_advantages
from lmforge.rl.data import reward_completions, reward_inputs
from lmforge.rl.loss import policy_loss
from lmforge.rl.rewards import RewardState
from lmforge.rl.rollout import completion_logps, rollout
from lmforge.train.config import load_run_config
from lmforge.train.trainer import Trainer
from tests.parallel.launch import torchrun


@pytest.fixture(scope="module")
def toy_task(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    toy.write_tokenizer(out / "tokenizer.json")
    toy.write_prompts(out / "prompts.jsonl", 64)
    return out


def _args(task_dir: Path, run_dir: Path, *overrides: str) -> list[str]:
    return [
        "model.preset=tiny-neox",
        f"model.vocab_size={len(toy.WORDS)}",
        f"data.tokenizer={task_dir}/tokenizer.json",
        "data.task=grpo",
        f"data.train_file={task_dir}/prompts.jsonl",
        "data.seq_length=32",
        "grpo.rewards=[lmforge.rl.toy:target_fraction]",
        "grpo.num_generations=8",
        "grpo.max_completion_length=8",
        "trainer.micro_batch_size=16",
        "trainer.global_batch_size=32",
        "trainer.max_steps=24",
        "optim.lr=1e-2",
        "optim.warmup_steps=2",
        "trainer.precision=fp32",
        "trainer.progress_bar=false",
        "cost.peak_flops=1e11",
        "trainer.log_every_n_steps=1",
        "checkpoint.convert_to_hf=false",
        f"run_dir={run_dir}",
        *overrides,
    ]


def _config(task_dir, run_dir, *overrides):
    return load_run_config(None, _args(task_dir, run_dir, *overrides))


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_tiny_model_learns_the_toy_task(toy_task, tmp_path):
    """The mean reward of the last steps far above the first steps' (a fresh model writes the
    target ~1 word in 38)."""
    Trainer(_config(toy_task, tmp_path / "run", "grpo.beta=0.04", "trainer.max_steps=16")).fit()
    rows = _rows(tmp_path / "run")
    first, last = (sum(r["reward"] for r in part) / len(part) for part in (rows[:4], rows[-4:]))
    assert first < 0.15 and last > first + 0.5, (first, last)
    assert all(r["reward"] == r["rewards/target_fraction/mean"] for r in rows)
    # the reference: the initial model
    assert rows[0]["kl"] == 0 and all(r["kl"] > 0 for r in rows[1:])
    # below log(38) at the start, then it narrows
    assert rows[-1]["entropy"] < rows[0]["entropy"] <= 3.7
    assert all(1 <= r["completions/mean_length"] <= 8 for r in rows)
    # fp32: the trainer's recomputation is within a few units in the last place of the rollout's
    # decode
    assert all(0 <= r["logprob_diff"] < 1e-5 for r in rows)
    # num_iterations=1: the ratio is exactly 1
    assert all(r["clip_ratio/region_mean"] == 0 for r in rows)


def _first_step(cfg):
    """The trainer's first step: (loss, gradient norm, {name: gradient}, the model before it, the
    micro-batches)."""
    trainer = Trainer(cfg)
    before = copy.deepcopy(trainer.model)
    from lmforge.train.data import micro_batches

    t = cfg.trainer
    batches = micro_batches(
        trainer.data.train,
        0,
        t.max_steps * t.global_batch_size,
        t.micro_batch_size,
        0,
        1,
        0,
        trainer.data.collate,
    )
    micro = [next(batches) for _ in range(trainer.grad_accum)]
    rolled = trainer.task.before_step(micro, trainer.training, 0)
    loss, norm = trainer.training.step(rolled, trainer.training.global_counts(rolled), 1e9)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.close()
    return trainer, loss, norm, grads, before, micro


@pytest.mark.parametrize(
    "loss_type, beta", [("dapo", 0.0), ("grpo", 0.04), ("dr_grpo", 0.0), ("bnpo", 0.0)]
)
def test_one_step_equals_lmforge_rl_by_hand(toy_task, tmp_path, loss_type, beta):
    """Two accumulated micro-batches: rollout, rewards, group advantages, completion_logps and
    policy_loss by hand on a copy of the model, (sum of the losses) / (sum of the counts), the
    same seeds: the same loss and gradient."""
    cfg = _config(
        toy_task,
        tmp_path / "run",
        f"grpo.loss_type={loss_type}",
        f"grpo.beta={beta}",
        "grpo.max_completion_length=6",
    )
    trainer, loss, norm, grads, model, micro = _first_step(cfg)
    g, task = cfg.grpo, trainer.task
    reference = copy.deepcopy(model).requires_grad_(False)
    total, count = 0.0, 0
    for m in micro:
        records = m["records"][:: g.num_generations]
        with torch.no_grad():
            model.eval()
            batch = rollout(
                model,
                [r.ids for r in records],
                g.num_generations,
                g.max_completion_length,
                seed=task._seed(m["first_slot"]),
            )
            model.train()
        ids = batch.completions()
        prompts, columns = reward_inputs(records, g.num_generations)
        texts = reward_completions(trainer.tokenizer, records, ids, g.num_generations, [0])
        scores = task.rewards(prompts, texts, ids, columns, RewardState(0, cfg.trainer.max_steps))
        assert scores.total.std() > 0  # a batch that has something to learn from
        adv = group_advantages(scores.total, g.num_generations, "group").advantages
        args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
        logps, _ = completion_logps(model, *args)
        ref = completion_logps(reference, *args)[0] if beta else None
        part, n, _ = policy_loss(
            logps,
            adv,
            batch.loss_mask(False),
            loss_type=loss_type,
            beta=beta,
            ref_logps=ref,
            max_completion_length=g.max_completion_length,
        )
        total, count = total + part, count + n
    (total / count).backward()
    assert loss == pytest.approx(float(total.detach() / count), rel=1e-6, abs=1e-7)
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(want) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-7, msg=name)
    norm_want = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(v) for v in want.values()])
    )
    assert norm == pytest.approx(float(norm_want), rel=1e-5)


@pytest.mark.slow
def test_lora_reference_is_the_base_without_adapters(toy_task, tmp_path):
    """After some steps (the adapters trained), the reference log-probabilities are those of the
    initial model built again, with no adapters at all; the policy's differ from them."""
    from lmforge.models import build

    cfg = _config(
        toy_task,
        tmp_path / "run",
        "lora.rank=4",
        "lora.targets=all-linear",
        "grpo.beta=0.04",
        "trainer.max_steps=4",
        "optim.lr=5e-2",
    )
    trainer = Trainer(cfg)
    trainer.fit()
    assert trainer.task.lora_reference and trainer.task.reference is None
    rows = _rows(tmp_path / "run")
    assert rows[-1]["kl"] > 0  # the adapters moved the policy away from the base
    base = build({**trainer.model.config.__dict__}, seed=cfg.trainer.seed)
    ids = torch.tensor([[12, 13, 14, 15]])
    parts = (
        ids[:, :2],
        torch.ones(1, 2, dtype=torch.long),
        ids[:, 2:],
        torch.ones(1, 2, dtype=torch.long),
    )
    with torch.no_grad():
        got = trainer.task.reference_logps(trainer.model, parts)
        want = completion_logps(base.eval(), *parts)[0]
        policy = completion_logps(trainer.model.eval(), *parts)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert not torch.allclose(policy, want, atol=1e-4)


STOPPER = """
import os, signal
from pathlib import Path
from lmforge.rl.toy import target_fraction

def reward(completions, trainer_state, **kwargs):
    marker = Path(os.environ.get("GRPO_STOP_AT", "/nonexistent"))
    if marker.exists() and trainer_state.global_step == 3:  # SIGTERM during step 4's rollout
        marker.unlink()
        os.kill(os.getpid(), signal.SIGTERM)
    return target_fraction(completions, **kwargs)
"""


@pytest.mark.slow
def test_a_stopped_run_resumes_exactly(toy_task, tmp_path, monkeypatch):
    """Stopped by SIGTERM at step 4 of 8 (checkpointed there) and run again: every step's loss,
    gradient norm and reward equal the uninterrupted run's: the rollouts draw the same tokens
    after the resume."""
    from lmforge.train.stopping import Stopped

    (tmp_path / "stopper.py").write_text(STOPPER)
    spec = f"grpo.rewards=[{tmp_path}/stopper.py:reward]"
    over = (spec, "trainer.max_steps=8", "checkpoint.every_n_steps=100")
    Trainer(_config(toy_task, tmp_path / "whole", *over)).fit()
    marker = tmp_path / "stop"
    marker.touch()
    monkeypatch.setenv("GRPO_STOP_AT", str(marker))
    with pytest.raises(Stopped):
        Trainer(_config(toy_task, tmp_path / "stopped", *over)).fit()
    assert max(r["step"] for r in _rows(tmp_path / "stopped")) == 4
    Trainer(_config(toy_task, tmp_path / "stopped", *over)).fit()

    def curve(run):
        return [(r["step"], r["loss"], r["grad_norm"], r["reward"]) for r in _rows(run)]

    assert curve(tmp_path / "stopped") == curve(tmp_path / "whole")


@pytest.mark.slow
@pytest.mark.parametrize("data_parallel, beta", [("ddp", 0.0), ("fsdp", 0.04)])
def test_two_processes_equal_one(toy_task, tmp_path, data_parallel, beta):
    """Two steps over 2 gloo ranks (a micro-batch each) equal one process accumulating the same 2
    micro-batches: DDP, and FSDP2 (the rollout on the gathered parameters, the reference sharded
    like the policy)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = (
        "trainer.max_steps=2",
        "trainer.dist_backend=gloo",
        "trainer.device=cpu",
        f"grpo.beta={beta}",
        f"trainer.data_parallel={data_parallel}",
    )
    one = _args(toy_task, tmp_path / "one", *common)
    two = _args(toy_task, tmp_path / "two", *common)
    import subprocess

    subprocess.run(
        [sys.executable, "-m", "lmforge.cli", "finetune", os.devnull, *one],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    done = torchrun(2, ["-m", "lmforge.cli", "finetune", os.devnull, *two], env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        keys = ("loss", "grad_norm", "reward", "reward_std", "entropy", "completions/mean_length")
        for key in keys + (("kl",) if beta else ()):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), key


def test_refusals_are_one_line(toy_task, tmp_path):
    from lmforge.train.tasks import get_task

    cases = {
        "grpo.num_iterations=2": r"^grpo\.num_iterations=2: reusing a batch of rollouts .* is coming; set ",
        "trainer.micro_batch_size=12": r"^trainer\.micro_batch_size=12 is not a multiple of grpo\.num_generations=8",
        "grpo.num_generations=1": r"^grpo\.num_generations must be >= 2",
    }
    for override, message in cases.items():
        batch = ["trainer.global_batch_size=48"] if "12" in override else []
        cfg = _config(toy_task, tmp_path / "run", override, *batch)
        with pytest.raises(UserError, match=message) as e:
            get_task("grpo").build_data(
                cfg, None if "iterations" in override else _tokenizer(toy_task)
            )
        assert "\n" not in str(e.value)
    cfg = _config(toy_task, tmp_path / "run")
    layout = SimpleNamespace(data_shard=1, tensor=1, pipeline=1, expert=2)
    with pytest.raises(
        UserError, match=r"^data\.task=grpo under expert parallelism \(parallel\.expert=2\) is not "
    ) as e:
        get_task("grpo").prepare(None, cfg, layout, torch.device("cpu"))
    assert "\n" not in str(e.value)


def _tokenizer(task_dir):
    from lmforge.tokenizers import load_tokenizer

    return load_tokenizer(task_dir / "tokenizer.json")


@pytest.mark.slow
def test_chat_prompts_train_and_the_export_carries_their_template(toy_task, tmp_path):
    """Chat-message prompts are rendered by data.chat_template; the Hugging Face export holds
    that template."""
    from lmforge.chat_template import builtin_template

    prompts = tmp_path / "chats.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "a b c"}], "target": "7"}] * 8
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _config(
        toy_task,
        tmp_path / "run",
        f"data.train_file={prompts}",
        "data.chat_template=plain",
        "data.seq_length=64",
        "trainer.max_steps=2",
        "trainer.micro_batch_size=8",
        "trainer.global_batch_size=8",
        "grpo.num_generations=4",
        "checkpoint.convert_to_hf=true",
    )
    trainer = Trainer(cfg)
    trainer.fit()
    assert len(_rows(tmp_path / "run")) == 2
    want = builtin_template("plain", trainer.tokenizer.add_bos_token)
    assert (tmp_path / "run" / "hf" / "chat_template.jinja").read_text() == want
