"""Rollouts on a tiny model: the tokens lmforge.inference.generate samples for the same rows and
seed, log-probabilities against the trainer's recomputation, the recomputation the same bit for
bit however the batch is split."""

from __future__ import annotations

import pytest
import torch

from lmforge.inference import generate
from lmforge.models import build
from lmforge.rl.rollout import completion_logps, logprob_diff, rollout

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [1, 2, 3, 4, 5, 6, 7]]
G, LENGTH, STOP = 4, 12, 17


@pytest.fixture(scope="module")
def model():
    return build("tiny-llama", seed=1).eval()


@pytest.fixture(scope="module")
def rolled(model):
    # Stopping at a frequent token of this random model: some rows stop early, some run to the
    # limit.
    return rollout(model, PROMPTS, G, LENGTH, temperature=0.9, stop_token_ids=[STOP, 3], seed=7)


@pytest.mark.parametrize("top_k, top_p", [(40, 0.9), (0, 0.5)])
def test_filtered_sampling_draws_what_generate_draws(model, top_k, top_p):
    rows = [p for p in PROMPTS for _ in range(G)]
    want = generate(
        model, rows, 6, temperature=1.3, top_k=top_k, top_p=top_p, stop_token_ids=[], seed=3
    )
    got = rollout(
        model, PROMPTS, G, 6, temperature=1.3, top_k=top_k, top_p=top_p, stop_token_ids=[], seed=3
    )
    assert got.completions() == want and got.truncated.all()


def test_samples_what_generate_samples_with_the_same_seed(model, rolled):
    rows = [p for p in PROMPTS for _ in range(G)]
    want = generate(model, rows, LENGTH, temperature=0.9, stop_token_ids=[STOP, 3], seed=7)
    assert rolled.completions() == want
    lengths = rolled.completion_mask.sum(-1).tolist()
    assert lengths == [len(w) for w in want]
    truncated = [len(w) == LENGTH and w[-1] not in (STOP, 3) for w in want]
    assert rolled.truncated.tolist() == truncated
    assert any(truncated) and not all(truncated)
    assert (rolled.sampling_logps[rolled.completion_mask == 0] == 0).all()


def test_sampling_logprobs_match_the_trainers_recomputation_in_fp32(model, rolled):
    """Decode (KV cache, a row at a time) and the training forward (the whole sequence) sum in
    other orders: equal to a few units in the last place (measured: max 4.8e-7 on this model),
    not bit for bit."""
    with torch.no_grad():
        logps, _ = completion_logps(
            model,
            rolled.prompt_ids,
            rolled.prompt_mask,
            rolled.completion_ids,
            rolled.completion_mask,
            temperature=0.9,
        )
    diff = logprob_diff(rolled.sampling_logps, logps, rolled.completion_mask)
    assert diff["logprob_diff/max"] < 5e-6
    # The reference: log_softmax(logits / T) of the sampled token straight from the model's full
    # logits.
    ids = torch.cat([rolled.prompt_ids, rolled.completion_ids], 1)
    mask = torch.cat([rolled.prompt_mask, rolled.completion_mask], 1)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    s = rolled.prompt_ids.shape[1]
    direct = (logits[:, s - 1 : -1].float() / 0.9).log_softmax(-1)
    direct = (
        direct.gather(-1, rolled.completion_ids[..., None]).squeeze(-1) * rolled.completion_mask
    )
    assert torch.equal(logps, direct)


def test_recomputation_is_bit_exact_across_micro_batches_and_grad(model, rolled):
    """The old policy's log-probabilities computed once under no_grad over the whole rollout
    equal the training step's, micro-batch by micro-batch with gradients: with num_iterations=1
    the ratio is exactly 1."""
    args = (rolled.prompt_ids, rolled.prompt_mask, rolled.completion_ids, rolled.completion_mask)
    with torch.no_grad():
        whole, _ = completion_logps(model, *args, temperature=0.9)
    for rows in (slice(0, 4), slice(4, 8), slice(8, 12)):
        part, _ = completion_logps(model, *(a[rows] for a in args), temperature=0.9)
        assert part.requires_grad
        assert torch.equal(part.detach(), whole[rows])


def test_entropy_of_the_recomputation(model, rolled):
    args = (
        rolled.prompt_ids[:2],
        rolled.prompt_mask[:2],
        rolled.completion_ids[:2],
        rolled.completion_mask[:2],
    )
    with torch.no_grad():
        _, entropy = completion_logps(model, *args, with_entropy=True)
        ids = torch.cat(args[:1] + args[2:3], 1)
        mask = torch.cat([args[1], args[3]], 1)
        logits = model(
            ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).float()
    s = args[0].shape[1]
    want = torch.distributions.Categorical(logits=logits[:, s - 1 : -1]).entropy() * args[3]
    torch.testing.assert_close(entropy, want)
