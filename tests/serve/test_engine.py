"""The continuous-batching engine, driven step by step: requests that join a running batch decode
exactly what `generate` gives for their prompt alone."""

from __future__ import annotations

import pytest
import torch

from lmforge.errors import UserError
from lmforge.inference import generate
from lmforge.inference.engine import Engine, EngineBusy, EngineConfig, RequestParams
from lmforge.inference.sampling import SamplingParams
from lmforge.inference.text import TextStream
from lmforge.models import load_pretrained
from tests.conftest import make_hf_model

GREEDY = SamplingParams(temperature=0)


class IdTokenizer:
    """Decodes ids as 't<id>' words; no eos, so only max_tokens ends a request."""

    eos_id = None

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)

    def token_to_id(self, text):  # no token is special: a stop string is text
        return None

    # no ids of its own: the model config's stand
    def model_special_ids(self, declared, classifier=False):
        return {k: declared.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


@pytest.fixture(scope="module")
def models_(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    out = {}
    # NeoX: partial rotary; Llama GQA: per-row writes into shared key/value heads; GPT-2: learned
    # positions; Mistral: an 8-token sliding window counted in each row's own slots.
    for family in ("gpt_neox", "llama_gqa", "gpt2", "mistral"):
        make_hf_model(family).save_pretrained(root / family)
        model = load_pretrained(root / family)
        model.config.eos_token_id = None  # rows end by max_tokens only, so their lengths are known
        out[family] = model
    return out


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, 300, (int(k),), generator=g).tolist()
        for k in torch.randint(2, 14, (n,), generator=g)
    ]


@pytest.mark.parametrize("family", ["gpt_neox", "llama_gqa", "gpt2", "mistral"])
def test_requests_joining_a_running_batch_decode_what_generate_gives_alone(family, models_):
    model = models_[family]
    engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=3, max_context=64))
    prompts = _prompts(7)
    requests, joined_mid_decode = [], 0
    for i, prompt in enumerate(prompts):
        before = [
            (r, len(r.output_ids)) for r in requests if r.finish_reason is None and r.output_ids
        ]
        requests.append(
            engine.submit(
                prompt, RequestParams(max_tokens=6 + 3 * i, sampling=GREEDY), lambda e: None
            )
        )
        for _ in range(1 + i % 3):
            engine.step()
        new = requests[-1]
        # It got a row while the running requests kept decoding: both advanced in the same steps.
        if new.slot is not None and any(
            len(r.output_ids) > n and r.slot is not None for r, n in before
        ):
            joined_mid_decode += 1
    while engine.step():
        pass
    assert joined_mid_decode >= 3
    assert engine.rows_decoded > engine.steps  # batches of more than one row
    for prompt, req in zip(prompts, requests):
        assert req.finish_reason == "length"
        assert (
            req.output_ids
            == generate(model, [prompt], req.params.max_tokens, do_sample=False, stop_token_ids=[])[
                0
            ]
        )
    assert engine.running == 0 and engine.queued == 0


def _stop_after(greedy: list[int]) -> tuple[str, int]:
    """A stop string spanning two tokens of `greedy` (its 4th and 5th), and how many tokens run
    until the text first holds it (the request ends there)."""
    stop = f"t{greedy[3]} t{greedy[4]}"
    return stop, next(
        k for k in range(1, len(greedy) + 1) if stop in " " + IdTokenizer().decode(greedy[:k])
    )


