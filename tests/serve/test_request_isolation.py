"""One request never fails the others decoded beside it: a temperature or repetition_penalty
whose arithmetic overflows fp32 is answered (greedily below the temperature floor), and a request
whose own processing raises ends alone, with OpenAI's error object (or an error event when
streamed), while the rest of its batch gets its tokens."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from lmforge.inference.text import TextStream
from tests.serve.conftest import serve
from tests.serve.test_server import _gate

# (prompt, sampling): two greedy, two seeded; the odd ones streamed.
NORMAL = [
    ("t5 t17 t33 t2 t99", dict(temperature=0)),
    ("t8 t9 t10", dict(temperature=0.9, seed=3)),
    ("t250 t1 t2 t3", dict(temperature=0)),
    ("t64 t32 t16 t8", dict(temperature=1.1, top_p=0.9, seed=4)),
]
BAD_PROMPT = "t77 t78 t79"
TOKENS = 20


@pytest.fixture(scope="module")
def wide(model_dir):
    """Eight rows: the four normal requests and the bad ones decode in one batch."""
    with serve(model_dir, max_batch=8) as s:
        s.name = model_dir.name
        yield s


def _complete(server, prompt: str, stream: bool = False, **sampling) -> str:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    extra = {k: sampling.pop(k) for k in ("repetition_penalty",) if k in sampling}
    kw = dict(
        model=server.name, prompt=prompt, max_tokens=TOKENS, extra_body=extra or None, **sampling
    )
    if stream:
        return "".join(chunk.choices[0].text for chunk in c.completions.create(stream=True, **kw))
    return c.completions.create(**kw).choices[0].text


def _together(server, jobs: list[tuple[str, bool, dict]]) -> list[str | Exception]:
    """The jobs sent at once, held until all wait, so they are prefilled and decoded in one
    batch."""
    out: list[str | Exception] = [None] * len(jobs)

    def call(i, prompt, stream, sampling):
        try:
            out[i] = _complete(server, prompt, stream, **sampling)
        except Exception as e:  # noqa: BLE001 (the test looks at what each got)
            out[i] = e

    _gate(server.engine, len(jobs))
    threads = [threading.Thread(target=call, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def _normal_jobs() -> list[tuple[str, bool, dict]]:
    return [(prompt, i % 2 == 1, dict(sampling)) for i, (prompt, sampling) in enumerate(NORMAL)]


@pytest.fixture(scope="module")
def alone(wide):
    """What each normal request gets when it is the only one."""
    return [
        _complete(wide, prompt, stream, **sampling) for prompt, stream, sampling in _normal_jobs()
    ]


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=1e-300),
        dict(temperature=1.0, repetition_penalty=1e-40, seed=5),
        dict(temperature=0.8, repetition_penalty=1e40, seed=6),
    ],
)
def test_an_overflowing_setting_fails_nobody(wide, alone, bad):
    """temperature 1e-300 is 0 in fp32 and repetition_penalty 1e-40 takes the seen tokens' scores
    to +inf: each made the sampling probabilities NaN, torch.multinomial raised, and every
    request of the batch got '500 generation failed'. (1e40 takes negative seen scores to -inf,
    which is no harm.)"""
    got = _together(wide, [*_normal_jobs(), (BAD_PROMPT, False, dict(bad))])
    assert got[:4] == alone
    # its own answer, reproducible
    assert isinstance(got[4], str) and got[4] == _complete(wide, BAD_PROMPT, **bad)
    if bad["temperature"] and bad["temperature"] < 1e-5:  # below the floor: the greedy answer
        assert got[4] == _complete(wide, BAD_PROMPT, temperature=0)


def test_a_request_whose_own_processing_fails_ends_alone_with_an_error(wide, alone, monkeypatch):
    """Its detokenizer raises at its third token (a stop-string check too runs there): that
    request, streamed or not, gets the error; the four decoded beside it get their own tokens."""
    bad_ids = [int(w[1:]) for w in BAD_PROMPT.split()]
    push = TextStream.push

    def breaking(self, token):
        if self.context == bad_ids and len(self.ids) >= 2:
            raise RuntimeError("the detokenizer broke on this request")
        return push(self, token)

    monkeypatch.setattr(TextStream, "push", breaking)
    got = _together(
        wide,
        [
            *_normal_jobs(),
            (BAD_PROMPT, False, dict(temperature=0)),
            (BAD_PROMPT, True, dict(temperature=0.7, seed=1)),
        ],
    )
    assert got[:4] == alone
    whole, streamed = got[4:]
    assert isinstance(whole, openai.InternalServerError) and whole.status_code == 500
    assert whole.body["type"] == "server_error"
    assert (
        whole.body["message"]
        == "generation failed: RuntimeError: the detokenizer broke on this request"
    )
    assert (
        isinstance(streamed, openai.APIError)
        and "the detokenizer broke on this request" in streamed.message
    )
    deadline = time.monotonic() + 10  # the rows are freed just after the last events went out
    while wide.engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert wide.engine.running == 0
