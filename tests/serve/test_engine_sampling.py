"""Per-request sampling settings in one continuously batched decode: a batch mixing requests with
different penalties, biases, filters, stop ids, min_tokens, ignore_eos and seeds gives each
request exactly the tokens it gets alone; the settings do what they say; the logprobs are the
log-softmax of transformers' logits for the same model."""

from __future__ import annotations

import pytest
import torch

from lmforge.inference.engine import Engine, EngineConfig, RequestParams
from lmforge.inference.sampling import SamplingParams
from lmforge.models import load_pretrained
from tests.conftest import make_hf_model
from tests.serve.test_engine import IdTokenizer, _prompts

GREEDY = SamplingParams(temperature=0)
EOS = 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine-sampling") / "llama"
    hf = make_hf_model("llama_gqa")
    hf.config.eos_token_id = EOS
    hf.save_pretrained(folder)
    return hf.eval(), load_pretrained(folder)


# name -> (RequestParams fields, the seed): every kind of setting, greedy and seeded.
MIXED = {
    "penalties": (dict(sampling=GREEDY, frequency_penalty=1.5, presence_penalty=0.5), None),
    "seeded_min_p_bias": (dict(sampling=SamplingParams(0.9, min_p=0.1), logit_bias={5: 5.0}), 7),
    "repetition_bias": (
        dict(sampling=SamplingParams(0, repetition_penalty=1.3), logit_bias={10: -100.0}),
        None,
    ),
    "seeded_filters": (dict(sampling=SamplingParams(1.1, 20, 0.9), presence_penalty=-1.0), 3),
    "min_tokens": (dict(sampling=GREEDY, logit_bias={EOS: 30.0}, min_tokens=6), None),
    "ignore_eos": (dict(sampling=GREEDY, logit_bias={EOS: 30.0}, ignore_eos=True), None),
    "seeded_penalized": (
        dict(sampling=SamplingParams(0.8, repetition_penalty=1.2), frequency_penalty=0.7),
        11,
    ),
    "logprobs": (dict(sampling=GREEDY, logprobs=3), None),
}


def _run(model, jobs: list[tuple[list[int], RequestParams]], max_batch: int = 8):
    engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=max_batch, max_context=64))
    events = [[] for _ in jobs]
    reqs = [
        engine.submit(prompt, params, events[i].append) for i, (prompt, params) in enumerate(jobs)
    ]
    while engine.step():
        pass
    return reqs, events


def _job(prompt, name, max_tokens=12):
    fields, seed = MIXED[name]
    return prompt, RequestParams(max_tokens, seed=seed, **fields)


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(tiny):
    _, model = tiny
    prompts = _prompts(len(MIXED) + 1, seed=21)
    jobs = [_job(p, name) for p, name in zip(prompts, MIXED)]
    # An unseeded sampled request beside them: it draws from torch's generator, which no seeded row
    # uses.
    jobs.append((prompts[-1], RequestParams(12, SamplingParams(1.0, 5))))
    together, _ = _run(model, jobs)
    for (prompt, params), req, name in zip(jobs, together, MIXED):
        (alone,), _ = _run(model, [(prompt, params)], max_batch=1)
        assert req.output_ids == alone.output_ids and req.finish_reason == alone.finish_reason, name
    out = dict(zip(MIXED, together))
    # eos at the 7th
    assert len(out["min_tokens"].output_ids) == 7 and out["min_tokens"].output_ids[-1] == EOS
    assert EOS not in out["min_tokens"].output_ids[:6] and out["min_tokens"].finish_reason == "stop"
    assert (
        out["ignore_eos"].output_ids == [EOS] * 12 and out["ignore_eos"].finish_reason == "length"
    )
    assert 10 not in out["repetition_bias"].output_ids


def test_stop_token_ids_end_a_request_and_are_not_shown(tiny):
    _, model = tiny
    prompt = _prompts(1, seed=22)[0]
    (plain,), _ = _run(model, [(prompt, RequestParams(12, GREEDY))])
    stop = plain.output_ids[4]
    (req,), (events,) = _run(model, [(prompt, RequestParams(12, GREEDY, stop_token_ids=[stop]))])
    cut = plain.output_ids.index(stop) + 1
    assert req.output_ids == plain.output_ids[:cut] and req.finish_reason == "stop"
    assert "".join(e.text for e in events) == " " + IdTokenizer().decode(
        plain.output_ids[: cut - 1]
    )


def test_logprobs_are_the_log_softmax_of_transformers_logits(tiny):
    """The chosen tokens', their top alternatives' and an echoed prompt's: the raw distribution,
    whatever the request's temperature and penalties."""
    hf, model = tiny
    prompt = _prompts(1, seed=23)[0]
    params = RequestParams(
        6,
        SamplingParams(0.7, repetition_penalty=1.5),
        seed=5,
        frequency_penalty=1.0,
        logprobs=4,
        prompt_logprobs=2,
    )
    (req,), (events,) = _run(model, [(prompt, params)])
    ids = prompt + req.output_ids
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    scored = events[0].prompt_logprobs
    assert (
        [e.token for e in scored] == prompt and scored[0].logprob is None and scored[0].top is None
    )
    for pos, e in enumerate(scored[1:], start=1):
        assert abs(e.logprob - want[pos - 1, prompt[pos]].item()) < 1e-4
        top = torch.topk(want[pos - 1], 2)
        assert [t for t, _ in e.top] == top.indices.tolist()
    generated = [lp for ev in events for lp in ev.logprobs or []]
    assert [e.token for e in generated] == req.output_ids
    for k, e in enumerate(generated):
        row = want[len(prompt) - 1 + k]
        assert abs(e.logprob - row[e.token].item()) < 1e-4
        top = torch.topk(row, 4)
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert max(abs(a - b) for (_, a), b in zip(e.top, top.values.tolist())) < 1e-4


def test_max_tokens_0_with_prompt_logprobs_scores_the_prompt_only(tiny):
    _, model = tiny
    prompt = _prompts(1, seed=24)[0]
    (req,), (events,) = _run(model, [(prompt, RequestParams(0, GREEDY, prompt_logprobs=0))])
    assert req.output_ids == [] and [e.finish_reason for e in events] == ["length"]
    assert len(events[0].prompt_logprobs) == len(prompt)


def test_min_tokens_holds_off_stop_strings_too(tiny):
    """As vLLM: before min_tokens a stop string ends nothing; after, it does again."""
    _, model = tiny
    prompt = _prompts(1, seed=25)[0]
    (plain,), _ = _run(model, [(prompt, RequestParams(12, GREEDY))])
    stop = f"t{plain.output_ids[1]}"
    (early,), _ = _run(model, [(prompt, RequestParams(12, GREEDY, stop=[stop]))])
    assert len(early.output_ids) == 2 and early.finish_reason == "stop"
    (held,), (events,) = _run(
        model, [(prompt, RequestParams(12, GREEDY, stop=[stop], min_tokens=4))]
    )
    assert held.output_ids == plain.output_ids[: len(held.output_ids)] and len(held.output_ids) >= 4
    text = "".join(e.text for e in events)
    assert text.startswith(" " + IdTokenizer().decode(plain.output_ids[:4]))
    later = [k for k in range(4, 12) if f"t{plain.output_ids[k]}" == stop]
    assert len(held.output_ids) == (later[0] + 1 if later else 12)
