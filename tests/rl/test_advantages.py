"""Rewards, group advantages and the truncated-completion mask against TRL's GRPOTrainer: its own
_generate_and_score_completions (with its _calculate_rewards calling our reward functions, as it
calls a TRL user's) run on a stand-in trainer whose generation returns fixed completions."""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch

from lmforge.rl.advantages import group_advantages
from lmforge.rl.rewards import Rewards

trl_grpo = pytest.importorskip(
    "trl.trainer.grpo_trainer", reason="TRL (a test extra) is the reference"
)

EOS, PAD, G = 2, 0, 4
PROMPTS = ["What is 6 x 7?", "What is 2 + 2?", "Name a colour."]
# GSM8K's form; a bare number; none: accuracy leaves the record out
ANSWERS = ["#### 42", "4", None]
COMPLETIONS = [
    "<think>6 x 7</think> <answer>\\boxed{42}</answer>",
    "It is 41.",
    "I think 42",
    "42 or 43, so 43",
    "<think>2+2</think> <answer>4</answer>",
    "<think>sum</think> <answer>4</answer>",
    "four",
    "2 + 2 = 4.",
    "<think>hm</think> <answer>red</answer>",
    "blue",
    "green",
    "<think>x</think><answer>y</answer>",
]
# Completion ids: the last two of each group reach the length limit without eos (truncated), the
# others end in it.
IDS = [[5, 6, EOS] if i % G < 2 else [5, 6, 7, 8] for i in range(len(COMPLETIONS))]


def length_bonus(completions, completion_ids, difficulty, log_metric, **kwargs):
    """A user's reward reading an extra column; None for the "easy" records (left out of this
    function's sum)."""
    log_metric("length_bonus/called", 1.0)
    return [None if d == "easy" else -0.1 * len(ids) for ids, d in zip(completion_ids, difficulty)]


def _trl(funcs, names, weights, scale_rewards, mask_truncated, records):
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(
            device=torch.device("cpu"),
            gather=lambda x: x,
            process_index=0,
            is_main_process=True,
            num_processes=1,
        ),
        model=types.SimpleNamespace(training=True, is_gradient_checkpointing=False),
        environment_factories=None,
        environments=None,
        tools=None,
        pad_to_multiple_of=None,
        _tokenizer=types.SimpleNamespace(pad_token_id=PAD),
        eos_token_ids=[EOS],
        mask_truncated_completions=mask_truncated,
        num_iterations=1,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        beta=0.0,
        ref_model=None,
        args=types.SimpleNamespace(
            per_device_train_batch_size=len(records),
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            gradient_checkpointing_kwargs=None,
            report_to=[],
        ),
        state=types.SimpleNamespace(global_step=0),
        reward_funcs=funcs,
        reward_func_names=names,
        reward_processing_classes=[None] * len(funcs),
        reward_weights=torch.tensor(weights),
        num_generations=G,
        multi_objective_aggregation="sum_then_normalize",
        scale_rewards=scale_rewards,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _logs={
            "prompt": [],
            "completion": [],
            "rewards": defaultdict(list),
            "advantages": [],
            "extra": defaultdict(list),
        },
        _pending_extra_logs=defaultdict(list),
        _pending_metrics=defaultdict(list),
        log_multimodal=False,
    )
    for name in ("_calculate_rewards", "_log_completion_extra", "_log_metric"):
        setattr(trainer, name, types.MethodType(getattr(trl_grpo.GRPOTrainer, name), trainer))
    trainer._generate = lambda prompts: (
        [[1, 3]] * len(prompts),
        IDS,
        None,
        COMPLETIONS,
        None,
        {},
        None,
        None,
    )
    out = trl_grpo.GRPOTrainer._generate_and_score_completions(trainer, [dict(r) for r in records])
    return out, trainer


def _records():
    difficulty = ["hard", "easy", "hard"]
    return [
        {"prompt": PROMPTS[i // G], "answer": ANSWERS[i // G], "difficulty": difficulty[i // G]}
        for i in range(len(COMPLETIONS))
    ]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("weights", [None, [1.0, 0.5, 2.0]])
def test_rewards_and_advantages_equal_trls(scale_rewards, weights):
    rewards = Rewards(["accuracy", "format", f"{__name__}:length_bonus"], weights)
    records = _records()
    want, trainer = _trl(
        rewards.functions, rewards.names, weights or [1.0] * 3, scale_rewards, False, records
    )
    columns = {k: [r[k] for r in records] for k in ("answer", "difficulty")}
    scores = rewards([r["prompt"] for r in records], COMPLETIONS, IDS, columns)
    trl_rewards = torch.tensor([trainer._logs["rewards"][n] for n in rewards.names]).T
    torch.testing.assert_close(scores.per_function, trl_rewards, equal_nan=True)
    # None: left out
    assert math.isnan(scores.per_function[8, 0]) and math.isnan(scores.per_function[4, 2])
    got = group_advantages(scores.total, G, scale_rewards)
    torch.testing.assert_close(got.advantages, want["advantages"])
    assert got.zero_std_fraction == pytest.approx(
        trainer._metrics["train"]["frac_reward_zero_std"][0]
    )
    assert scores.metrics == {"length_bonus/called": [1.0]}
    assert float(torch.nanmean(scores.total)) == pytest.approx(
        trainer._metrics["train"]["reward"][0]
    )


def test_a_completion_no_function_scores_gets_advantage_zero_as_in_trl():
    rewards = Rewards(["accuracy"])
    records = _records()
    want, _ = _trl(rewards.functions, rewards.names, [1.0], "group", False, records)
    scores = rewards(
        [r["prompt"] for r in records], COMPLETIONS, IDS, {"answer": [r["answer"] for r in records]}
    )
    assert scores.total[8:].isnan().all()  # the record without an answer
    got = group_advantages(scores.total, G)
    assert (got.advantages[8:] == 0).all()
    torch.testing.assert_close(got.advantages, want["advantages"])


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_truncated_completions_masked_as_trl_masks_them(mask_truncated):
    from lmforge.rl.rollout import loss_mask

    rewards = Rewards(["format"])
    want, _ = _trl(rewards.functions, rewards.names, [1.0], "group", mask_truncated, _records())
    ids = torch.tensor([row + [PAD] * (4 - len(row)) for row in IDS])
    completion_mask = (torch.arange(4)[None] < torch.tensor([len(r) for r in IDS])[:, None]).long()
    truncated = torch.tensor([row[-1] != EOS for row in IDS])
    got = loss_mask(completion_mask, truncated, mask_truncated)
    assert torch.equal(want["completion_ids"], ids)
    assert torch.equal(got, want["completion_mask"].long())
    assert int(got.sum()) == (18 if mask_truncated else 42)  # 6 ended rows of 3, 6 cut at 4