@pytest.mark.parametrize("family", ["gpt_neox", "llama_gqa", "gpt2", "mistral"])
def test_requests_arriving_together_are_prefilled_in_one_forward(family, models_):
    """Eight requests waiting at once (prompts of 2 to 13 tokens, other max_tokens, some with a
    stop string) are prefilled by one forward, right-padded, and each decodes exactly what
    generate gives for it alone."""
    model = models_[family]
    engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=8, max_context=64))
    prompts = _prompts(8, seed=4)
    assert len({len(p) for p in prompts}) > 3  # padding is part of it
    alone = [generate(model, [p], 16, do_sample=False, stop_token_ids=[])[0] for p in prompts]
    requests, events = [], [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        stop = [_stop_after(alone[i])[0]] if i % 3 == 0 else []
        requests.append(
            engine.submit(prompt, RequestParams(16 - i, GREEDY, stop=stop), events[i].append)
        )
    engine.step()
    assert (engine.prefills, engine.rows_prefilled) == (1, 8)
    # prefill's token, then one decode step for all
    assert all(len(r.output_ids) == 2 for r in requests)
    while engine.step():
        pass
    assert engine.prefills == 1
    for i, req in enumerate(requests):
        if i % 3 == 0:
            stop, end = _stop_after(alone[i])
            text = " " + IdTokenizer().decode(alone[i])
            assert req.finish_reason == "stop" and req.output_ids == alone[i][:end]
            assert "".join(e.text for e in events[i]) == text[: text.find(stop)]
        else:
            assert req.finish_reason == "length" and req.output_ids == alone[i][: 16 - i]
            assert "".join(e.text for e in events[i]) == " " + IdTokenizer().decode(req.output_ids)


def test_prefill_into_scattered_rows_and_its_limits(models_):
    """Requests arriving while others decode take the rows freed in between (1 and 3 of 0-3),
    prefilled in one forward through a cache of their own copied into those rows; prefill_batch
    and max_prefill_tokens bound a forward, and prefill_batch=1 prefills one request a forward,
    as before."""
    model = models_["llama_gqa"]
    prompts = _prompts(8, seed=5)
    expected = [generate(model, [p], 12, do_sample=False, stop_token_ids=[])[0] for p in prompts]
    engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=4, max_context=64))
    first = [
        engine.submit(p, RequestParams(n, GREEDY), lambda e: None)
        for p, n in zip(prompts, (12, 3, 12, 4))
    ]
    for _ in range(4):  # rows 1 and 3 finish (3 and 4 tokens), rows 0 and 2 keep decoding
        engine.step()
    assert [r.slot for r in engine.slots if r is not None] == [0, 2]
    later = [engine.submit(p, RequestParams(12, GREEDY), lambda e: None) for p in prompts[4:6]]
    engine.step()
    assert [r.slot for r in later] == [1, 3] and (engine.prefills, engine.rows_prefilled) == (2, 6)
    while engine.step():
        pass
    for prompt, req, n in zip(prompts, first + later, (12, 3, 12, 4, 12, 12)):
        assert req.output_ids == expected[prompts.index(prompt)][:n]
    for config, forwards in (
        (EngineConfig(max_batch=8, max_context=64, prefill_batch=1), 8),
        (EngineConfig(max_batch=8, max_context=64, prefill_batch=3), 3),
        (EngineConfig(max_batch=8, max_context=64, max_prefill_tokens=30), None),
    ):
        engine = Engine(model, IdTokenizer(), config)
        reqs = [engine.submit(p, RequestParams(12, GREEDY), lambda e: None) for p in prompts]
        engine.step()
        while engine.step():
            pass
        assert [r.output_ids for r in reqs] == expected
        if forwards is not None:
            assert engine.prefills == forwards
        # each forward's requests x its longest prompt <= 30 tokens, unless one prompt
        # alone is longer
        else:
            assert engine.prefills == _budget_forwards([len(p) for p in prompts], 30)


def _budget_forwards(lengths: list[int], budget: int) -> int:
    forwards, taken, longest = 0, 0, 0
    for n in lengths:
        if taken and (taken + 1) * max(longest, n) > budget:
            forwards, taken, longest = forwards + 1, 0, 0
        taken, longest = taken + 1, max(longest, n)
    return forwards + 1


def test_seeded_sampling_in_a_batch_equals_generate_alone(models_):
    """Each request samples with its own generator and its own settings, whatever shares the
    batch."""
    model = models_["llama_gqa"]
    engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=4, max_context=64))
    settings = [
        dict(temperature=0.8, top_k=20),
        dict(temperature=1.2, top_p=0.9),
        dict(temperature=0),
        dict(temperature=0.7, top_k=50, top_p=0.8, repetition_penalty=1.3),
    ]
    prompts = _prompts(4, seed=1)
    reqs = []
    for i, (prompt, kw) in enumerate(zip(prompts, settings)):
        sampling = SamplingParams(
            kw.get("temperature", 1.0),
            kw.get("top_k"),
            kw.get("top_p"),
            kw.get("repetition_penalty", 1.0),
        )
        reqs.append(
            engine.submit(prompt, RequestParams(12, sampling, seed=100 + i), lambda e: None)
        )
        engine.step()
    while engine.step():
        pass
    for i, (prompt, kw, req) in enumerate(zip(prompts, settings, reqs)):
        assert (
            req.output_ids
            == generate(model, [prompt], 12, seed=100 + i, stop_token_ids=[], **kw)[0]
        )


