"""GRPO's policy loss on per-token log-probabilities, with TRL's clipping, KL and normalisations.

Per completion token t, with r = exp(logp - old_logp) (the ratio to the policy that sampled: exactly 1 in value,
a gradient of r * A, when each batch of rollouts is trained on once and old_logp is logp detached) and A the
completion's advantage:

    loss_t = -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL_t
    KL_t   = exp(ref - logp) - (ref - logp) - 1        (Schulman's k3 estimator: unbiased, >= 0)

summed over the completion tokens of the loss mask and normalised as `loss_type` says (TRL's names):

    grpo     each completion's mean over its tokens, then the mean over completions
    bnpo     the mean over the micro-batch's tokens
    dr_grpo  the sum over tokens / (completions x max_completion_length): no length bias (Dr. GRPO)
    dapo     the sum over tokens / the tokens of the whole step (DAPO; TRL's default)

`policy_loss` returns it in lmforge's Task.loss form, (summed loss, count, statistics): the trainer divides the sum
of the sums of a step's micro-batches (and data-parallel ranks) by the sum of their counts. That is TRL's loss
exactly for every loss_type when each micro-batch holds the same number of completions, as GRPO's batches do:
grpo and bnpo count completions (a micro-batch's mean times its completions), dr_grpo completions x
max_completion_length, dapo tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.errors import UserError
from lmforge.rl.config import LOSS_TYPES


@dataclass
class LossStats:
    """Sums over a micro-batch's loss-mask tokens (the trainer adds them up over a step, then
    divides by tokens)."""

    tokens: torch.Tensor
    kl: torch.Tensor  # KL_t summed (0 with beta = 0)
    # tokens with r < 1 - epsilon and A < 0 (the clip holds the loss at its bound)
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor  # tokens with r > 1 + epsilon_high and A > 0
    clipped: torch.Tensor  # either of the two

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.kl, self.clipped_low, self.clipped_high, self.clipped


def per_token_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of KL(policy || reference) at each sampled token."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def policy_loss(
    logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    old_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    max_completion_length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | int, LossStats]:
    """(summed loss, count, statistics) of one micro-batch.

    logps (rows, completion length): the training model's log-probabilities of the sampled tokens
    (with their gradient); advantages (rows,); mask (rows, completion length), 1 on the tokens the
    loss counts (a truncated completion's are 0 under mask_truncated_completions); old_logps: the
    sampling policy's (None: logps detached, one optimizer step per batch of rollouts); ref_logps:
    the reference's, needed when beta > 0.
    """
    if loss_type not in LOSS_TYPES:
        raise UserError(
            f"loss_type='{loss_type}' is not valid: choose one of {', '.join(LOSS_TYPES)}"
        )
    if beta and ref_logps is None:
        raise UserError("beta > 0 needs the reference model's log-probabilities (ref_logps)")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise UserError("loss_type=dr_grpo divides by max_completion_length: give it")
    high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    adv = advantages.to(logps.dtype)[:, None]
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)
    kl = None
    if beta:
        kl = per_token_kl(logps, ref_logps)
        per_token = per_token + beta * kl
    rows = logps.shape[0]
    masked = per_token * mask
    if loss_type == "grpo":
        loss, count = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum(), rows
    elif loss_type == "bnpo":
        loss, count = masked.sum() / mask.sum().clamp(min=1.0) * rows, rows
    elif loss_type == "dr_grpo":
        loss, count = masked.sum(), rows * max_completion_length
    else:
        loss, count = masked.sum(), mask.sum()
    with torch.no_grad():
        low = ((ratio < 1 - epsilon) & (adv < 0)).to(mask.dtype) * mask
        up = ((ratio > 1 + high) & (adv > 0)).to(mask.dtype) * mask
        stats = LossStats(
            mask.sum(),
            (kl * mask).sum() if kl is not None else mask.new_zeros(()),
            low.sum(),
            up.sum(),
            ((low + up) > 0).to(mask.dtype).sum(),
        )
    return loss, count, stats
