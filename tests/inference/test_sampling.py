"""Logit processing against transformers' processors on random logits, and sampling properties."""

from __future__ import annotations

import pytest
import torch

from lmforge.errors import UserError
from lmforge.inference import generate, generate_text
from lmforge.inference.sampling import (
    NO_TOKEN,
    SAMPLING_EPS,
    SamplingParams,
    apply_repetition_penalty,
    choose_next,
    process_logits,
    top_k_filter,
    top_p_filter,
)
from tests.inference.test_generate import _cli, run, text_model  # noqa: F401 (the fixture, shared)

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


@pytest.mark.parametrize("p", [1e-300, 1e-9, 0.05, 0.3, 0.5, 0.9, 0.99])
def test_top_p_matches_transformers_and_keeps_at_least_one(p):
    for seed in range(5):
        for scale in (0.1, 3.0, 30.0):  # flat to peaked distributions
            logits = _logits(seed, scale=scale)
            expected = lp.TopPLogitsWarper(p)(None, logits.clone())
            got = top_p_filter(logits, p)
            assert torch.equal(got, expected)
            kept = torch.isfinite(got)
            assert (kept.sum(-1) >= 1).all()
            # the most likely token survives
            assert kept.gather(1, logits.argmax(-1, keepdim=True)).all()
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
        ids = torch.randint(
            0, VOCAB, (logits.shape[0], 40), generator=torch.Generator().manual_seed(100 + seed)
        )
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
        ids = torch.randint(
            0, VOCAB, (logits.shape[0], 30), generator=torch.Generator().manual_seed(seed)
        )
        chain = lp.LogitsProcessorList(
            [
                lp.RepetitionPenaltyLogitsProcessor(1.2),
                lp.TemperatureLogitsWarper(0.7),
                lp.TopKLogitsWarper(40),
                lp.TopPLogitsWarper(0.8),
            ]
        )
        params = SamplingParams(temperature=0.7, top_k=40, top_p=0.8, repetition_penalty=1.2)
        assert torch.equal(process_logits(logits, params, _seen(ids)), chain(ids, logits.clone()))


def test_temperature_zero_and_no_sampling_are_greedy():
    logits = _logits(3)
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(do_sample=False, temperature=1.5),
        SamplingParams(top_k=1),
    ):
        got = choose_next(logits, params, generator=torch.Generator().manual_seed(0))
        assert torch.equal(got, logits.argmax(-1))


def test_seeded_sampling_is_reproducible_and_respects_filters():
    logits = _logits(4, batch=64, scale=1.0)
    params = SamplingParams(temperature=1.0, top_k=5)
    draw = [
        choose_next(logits, params, generator=torch.Generator().manual_seed(s)) for s in (0, 0, 1)
    ]
    assert torch.equal(draw[0], draw[1])
    assert not torch.equal(draw[0], draw[2])
    top5 = logits.topk(5, -1).indices
    for d in draw:
        assert (top5 == d[:, None]).any(-1).all()  # only the 5 most likely tokens are ever drawn