def test_eos_stop_strings_and_events(models_):
    model = models_["gpt_neox"]
    prompt = _prompts(1, seed=2)[0]
    greedy = generate(model, [prompt], 12, do_sample=False, stop_token_ids=[])[0]
    k = next(i for i in range(2, 12) if greedy[i] not in greedy[:i])
    model.config.eos_token_id = greedy[k]
    try:
        engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=2, max_context=64))
    finally:
        model.config.eos_token_id = None
    events = []
    req = engine.submit(prompt, RequestParams(12, GREEDY), events.append)
    while engine.step():
        pass
    assert req.output_ids == greedy[: k + 1] and req.finish_reason == "stop"
    # eos counted, not shown
    assert "".join(e.text for e in events) == " " + IdTokenizer().decode(greedy[:k])
    assert [e.completion_tokens for e in events] == list(range(1, k + 2))
    assert [e.finish_reason for e in events] == [None] * k + ["stop"]
    # A stop string spanning two tokens: the text ends before it and nothing of it was ever
    # streamed.
    stop = f"t{greedy[3]} t{greedy[4]}"
    events.clear()
    # eos off again
    engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=2, max_context=64))
    req = engine.submit(prompt, RequestParams(12, GREEDY, stop=[stop]), events.append)
    while engine.step():
        pass
    text = " " + IdTokenizer().decode(greedy)
    assert "".join(e.text for e in events) == text[: text.find(stop)]
    assert req.finish_reason == "stop" and len(req.output_ids) == 5


def test_a_request_that_fails_ends_alone_and_its_batch_goes_on(models_, monkeypatch):
    """In one batch of eight: one request's detokenizer raises at its third token, one's consumer
    at its second event, one's scores are NaN (sampled, so they once reached torch.multinomial),
    and one makes the batch's shared sampling call raise (then its own): each ends alone, and the
    four others decode exactly what generate gives them alone."""
    from lmforge.inference import engine as engine_module

    model = models_["llama_gqa"]
    engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=8, max_context=64))
    raising = SamplingParams(temperature=0)
    real, head, reqs = engine_module.choose_rows, model.logits, {}

    def choose(logits, rows, generators=None):
        if any(p is raising for p in rows.params):  # the batch's call, then its own
            raise RuntimeError("sampling broke on one row")
        return real(logits, rows, generators)

    # the NaN request's row NaN (its slot: the eight are prefilled in slots 0-7, in order)
    def scores(h):
        out, slot = head(h), reqs["nan"].slot
        if reqs["nan"].finish_reason is None and slot is not None and out.shape[0] > slot:
            out[slot] = float("nan")
        return out

    monkeypatch.setattr(engine_module, "choose_rows", choose)
    monkeypatch.setattr(model, "logits", scores)
    prompts = _prompts(8, seed=6)
    good = {
        "greedy": (GREEDY, None),
        "greedy2": (GREEDY, None),
        "seeded": (SamplingParams(0.8, 20), 11),
        "seeded2": (SamplingParams(1.1, None, 0.9, 1.2), 12),
    }
    bad = {
        "detokenizer": (GREEDY, None),
        "consumer": (GREEDY, None),
        "nan": (SamplingParams(0.8), 13),
        "sampling": (raising, None),
    }
    events = {name: [] for name in [*good, *bad]}

    def gone(event):
        if events["consumer"]:
            raise RuntimeError("the consumer went away")
        events["consumer"].append(event)

    for prompt, (name, (sampling, seed)) in zip(prompts, {**good, **bad}.items()):
        reqs[name] = engine.submit(
            prompt,
            RequestParams(12, sampling, seed=seed),
            gone if name == "consumer" else events[name].append,
        )
    push = reqs["detokenizer"].text.push
    reqs["detokenizer"].text.push = lambda t: (
        push(t) if len(reqs["detokenizer"].output_ids) < 3 else 1 / 0
    )
    while engine.step():
        pass
    assert engine.prefills == 1 and engine.running == 0  # all eight were in one batch
    for prompt, (name, (sampling, seed)) in zip(prompts, good.items()):
        kw = dict(
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            repetition_penalty=sampling.repetition_penalty,
        )
        assert reqs[name].finish_reason == "length"
        assert (
            reqs[name].output_ids
            == generate(model, [prompt], 12, seed=seed, stop_token_ids=[], **kw)[0]
        )
    assert reqs["consumer"].finish_reason == "cancelled" and len(reqs["consumer"].output_ids) == 2
    assert [e.finish_reason for e in events["detokenizer"]] == [None, None, "error"]
    assert events["detokenizer"][-1].error == "ZeroDivisionError: division by zero"
    assert [e.finish_reason for e in events["nan"]] == ["error"] and reqs["nan"].output_ids == []
    assert events["nan"][0].error.startswith(
        "the model's scores for the next token are NaN or -inf"
    )
    assert [e.error for e in events["sampling"]] == ["RuntimeError: sampling broke on one row"]


