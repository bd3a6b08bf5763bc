"""Per-row sampling settings and the engine's per-row penalties against transformers' logits
processors (and, where transformers has none, OpenAI's formula computed here): a batch whose rows
each have their own settings filters each row exactly as the reference does with that row's
settings alone."""

from __future__ import annotations

import math

import pytest
import torch

from lmforge.inference.penalties import RowPenalties, RowSettings
from lmforge.inference.sampling import RowSampling, SamplingParams, choose_rows, filter_rows

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

VOCAB = 64


def _logits(seed: int, batch: int) -> torch.Tensor:
    return torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _reference(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers, in generate's order, for one row's settings."""
    warpers = LogitsProcessorList()
    if p.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p is not None and p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p:
        warpers.append(MinPLogitsWarper(p.min_p))
    return warpers(None, row[None].clone())[0]


ROWS = [
    SamplingParams(0.7, 10, None),
    SamplingParams(1.0, None, 0.8),
    SamplingParams(1.3, None, None, min_p=0.1),
    SamplingParams(0.9, 20, 0.9, min_p=0.05),
    SamplingParams(1.0),
    SamplingParams(0.5, None, 0.5, min_p=0.3),
]


def test_each_rows_filters_equal_transformers_warpers_for_its_own_settings():
    for seed in range(5):
        logits = _logits(seed, len(ROWS))
        got = filter_rows(logits, RowSampling.of(ROWS))
        for k, p in enumerate(ROWS):
            want = _reference(logits[k], p)
            assert torch.equal(got[k].isinf(), want.isinf()), (seed, k)
            kept = ~want.isinf()
            assert torch.allclose(got[k][kept], want[kept], rtol=0, atol=1e-6), (seed, k)


def test_min_p_alone_equals_min_p_logits_warper():
    logits = _logits(11, 4)
    for min_p in (0.01, 0.1, 0.5, 1.0):
        got = filter_rows(logits, RowSampling.of([SamplingParams(1.0, min_p=min_p)] * 4))
        want = MinPLogitsWarper(min_p)(None, logits.clone())
        assert torch.equal(got.isinf(), want.isinf()), min_p


def test_a_seeded_row_draws_the_same_tokens_in_any_batch():
    """A row with a generator of its own draws what it draws alone, whatever rows (greedy,
    sampled, seeded) share its call."""
    params = [
        SamplingParams(0.0),
        SamplingParams(0.8, 10),
        SamplingParams(1.2, None, 0.9),
        SamplingParams(1.0),
    ]
    for step in range(5):
        logits = _logits(100 + step, 4)
        alone = [
            choose_rows(
                logits[k : k + 1], RowSampling.of([params[k]]), [torch.Generator().manual_seed(k)]
            )
            for k in (1, 2)
        ]
        gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2), None]
        together = choose_rows(logits, RowSampling.of(params), gens)
        assert together[1] == alone[0][0] and together[2] == alone[1][0]
        assert together[0] == logits[0].argmax()


def _penalties(settings: list[RowSettings], prompts: list[list[int]]) -> RowPenalties:
    rows = RowPenalties(len(settings), VOCAB, torch.device("cpu"))
    for slot, (s, prompt) in enumerate(zip(settings, prompts)):
        rows.admit(slot, prompt, s)
    return rows


def test_repetition_penalty_per_row_equals_repetition_penalty_logits_processor():
    """CTRL's penalty over prompt and output tokens, a different one per row, as transformers'
    processor applies it to input_ids = prompt + output."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (7,), generator=g).tolist() for _ in range(3)]
    outputs = [torch.randint(0, VOCAB, (5,), generator=g).tolist() for _ in range(3)]
    penalties = [1.3, 1.0, 0.7]
    settings = [RowSettings(repetition_penalty=p) for p in penalties]
    rows = _penalties(settings, prompts)
    slots = torch.arange(3)
    for step in range(5):
        rows.record(slots, torch.tensor([o[step] for o in outputs]))
    logits = _logits(4, 3)
    got = rows.apply(logits, slots, settings, [5] * 3)
    for k, p in enumerate(penalties):
        ids = torch.tensor([prompts[k] + outputs[k]])
        want = (
            RepetitionPenaltyLogitsProcessor(p)(ids, logits[k : k + 1].clone())[0]
            if p != 1.0
            else logits[k]
        )
        assert torch.equal(got[k], want), k


def test_frequency_presence_and_logit_bias_follow_openais_formula():
    """logits[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty + logit_bias[j], c
    over the output tokens only (a prompt token counts for nothing), each row its own values."""
    settings = [
        RowSettings(frequency_penalty=0.5, presence_penalty=0.25),
        RowSettings(frequency_penalty=-1.0),
        RowSettings(presence_penalty=2.0, logit_bias={3: 100.0, 9: -55.5}),
        RowSettings(),
    ]
    prompts = [[1, 2, 3], [4, 4], [5], [6]]
    outputs = [[7, 7, 8], [4, 9, 9], [3, 3, 10], [7, 7, 7]]
    rows = _penalties(settings, prompts)
    slots = torch.arange(4)
    for step in range(3):
        rows.record(slots, torch.tensor([o[step] for o in outputs]))
    logits = _logits(5, 4)
    got = rows.apply(logits, slots, settings, [3] * 4)
    for k, s in enumerate(settings):
        want = logits[k].clone()
        for j in range(VOCAB):
            c = outputs[k].count(j)
            want[j] -= c * s.frequency_penalty + (c > 0) * s.presence_penalty
            want[j] += (s.logit_bias or {}).get(j, 0.0)
        assert torch.allclose(got[k], want, rtol=0, atol=1e-5), k
    assert torch.equal(got[3], logits[3])  # no settings: the scores untouched


def test_min_tokens_masks_the_ending_ids_until_reached_and_a_new_request_starts_clean():
    settings = [RowSettings(min_tokens=3, ending_ids=(0, 5)), RowSettings(ending_ids=(0,))]
    rows = _penalties(settings, [[1], [2]])
    logits = _logits(6, 2)
    early = rows.apply(logits, torch.arange(2), settings, [2, 2])
    assert (
        early[0, 0] == -math.inf
        and early[0, 5] == -math.inf
        and early[0].isfinite().sum() == VOCAB - 2
    )
    assert torch.equal(early[1], logits[1])
    assert torch.equal(rows.apply(logits, torch.arange(2), settings, [3, 3]), logits)
    rows.admit(0, [1], RowSettings())  # the row's next request has none of it
    assert torch.equal(
        rows.apply(logits, torch.arange(2), [RowSettings(), settings[1]], [0, 0]), logits
    )


def test_logit_bias_and_min_tokens_equal_transformers_processors():
    """logit_bias as SequenceBiasLogitsProcessor with one-token sequences; min_tokens as
    MinNewTokensLengthLogitsProcessor over the ending ids, at each count of generated tokens."""
    bias = {3: 100.0, 9: -55.5, 40: 0.25}
    settings = [RowSettings(logit_bias=bias), RowSettings(min_tokens=3, ending_ids=(0, 5))]
    rows = _penalties(settings, [[1], [2]])
    logits = _logits(7, 2)
    for generated in range(5):
        got = rows.apply(logits, torch.arange(2), settings, [generated] * 2)
        prompt = torch.tensor([[1, 2]])
        ids = torch.cat([prompt, torch.ones(1, generated, dtype=torch.long)], dim=1)
        biased = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(
            ids, logits[:1].clone()
        )
        masked = MinNewTokensLengthLogitsProcessor(2, 3, [0, 5])(ids, logits[1:].clone())
        assert torch.equal(got[0], biased[0]) and torch.equal(got[1], masked[0]), generated
