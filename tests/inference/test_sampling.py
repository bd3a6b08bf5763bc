"""Logit processing against transformers' processors on random logits, and sampling properties."""

from __future__ import annotations

import pytest
import torch

from lmforge.errors import UserError
from lmforge.inference.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    choose_next,
    process_logits,
    top_k_filter,
    top_p_filter,
)

lp = pytest.importorskip("transformers.generation.logits_process")

VOCAB = 257


def _logits(seed: int, batch: int = 6, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def _seen(ids: torch.Tensor) -> torch.Tensor:
    return torch.zeros(ids.shape[0], VOCAB, dtype=torch.bool).scatter_(1, ids, True)


@pytest.mark.parametrize("k", [1, 2, 10, 50, VOCAB, VOCAB + 5])
def test_top_k_matches_transformers(k):
    for seed in range(5):
        logits = _logits(seed)
        logits[0, :20] = logits[0, 0]  # ties at the boundary are kept, as in transformers
        expected = lp.TopKLogitsWarper(k)(None, logits.clone())
        got = top_k_filter(logits, k)
        assert torch.equal(got, expected)
        assert (torch.isfinite(got).sum(-1) >= min(k, VOCAB)).all()


@pytest.mark.parametrize("p", [1e-9, 0.05, 0.3, 0.5, 0.9, 0.99])
def test_top_p_matches_transformers_and_keeps_at_least_one(p):
    for seed in range(5):
        for scale in (0.1, 3.0, 30.0):  # flat to peaked distributions
            logits = _logits(seed, scale=scale)
            expected = lp.TopPLogitsWarper(p)(None, logits.clone())
            got = top_p_filter(logits, p)
            assert torch.equal(got, expected)
            kept = torch.isfinite(got)
            assert (kept.sum(-1) >= 1).all()
            assert kept.gather(1, logits.argmax(-1, keepdim=True)).all()  # the most likely token survives
            if p < 1.0:  # the kept mass reaches p (the smallest such set, up to ties in rounding)
                mass = torch.where(kept, logits.softmax(-1), 0.0).sum(-1)
                assert (mass >= p - 1e-5).all()


def test_top_p_one_is_off():
    """As in transformers' generate, which adds no TopPLogitsWarper for top_p = 1 (the warper itself
    would still drop tokens whose probability underflows to 0)."""
    logits = _logits(5, scale=30.0)
    assert top_p_filter(logits, 1.0) is logits and top_p_filter(logits, None) is logits


def test_tiny_top_p_keeps_exactly_the_argmax():
    logits = _logits(7)
    got = top_p_filter(logits, 1e-12)
    assert torch.equal(torch.isfinite(got).sum(-1), torch.ones(logits.shape[0], dtype=torch.long))
    assert torch.equal(got.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("penalty", [0.5, 1.0, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty):
    for seed in range(5):
        logits = _logits(seed)
        ids = torch.randint(0, VOCAB, (logits.shape[0], 40), generator=torch.Generator().manual_seed(100 + seed))
        expected = lp.RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
        got = apply_repetition_penalty(logits, _seen(ids), penalty)
        assert torch.equal(got, expected)
        if penalty > 1:  # seen tokens never get more likely, unseen ones are untouched
            seen = _seen(ids)
            assert (got[seen] <= logits[seen]).all() and torch.equal(got[~seen], logits[~seen])


def test_processing_chain_matches_transformers_order():
    """Penalty, temperature, top-k, top-p: the order transformers' generate applies them in."""
    for seed in range(5):
        logits = _logits(seed)
        ids = torch.randint(0, VOCAB, (logits.shape[0], 30), generator=torch.Generator().manual_seed(seed))
        chain = lp.LogitsProcessorList([
            lp.RepetitionPenaltyLogitsProcessor(1.2), lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(40),
            lp.TopPLogitsWarper(0.8),
        ])
        params = SamplingParams(temperature=0.7, top_k=40, top_p=0.8, repetition_penalty=1.2)
        assert torch.equal(process_logits(logits, params, _seen(ids)), chain(ids, logits.clone()))


def test_temperature_zero_and_no_sampling_are_greedy():
    logits = _logits(3)
    for params in (SamplingParams(temperature=0.0), SamplingParams(do_sample=False, temperature=1.5),
                   SamplingParams(top_k=1)):
        got = choose_next(logits, params, generator=torch.Generator().manual_seed(0))
        assert torch.equal(got, logits.argmax(-1))


def test_seeded_sampling_is_reproducible_and_respects_filters():
    logits = _logits(4, batch=64, scale=1.0)
    params = SamplingParams(temperature=1.0, top_k=5)
    draw = [choose_next(logits, params, generator=torch.Generator().manual_seed(s)) for s in (0, 0, 1)]
    assert torch.equal(draw[0], draw[1])
    assert not torch.equal(draw[0], draw[2])
    top5 = logits.topk(5, -1).indices
    for d in draw:
        assert (top5 == d[:, None]).any(-1).all()  # only the 5 most likely tokens are ever drawn


def test_sampling_follows_the_distribution():
    """At temperature 2 the log-frequencies of a 3-token distribution are half the logits (up to noise)."""
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(20000, 3)
    draw = choose_next(logits, SamplingParams(temperature=2.0), generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(draw, minlength=3).float() / draw.numel()
    torch.testing.assert_close(freq, torch.softmax(torch.tensor([1.0, 0.5, 0.0]), 0), atol=0.015, rtol=0)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(repetition_penalty=0.0),
    dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=float("nan")),
    dict(repetition_penalty=float("inf")), dict(repetition_penalty=float("nan")),
])
def test_invalid_parameters_are_user_errors(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)
