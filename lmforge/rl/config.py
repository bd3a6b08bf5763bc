"""GRPO's settings (`grpo.*`), named and defaulted as TRL's GRPOConfig names them, so a TRL
recipe carries over."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lmforge.config import closest
from lmforge.errors import UserError

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
# TRL's scale_rewards takes True/False for "group"/"none"; a YAML or key=value override may spell
# them as text.
_SCALE_ALIASES = {"true": "group", "false": "none"}
# DeepSeek-R1's format: reasoning in <think>, then the answer in <answer>.
R1_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"


@dataclass
class GRPOConfig:
    # built-ins (accuracy, format), module:function
    rewards: list[str] = field(default_factory=lambda: ["accuracy"])
    # a weight per reward function, summed with them (None: 1.0 each)
    reward_weights: list[float] | None = None
    # the regex the built-in `format` reward wants a whole completion to match
    format_pattern: str = R1_FORMAT
    # completions sampled per prompt: the group whose mean reward is each one's baseline
    num_generations: int = 8
    # new tokens per completion at most; one that reaches it without eos is truncated
    max_completion_length: int = 512
    # sampling temperature (> 0); log-probabilities are of logits / temperature, as TRL's
    temperature: float = 1.0
    # nucleus sampling: the smallest set of tokens with this much probability (1.0: off)
    top_p: float = 1.0
    top_k: int = 0  # sample among the k most likely tokens (0: off)
    # KL coefficient to the frozen reference (TRL's k3 estimator); 0 holds no reference
    beta: float = 0.0
    # clipping: the probability ratio is kept within [1 - epsilon, 1 + epsilon_high]
    epsilon: float = 0.2
    epsilon_high: float | None = None  # the upper clip (DAPO recommends 0.28); None: epsilon
    loss_type: str = "dapo"  # the normalisation (TRL's names): grpo, dr_grpo, dapo or bnpo
    # advantages divided by the reward std of the group, the batch, or none
    scale_rewards: str = "group"
    # optimizer steps on each batch of rollouts (TRL's mu); > 1 clips against the old policy
    num_iterations: int = 1
    # leave completions cut at max_completion_length out of the loss (DAPO)
    mask_truncated_completions: bool = False

    @property
    def upper_epsilon(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def reward_scaling(self) -> str:
        """scale_rewards as one of SCALE_REWARDS (TRL's True/False spellings mapped)."""
        value = str(self.scale_rewards).lower()
        return _SCALE_ALIASES.get(value, value)

    def check(self) -> None:
        """Raise a one-line UserError for the first setting that cannot run."""
        if not self.rewards:
            raise UserError(
                "grpo.rewards is empty: name at least one reward function (e.g. grpo.rewards=[accuracy])"
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise UserError(
                f"grpo.reward_weights has {len(self.reward_weights)} weights for {len(self.rewards)} "
                "reward functions: give one per function, or none (1.0 each)"
            )
        if self.reward_weights is not None and not all(
            math.isfinite(w) for w in self.reward_weights
        ):
            raise UserError(
                f"grpo.reward_weights must be finite numbers, got {list(self.reward_weights)}"
            )
        if self.num_generations < 2:
            raise UserError(
                f"grpo.num_generations must be >= 2 (a group's advantages compare its completions), "
                f"got {self.num_generations}"
            )
        if self.max_completion_length < 1:
            raise UserError(
                f"grpo.max_completion_length must be >= 1, got {self.max_completion_length}"
            )
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise UserError(
                f"grpo.temperature must be > 0 (the log-probabilities divide by it), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise UserError(f"grpo.top_p must be in (0, 1] (1.0: off), got {self.top_p}")
        if self.top_k < 0:
            raise UserError(f"grpo.top_k must be >= 0 (0: off), got {self.top_k}")
        if not (math.isfinite(self.beta) and self.beta >= 0):
            raise UserError(f"grpo.beta must be >= 0 (0: no reference model), got {self.beta}")
        if not 0.0 <= self.epsilon < 1.0:
            raise UserError(
                f"grpo.epsilon must be in [0, 1) (the ratio's lower clip is 1 - epsilon), got {self.epsilon}"
            )
        if not (math.isfinite(self.upper_epsilon) and self.upper_epsilon >= 0):
            raise UserError(f"grpo.epsilon_high must be >= 0, got {self.epsilon_high}")
        if self.loss_type not in LOSS_TYPES:
            raise UserError(
                f"grpo.loss_type='{self.loss_type}' is not valid{closest(str(self.loss_type), LOSS_TYPES)}"
                f": choose one of {', '.join(LOSS_TYPES)}"
            )
        if self.reward_scaling not in SCALE_REWARDS:
            raise UserError(
                f"grpo.scale_rewards='{self.scale_rewards}' is not valid: choose one of "
                f"{', '.join(SCALE_REWARDS)} (true: group, false: none)"
            )
        if self.num_iterations < 1:
            raise UserError(f"grpo.num_iterations must be >= 1, got {self.num_iterations}")
