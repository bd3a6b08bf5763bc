"""Group-relative advantages (Shao et al. 2024, DeepSeekMath): each completion's reward less the mean reward of its
group (the num_generations completions of one prompt, consecutive rows), divided by a standard deviation as
`scale_rewards` says, TRL's options:

    group   the std of its group (GRPO)
    batch   the std of the whole batch (PPO Lite)
    none    no division (Dr. GRPO: dividing by the group's std favours questions that are too easy or too hard)

As TRL: the std is Bessel-corrected, 1e-4 is added to it, a completion without a reward (NaN: no function scored
it) is left out of its group's mean and std and gets advantage 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.errors import UserError

STD_EPS = 1e-4  # TRL's: a group whose rewards are all equal gets advantages 0, not 0 / 0


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The Bessel-corrected standard deviation of the non-NaN values (NaN with fewer than two)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~x.isnan()).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * count / (count - 1)
    std = torch.where(count > 1, var, torch.full_like(var, torch.nan)).sqrt()
    return std if keepdim else (std.squeeze(dim) if dim is not None else std.reshape(()))


@dataclass
class Advantages:
    advantages: torch.Tensor  # (completions,)
    # (completions,) the std each was scaled by (or would be, for scale_rewards=none)
    std: torch.Tensor
    # the share of completions whose group (or batch) rewards are all equal
    zero_std_fraction: float


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> Advantages:
    """Advantages of `rewards` (completions,), groups of `num_generations` consecutive
    completions."""
    n = rewards.numel()
    if num_generations < 1 or n % num_generations:
        raise UserError(
            f"{n} rewards do not make groups of {num_generations}: each prompt needs all its "
            "grpo.num_generations completions in the batch"
        )
    if scale_rewards not in ("group", "batch", "none"):
        raise UserError(
            f"scale_rewards='{scale_rewards}' is not valid: choose one of group, batch, none"
        )
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if n > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    zero = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
    return Advantages(torch.nan_to_num(advantages, nan=0.0), std, zero)
