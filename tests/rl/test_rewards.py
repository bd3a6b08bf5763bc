"""The built-in rewards on GSM8K's real records and against TRL's think_format_reward; loading
module:function and file.py:function specs; the one-line errors of a reward function or a grpo.*
setting that cannot run."""

from __future__ import annotations

import json
import sys

import pytest

from lmforge.errors import UserError
from lmforge.rl.config import GRPOConfig
from lmforge.rl.rewards import Rewards, accuracy, format_reward, load_reward, reference_answer


@pytest.fixture(scope="module")
def gsm8k(shared_data) -> list[dict]:
    lines = (shared_data / "rl" / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines[:300]]


def test_accuracy_reads_gsm8ks_answers(gsm8k):
    """GSM8K's solutions end in '#### N' (N may have thousands commas): the whole solution is the
    record's answer."""
    answers = [r["answer"] for r in gsm8k]
    finals = [a.rsplit("#### ", 1)[1].strip() for a in answers]
    assert any("," in f for f in finals)  # the commas are exercised
    said = [a.rsplit("####", 1)[0] + f"So the answer is {f}." for a, f in zip(answers, finals)]
    boxed = [f"... so \\boxed{{{f.replace(',', '')}}} is it, not 3." for f in finals]
    off = [f"The answer is {float(f.replace(',', '')) + 1}" for f in finals]
    assert accuracy(said, answer=answers) == [1.0] * len(gsm8k)
    assert accuracy(boxed, answer=answers) == [1.0] * len(gsm8k)
    assert accuracy(off, answer=answers) == [0.0] * len(gsm8k)
    chat = [[{"role": "assistant", "content": c}] for c in boxed]
    assert accuracy(chat, answer=answers) == [1.0] * len(gsm8k)


def test_accuracy_edge_cases():
    assert reference_answer("\\boxed{\\frac{1}{3}}") == "\\frac{1}{3}"
    assert accuracy(
        ["so \\boxed{\\frac{1}{3}}", "\\boxed{\\frac{1}{2}}"], answer=["\\frac{1}{3}"] * 2
    ) == [1.0, 0.0]
    assert accuracy(["no number here", "it is 7"], answer=[None, "7.0"]) == [None, 1.0]
    assert accuracy(["no number here"], answer=["7"]) == [0.0]
    with pytest.raises(UserError, match="needs an 'answer' field"):
        accuracy(["7"])


def test_format_equals_trls_think_format_reward():
    trl_format = pytest.importorskip(
        "trl.rewards.format_rewards", reason="TRL (a test extra) is the reference"
    )
    completions = [
        "<think>a</think>b",
        "<think>a</think>",
        "a<think>b</think>",
        "<think>a<think>b</think>c",
        "<think>\nmulti\nline\n</think>\nanswer",
        "<think>unclosed",
        "plain",
    ]
    mine = format_reward(r"<think>(?!.*<think>)(.*?)</think>.*")
    assert mine(completions) == trl_format.think_format_reward(
        [[{"content": c}] for c in completions]
    )
    r1 = format_reward()
    assert r1(["<think>x</think> <answer>4</answer>\n", "<answer>4</answer>"]) == [1.0, 0.0]
    with pytest.raises(UserError, match="grpo.format_pattern is not a valid regular expression"):
        format_reward("(")


def test_reward_specs_load_a_module_from_the_working_directory_and_a_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def short(completions, **kw):\n    return [-len(c) for c in completions]\n"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "other.py").write_text(
        "def one(completions, **kw):\n    return [1] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    name, fn = load_reward("my_rewards:short")
    assert name == "short" and fn(["ab", "c"]) == [-2, -1]
    assert load_reward("sub/other.py:one")[1](["x"]) == [1]
    rewards = Rewards(["my_rewards:short", str(tmp_path / "sub" / "other.py") + ":one"], [2.0, 1.0])
    scores = rewards(["p", "p"], ["ab", "c"], [[1], [2]], {})
    assert scores.total.tolist() == [-3.0, -1.0] and scores.names == ["short", "one"]
    for spec, message in (
        ("nonesuch:f", "no module nonesuch"),
        ("my_rewards:missing", "has no function missing"),
        ("sub/none.py:f", "file sub/none.py not found"),
        ("accuracy_", "is not a reward function"),
    ):
        with pytest.raises(UserError, match=message):
            load_reward(spec)


def _bad_count(completions, **kwargs):
    return [1.0]


def _bad_value(completions, **kwargs):
    return ["yes"] * len(completions)


@pytest.mark.parametrize(
    "fn, message",
    [
        ("_bad_count", "returned 1 rewards for 2 completions"),
        ("_bad_value", "returned 'yes': return numbers"),
    ],
)
def test_a_reward_function_returning_the_wrong_thing_is_one_line(fn, message):
    rewards = Rewards([f"{__name__}:{fn}"])
    with pytest.raises(UserError, match=message):
        rewards(["p", "p"], ["a", "b"], [[1], [2]], {})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rewards": []}, "grpo.rewards is empty"),
        ({"reward_weights": [1.0, 2.0]}, "2 weights for 1 reward functions"),
        ({"num_generations": 1}, "num_generations must be >= 2"),
        ({"max_completion_length": 0}, "max_completion_length must be >= 1"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"beta": -0.1}, "beta must be >= 0"),
        ({"epsilon": 1.0}, "epsilon must be in [0, 1)"),
        ({"epsilon_high": -0.1}, "epsilon_high must be >= 0"),
        ({"loss_type": "dapp"}, "grpo.loss_type='dapp' is not valid (did you mean 'dapo'?)"),
        ({"scale_rewards": "groups"}, "grpo.scale_rewards='groups' is not valid"),
        ({"num_iterations": 0}, "num_iterations must be >= 1"),
    ],
)
def test_config_errors_are_one_line(change, message):
    with pytest.raises(UserError) as e:
        GRPOConfig(**change).check()
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_defaults_are_trls():
    trl_config = pytest.importorskip(
        "trl.trainer.grpo_config", reason="TRL (a test extra) is the reference"
    )
    import dataclasses

    theirs = {f.name: f.default for f in dataclasses.fields(trl_config.GRPOConfig)}
    ours = GRPOConfig()
    ours.check()
    for name in (
        "num_generations",
        "max_completion_length",
        "temperature",
        "top_p",
        "top_k",
        "beta",
        "epsilon",
        "epsilon_high",
        "loss_type",
        "scale_rewards",
        "num_iterations",
        "mask_truncated_completions",
        "reward_weights",
    ):
        assert getattr(ours, name) == theirs[name], name
    assert GRPOConfig(scale_rewards="false").reward_scaling == "none"
    assert GRPOConfig(scale_rewards="True").reward_scaling == "group"
