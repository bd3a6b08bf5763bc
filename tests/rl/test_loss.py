"""GRPO's loss, its gradient and its clip and KL statistics against TRL's
GRPOTrainer._compute_loss itself, run on the same batch through a stand-in trainer that holds the
attributes the method reads."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from lmforge.rl.loss import policy_loss

trl_grpo = pytest.importorskip(
    "trl.trainer.grpo_trainer", reason="TRL (a test extra) is the loss's reference"
)

ROWS, LENGTH, MAX_LENGTH = 6, 7, 9


def _batch(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(ROWS, LENGTH, generator=g, dtype=dtype) * 3).requires_grad_()
    # The sampling policy a little off (num_iterations > 1): ratios on both sides of the clip range.
    old = logps.detach() + torch.randn(ROWS, LENGTH, generator=g, dtype=dtype) * 0.3
    ref = logps.detach() + torch.randn(ROWS, LENGTH, generator=g, dtype=dtype) * 0.5
    advantages = torch.randn(ROWS, generator=g, dtype=dtype)
    lengths = torch.tensor([7, 3, 5, 1, 7, 4])
    mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
    mask[4] = 0  # a truncated completion left out
    return logps, old, ref, advantages, mask


class _Accelerator:
    num_processes = 1

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def gather(x):
        return x


def _trl_loss(
    logps,
    advantages,
    mask,
    *,
    loss_type,
    epsilon,
    epsilon_high,
    beta,
    old,
    ref,
    accumulation=1,
    generation_tokens=None,
):
    """TRL's loss of one micro-batch and what it logs: `logps` stands for its model's per-token
    log-probabilities."""
    trainer = types.SimpleNamespace(
        top_entropy_quantile=1.0,
        aux_loss_enabled=False,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation,
        max_completion_length=MAX_LENGTH,
        accelerator=_Accelerator(),
        _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=types.SimpleNamespace(
            use_bias_correction_kl=False, delta=None, steps_per_generation=accumulation
        ),
    )
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (
        logps,
        torch.zeros_like(logps),
        None,
    )
    rows, length = mask.shape
    inputs = {
        "prompt_ids": torch.zeros(rows, 2, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 2),
        "completion_ids": torch.zeros(rows, length, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": mask.sum() if generation_tokens is None else generation_tokens,
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    if beta:
        inputs["ref_per_token_logps"] = ref
    loss = trl_grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, trainer._metrics["train"]


CASES = [
    (loss_type, beta, eps, high, iterations)
    for loss_type in ("grpo", "dr_grpo", "dapo", "bnpo")
    for beta in (0.0, 0.04)
    for eps, high in ((0.2, 0.2), (0.2, 0.28))
    for iterations in (1, 2)
]


@pytest.mark.parametrize("loss_type, beta, epsilon, epsilon_high, iterations", CASES)
def test_loss_gradient_and_statistics_equal_trls(
    loss_type, beta, epsilon, epsilon_high, iterations
):
    logps, old, ref, advantages, mask = _batch()
    # one step per rollout batch: TRL too takes logps detached
    old = None if iterations == 1 else old
    want, logged = _trl_loss(
        logps,
        advantages,
        mask,
        loss_type=loss_type,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        beta=beta,
        old=old,
        ref=ref,
    )
    (want_grad,) = torch.autograd.grad(want, logps)
    loss, count, stats = policy_loss(
        logps,
        advantages,
        mask,
        loss_type=loss_type,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        old_logps=old,
        beta=beta,
        ref_logps=ref,
        max_completion_length=MAX_LENGTH,
    )
    got = loss / count
    (got_grad,) = torch.autograd.grad(got, logps)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-14)
    assert got_grad.abs().sum() > 0
    assert (got_grad[mask == 0] == 0).all()  # padding and the masked completion get no gradient
    tokens = stats.tokens
    assert logged["clip_ratio/low_mean"][0] == pytest.approx(
        float(stats.clipped_low / tokens), abs=1e-7
    )  # TRL counts in fp32
    assert logged["clip_ratio/high_mean"][0] == pytest.approx(
        float(stats.clipped_high / tokens), abs=1e-7
    )  # TRL counts in fp32
    assert logged["clip_ratio/region_mean"][0] == pytest.approx(
        float(stats.clipped / tokens), abs=1e-7
    )  # TRL counts in fp32
    if beta:
        assert logged["kl"][0] == pytest.approx(float(stats.kl / tokens), rel=1e-12)
    if iterations == 2:  # the old policy differs: some tokens are clipped
        assert stats.clipped > 0


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_micro_batches_add_up_to_trls_accumulated_loss(loss_type):
    """Two micro-batches of three completions: TRL's losses (each divided for accumulation, dapo
    by the tokens of the whole generation batch) add up to the step's summed losses over its
    summed counts."""
    logps, old, ref, advantages, mask = _batch(seed=1)
    halves = [slice(0, 3), slice(3, 6)]
    want = sum(
        _trl_loss(
            logps[h],
            advantages[h],
            mask[h],
            loss_type=loss_type,
            epsilon=0.2,
            epsilon_high=0.28,
            beta=0.04,
            old=old[h],
            ref=ref[h],
            accumulation=2,
            generation_tokens=mask.sum(),
        )[0]
        for h in halves
    )
    parts = [
        policy_loss(
            logps[h],
            advantages[h],
            mask[h],
            loss_type=loss_type,
            epsilon=0.2,
            epsilon_high=0.28,
            old_logps=old[h],
            beta=0.04,
            ref_logps=ref[h],
            max_completion_length=MAX_LENGTH,
        )
        for h in halves
    ]
    got = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(
        torch.autograd.grad(got, logps)[0],
        torch.autograd.grad(want, logps)[0],
        rtol=1e-12,
        atol=1e-14,
    )


def test_fp32_batch_equals_trls_within_rounding():
    logps, old, ref, advantages, mask = _batch(seed=2, dtype=torch.float32)
    want, _ = _trl_loss(
        logps,
        advantages,
        mask,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.04,
        old=old,
        ref=ref,
    )
    loss, count, _ = policy_loss(
        logps,
        advantages,
        mask,
        epsilon=0.2,
        epsilon_high=0.28,
        old_logps=old,
        beta=0.04,
        ref_logps=ref,
    )
    torch.testing.assert_close(loss / count, want)
