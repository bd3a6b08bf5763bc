"""score_requests against the plain definition: one full forward per request, log-softmax over
every position."""

from __future__ import annotations

import pytest
import torch

from lmforge.errors import UserError
from lmforge.eval.scoring import score_requests
from lmforge.models import load_pretrained


@pytest.fixture(scope="module")
def model(hf_dirs):
    return load_pretrained(hf_dirs["gpt_neox"])


def reference(model, context, continuation, max_length):
    tokens = [*context, *continuation][-(max_length + 1) :]
    with torch.no_grad():
        logprobs = model(torch.tensor([tokens[:-1]])).log_softmax(-1)[0, -len(continuation) :]
    target = torch.tensor(continuation)
    return logprobs.gather(-1, target[:, None]).sum().item(), bool(
        (logprobs.argmax(-1) == target).all()
    )


def test_every_request_matches_its_own_forward(model):
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 300, (40,), generator=g).tolist()
    requests = [
        (ctx, [5]),
        (ctx, [7]),
        (ctx, [5]),  # one-token choices: one row serves all three
        (ctx[:10], [1, 2, 3]),
        (ctx[:10], [1, 2]),  # the second's input is a prefix of the first's
        ([3], torch.randint(0, 300, (20,), generator=g).tolist()),
        # longer than the context: cut left
        (torch.randint(0, 300, (200,), generator=g).tolist(), [9, 8]),
    ]
    expected = [reference(model, c, d, 128) for c, d in requests]
    for batch_size in (1, 3, 16):
        got = score_requests(model, requests, batch_size=batch_size)
        assert [g[1] for g in got] == [e[1] for e in expected]
        assert max(abs(g[0] - e[0]) for g, e in zip(got, expected)) <= 1e-4


def test_greedy_flag_is_true_for_the_models_own_argmax(model):
    ctx = [11, 12, 13]
    with torch.no_grad():
        best = model(torch.tensor([ctx])).argmax(-1)[0, -1].item()
    assert score_requests(model, [(ctx, [best]), (ctx, [(best + 1) % 300])]) == [
        (pytest.approx(reference(model, ctx, [best], 128)[0], abs=1e-4), True),
        (pytest.approx(reference(model, ctx, [(best + 1) % 300], 128)[0], abs=1e-4), False),
    ]


def test_a_shared_context_is_computed_once(model):
    calls = []
    handle = model.layers[0].register_forward_hook(
        lambda m, args, out: calls.append(tuple(args[0].shape))
    )
    try:
        score_requests(model, [([1, 2, 3, 4], [c]) for c in range(10)], batch_size=4)
    finally:
        handle.remove()
    assert calls == [(1, 4, 64)]  # ten one-token choices: one row of the context


def test_bad_requests_are_one_line_errors(model):
    with pytest.raises(UserError, match="empty continuation"):
        score_requests(model, [([1, 2], [])])
    with pytest.raises(UserError, match="longer than the model's context"):
        score_requests(model, [([1], list(range(200)))])
    with pytest.raises(UserError, match="batch size"):
        score_requests(model, [([1], [2])], batch_size=0)


def test_rows_of_very_different_lengths_are_not_padded_into_one_batch(model):
    from lmforge.eval.scoring import batches

    # the article alone, not padded to 2048
    assert batches([2048, 1356, 2048, 2048], 2) == [[0, 2], [3], [1]]
    # at most 3, none under 3/4 the first
    assert batches([10, 40, 31, 29, 30, 8], 3) == [[1, 2, 4], [3], [0, 5]]
    assert batches([], 4) == []
    g = torch.Generator().manual_seed(1)
    requests = [([1], torch.randint(0, 300, (n,), generator=g).tolist()) for n in (100, 40, 96)]
    calls = []
    handle = model.layers[0].register_forward_hook(
        lambda m, args, out: calls.append(tuple(args[0].shape[:2]))
    )
    try:
        got = score_requests(model, requests, batch_size=4, greedy=False)
    finally:
        handle.remove()
    assert calls == [(2, 100), (1, 40)]
    expected = [reference(model, c, d, 128)[0] for c, d in requests]
    assert max(abs(g[0] - e) for g, e in zip(got, expected)) <= 1e-4


@pytest.mark.parametrize("head", ["plain", "bias", "softcap"])
def test_logits_buffer_reused_across_chunks_and_batches(model, monkeypatch, head):
    """Scored positions over several head chunks and batches (the logits buffer reused, a partial
    last chunk, logsumexp a few rows at a time) give the plain log-softmax's numbers, with a
    biased head and with a soft-capped one (which makes its own logits)."""
    import copy

    from lmforge.eval import scoring
    from lmforge.models.layers import SoftCappedVocabProjection

    monkeypatch.setattr(scoring, "HEAD_CHUNK", 7)
    monkeypatch.setattr(scoring, "LSE_ROWS", 3)
    m = copy.deepcopy(model)
    if head == "bias":
        m.lm_head.bias = torch.nn.Parameter(torch.randn(m.lm_head.weight.shape[0]))
    if head == "softcap":
        m.vocab_projection = SoftCappedVocabProjection(m.vocab_projection.vocab_size, 5.0)
    g = torch.Generator().manual_seed(1)
    requests = [([2], torch.randint(0, 300, (n,), generator=g).tolist()) for n in (30, 19, 8, 1)]
    expected = [reference(m, c, d, 128) for c, d in requests]
    got = score_requests(m, requests, batch_size=2)
    assert [g[1] for g in got] == [e[1] for e in expected]
    assert max(abs(g[0] - e[0]) for g, e in zip(got, expected)) <= 1e-4