def test_a_prompt_whose_prefill_raises_fails_alone(models_, monkeypatch):
    """Three prompts arrive while one request decodes, and the forward that prefills them
    together raises on one of them: they are prefilled again one by one, and only that one fails."""
    model = models_["gpt_neox"]
    prompts = _prompts(4, seed=7)
    breaking, forward = torch.tensor(prompts[2]), model.hidden_states

    def hidden_states(ids, mask, *args):
        if (
            mask is not None
            and ids.shape[1] >= len(breaking)
            and (ids[:, : len(breaking)] == breaking).all(-1).any()
        ):
            raise RuntimeError("this prompt breaks the forward")
        return forward(ids, mask, *args)

    monkeypatch.setattr(model, "hidden_states", hidden_states)
    engine = Engine(model, IdTokenizer(), EngineConfig(max_batch=4, max_context=64))
    first = engine.submit(prompts[0], RequestParams(12, GREEDY), lambda e: None)
    engine.step()
    events = []
    later = [
        engine.submit(p, RequestParams(8, GREEDY), events.append if i == 1 else lambda e: None)
        for i, p in enumerate(prompts[1:])
    ]
    while engine.step():
        pass
    assert (
        later[1].finish_reason == "error"
        and events[-1].error == "RuntimeError: this prompt breaks the forward"
    )
    for req, n in zip([first, later[0], later[2]], (12, 8, 8)):
        assert req.finish_reason == "length"
        assert (
            req.output_ids
            == generate(model, [req.prompt_ids], n, do_sample=False, stop_token_ids=[])[0]
        )


def test_cancel_frees_the_row_and_queue_limits(models_):
    engine = Engine(
        models_["gpt_neox"], IdTokenizer(), EngineConfig(max_batch=1, max_context=64, max_queue=2)
    )
    a = engine.submit([5, 6, 7], RequestParams(40, GREEDY), lambda e: None)
    b = engine.submit([8, 9], RequestParams(5, GREEDY), lambda e: None)
    with pytest.raises(EngineBusy):
        engine.submit([1], RequestParams(5, GREEDY), lambda e: None)
    engine.step()
    engine.step()
    # prefill + decode, then decode
    assert a.slot == 0 and b.slot is None and len(a.output_ids) == 3
    engine.cancel(a)
    engine.step()  # a's row goes to b at once
    assert a.finish_reason == "cancelled" and len(a.output_ids) == 3
    assert engine.slots[0] is b and len(b.output_ids) == 2
    with pytest.raises(UserError, match="context is 64 tokens"):
        engine.submit(list(range(1, 61)), RequestParams(5, GREEDY), lambda e: None)
    with pytest.raises(UserError, match="vocabulary"):
        engine.submit([1, 300], RequestParams(5, GREEDY), lambda e: None)


def test_admission_is_round_robin_between_groups(models_):
    """One client's 30 prompts (one group) do not make five single requests wait behind them:
    free rows go to the waiting groups in turn, each group's own requests in the order they came."""
    engine = Engine(models_["gpt_neox"], IdTokenizer(), EngineConfig(max_batch=2, max_context=64))
    prompts = _prompts(35, seed=3)
    big = [
        engine.submit(p, RequestParams(4, GREEDY), lambda e: None, group="big")
        for p in prompts[:30]
    ]
    # a group each
    small = [engine.submit(p, RequestParams(4, GREEDY), lambda e: None) for p in prompts[30:]]
    while engine.step():
        pass
    everyone = big + small
    order = sorted(everyone, key=lambda r: r.admitted_at_step)  # stable: ties keep submission order
    assert order[:7] == [big[0], small[0], small[1], small[2], small[3], small[4], big[1]]
    assert order[7:] == big[2:]  # then the big group alone, in its order
    # In decode steps: every single request started within the first three rounds of 2 rows x 4
    # tokens, where first come, first served had them wait for all 30 (15 rounds).
    assert max(r.admitted_at_step for r in small) <= 2 * 4 and big[-1].admitted_at_step >= 16 * 3
    assert all(r.finish_reason == "length" for r in everyone) and engine.queued == 0


def test_text_stream_holds_back_split_characters(shared_data):
    """Byte-level BPE splits an emoji over tokens: no delta shows half a character, and the
    deltas add up to the decoded text."""
    from lmforge.tokenizers import load_tokenizer

    tok = load_tokenizer(shared_data / "tokenizers" / "gpt2" / "tokenizer.json")
    prompt = tok.encode("Weather today:")
    completion = tok.encode(" sunny 🌞🌈 and 21°C, «très beau» END more")
    # characters span tokens
    assert len(completion) > len(" sunny 🌞🌈 and 21°C, «très beau» END more".split()) + 4
    stream = TextStream(tok, prompt, stop=["END"])
    deltas = []
    for t in completion:
        delta, stopped = stream.push(t)
        assert "\ufffd" not in delta
        deltas.append(delta)
        if stopped:
            break
    assert stopped
    assert "".join(deltas) == " sunny 🌞🌈 and 21°C, «très beau» "