def test_sampling_follows_the_distribution():
    """At temperature 2 the log-frequencies of a 3-token distribution are half the logits (up to
    noise)."""
    logits = torch.tensor([[2.0, 1.0, 0.0]]).expand(20000, 3)
    draw = choose_next(
        logits, SamplingParams(temperature=2.0), generator=torch.Generator().manual_seed(0)
    )
    freq = torch.bincount(draw, minlength=3).float() / draw.numel()
    torch.testing.assert_close(
        freq, torch.softmax(torch.tensor([1.0, 0.5, 0.0]), 0), atol=0.015, rtol=0
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(top_k=-1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(repetition_penalty=0.0),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_p=float("nan")),
        dict(repetition_penalty=float("inf")),
        dict(repetition_penalty=float("nan")),
    ],
)
def test_invalid_parameters_are_user_errors(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature", [1e-300, 1e-38, SAMPLING_EPS / 2])
def test_a_temperature_below_the_floor_is_greedy(temperature):
    """Dividing by such a temperature overflows fp32 (1e-300 is 0 there): below SAMPLING_EPS a
    row decodes greedily, as vLLM's temperature < 1e-5 did, instead of NaN probabilities that
    made torch.multinomial raise."""
    logits = _logits(8, scale=30.0)
    params = SamplingParams(temperature=temperature, top_k=50, top_p=0.9)
    assert params.greedy
    assert torch.equal(
        choose_next(logits, params, generator=torch.Generator().manual_seed(0)), logits.argmax(-1)
    )
    # Just above the floor it still samples, and a draw that peaked is the argmax.
    above = SamplingParams(temperature=2 * SAMPLING_EPS)
    assert not above.greedy
    assert torch.equal(
        choose_next(logits, above, generator=torch.Generator().manual_seed(0)), logits.argmax(-1)
    )


def test_rows_without_a_distribution_do_not_fail_the_batch():
    """One row's scores overflow to +inf, one holds NaN, one is NaN everywhere, one has every
    score -inf after its repetition penalty: none raises inside torch.multinomial, and the
    healthy rows draw what they draw alone."""
    inf, nan = float("inf"), float("nan")
    logits = _logits(9, batch=6, scale=1.0)
    healthy = [0, 5]
    bad = logits.clone()
    bad[1, [7, 3]] = inf  # overflowed: decided greedily among them (the first)
    bad[2, [4, 9]] = nan  # NaN counts as -inf: never chosen
    bad[3] = nan  # nothing to choose from
    # every score negative and seen: repetition_penalty 1e40 takes them all to -inf
    bad[4] = -bad[4].abs() - 1
    seen = torch.zeros_like(bad, dtype=torch.bool)
    seen[4] = True
    for params in (
        SamplingParams(temperature=0.7, repetition_penalty=1e40),
        SamplingParams(temperature=0.0, repetition_penalty=1e40),
    ):
        got = choose_next(bad, params, seen, generator=torch.Generator().manual_seed(3))
        alone = choose_next(
            logits[healthy], params, seen[healthy], generator=torch.Generator().manual_seed(3)
        )
        assert got[1] == 3 and got[3] == NO_TOKEN and got[4] == NO_TOKEN
        assert got[2] not in (4, 9) and 0 <= got[2] < VOCAB
        if params.greedy:
            assert got[2] == bad[2].nan_to_num(-inf).argmax()
            assert torch.equal(got[healthy], alone)
        # one generator over the batch: the healthy rows' draws are those of the same rows
        # without the others
        else:
            rows = choose_next(logits, params, seen, generator=torch.Generator().manual_seed(3))
            assert torch.equal(got[healthy], rows[healthy])
    # The processed scores themselves hold no NaN, and a penalty as small as 1e-40 leaves no NaN
    # either.
    assert not process_logits(bad, SamplingParams(temperature=0.5), seen).isnan().any()
    tiny = SamplingParams(temperature=1.0, repetition_penalty=1e-40)
    # every positive score over 0.035: divided by 1e-40 it overflows
    apart = logits + logits.sign() * 0.1
    got = choose_next(
        apart, tiny, torch.ones_like(seen), generator=torch.Generator().manual_seed(0)
    )
    # the first positive (now +inf) score wins every row
    assert torch.equal(got, (apart > 0).int().argmax(-1))


def test_generate_and_its_cli_take_the_floor_and_name_a_broken_model(
    text_model,  # noqa: F811
    capsys,
    monkeypatch,
):
    """`lmforge generate --temperature 1e-300` printed a traceback from torch.multinomial: it
    prints the greedy text. A model whose scores are NaN is one line naming the problem, not a
    traceback (sampled) or made-up tokens (greedy: argmax picks a NaN)."""
    folder, model, tok = text_model
    prompts = ["t5 t17 t33 t2 t99", "t8 t9 t10"]
    greedy = generate_text(model, tok, prompts, 8, temperature=0)
    assert generate_text(model, tok, prompts, 8, temperature=1e-300, top_k=20, seed=3) == greedy
    run(
        _cli(
            [
                str(folder),
                "--prompt",
                prompts[0],
                "--max-new-tokens",
                "8",
                "--temperature",
                "1e-300",
            ]
        )
    )
    assert capsys.readouterr().out == greedy[0] + "\n"
    head = model.logits

    def one_row_nan(h):
        out = head(h)
        out[-1] = float("nan")
        return out

    monkeypatch.setattr(model, "logits", one_row_nan)
    for kw in (dict(temperature=0.7, seed=1), dict(temperature=0)):
        with pytest.raises(
            UserError,
            match=r"^generation of prompt 1 stopped: the model's scores for the next token "
            r"are NaN or -inf for every token: its weights are broken",
        ):
            generate_text(model, tok, prompts, 8, **kw)
        with pytest.raises(UserError, match="prompt 1 stopped"):
            # no eos watched: to the end
            generate(model, tok.encode_batch(prompts), 8, stop_token_ids=[], **kw)
