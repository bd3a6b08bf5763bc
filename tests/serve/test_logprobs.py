"""Log-probabilities and the sampling fields through the HTTP API, read by the official openai
client: the numbers are the log-softmax of transformers' logits for the same model, in OpenAI's
shapes, streamed or not; out-of-range values are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

PROMPT = "t5 t17 t33 t101 t7"
IDS = [5, 17, 33, 101, 7]  # the word tokenizer's: one id per word


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf_logprobs(model_dir):
    """log-softmax of transformers' logits for a sequence of ids (positions x vocab)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return run


def test_echo_scores_the_prompt_as_transformers_does(server, model_dir, hf_logprobs):
    """lm-eval's request: echo, logprobs, max_tokens 0 (or 1); the first token's log-probability
    is null."""
    want = hf_logprobs(IDS)
    for max_tokens in (0, 1):
        r = client(server).completions.create(
            model=model_dir.name,
            prompt=PROMPT,
            echo=True,
            logprobs=2,
            max_tokens=max_tokens,
            temperature=0,
        )
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(PROMPT) and lp.tokens[:5] == PROMPT.split()
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for pos in range(1, 5):
            assert lp.token_logprobs[pos] == pytest.approx(want[pos - 1, IDS[pos]].item(), abs=1e-4)
            top = torch.topk(want[pos - 1], 2)
            assert list(lp.top_logprobs[pos]) == [f"t{i}" for i in top.indices.tolist()]
            assert list(lp.top_logprobs[pos].values()) == pytest.approx(
                top.values.tolist(), abs=1e-4
            )
        assert len(lp.tokens) == 5 + max_tokens and r.usage.completion_tokens == max_tokens
        assert lp.text_offset[:3] == [0, 2, 5]  # each token's text after the ones before it


def test_completion_logprobs_are_the_raw_distribution_whatever_the_sampling(
    server, model_dir, hf_logprobs
):
    body = dict(model=model_dir.name, prompt=PROMPT, logprobs=3, max_tokens=5)
    for extra in ({"temperature": 0}, {"temperature": 0.5, "seed": 3, "frequency_penalty": 1.0}):
        r = client(server).completions.create(**body, **extra)
        lp = r.choices[0].logprobs
        ids = IDS + [int(t[1:]) for t in lp.tokens]
        want = hf_logprobs(ids)
        for k, (token, value) in enumerate(zip(lp.tokens, lp.token_logprobs)):
            assert value == pytest.approx(want[len(IDS) - 1 + k, int(token[1:])].item(), abs=1e-4)
            assert len(lp.top_logprobs[k]) == 3
        if extra["temperature"] == 0:  # greedy: each token is its position's most likely
            assert all(
                v == pytest.approx(max(top.values()))
                for v, top in zip(lp.token_logprobs, lp.top_logprobs)
            )


def _stream(server, route: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + route, json={**body, "stream": True}, timeout=60) as r:
        return [
            json.loads(line[6:])["choices"][0]
            for line in r.iter_lines()
            if line.startswith("data: {")
        ]


def test_streamed_logprobs_add_up_to_the_whole_answers(server, model_dir):
    body = {
        "model": model_dir.name,
        "prompt": PROMPT,
        "echo": True,
        "logprobs": 2,
        "max_tokens": 4,
        "temperature": 0,
    }
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    chunks = [c for c in _stream(server, "/v1/completions", body) if c["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in c["logprobs"][key]] == whole["logprobs"][key], key
    chat = {
        "model": model_dir.name,
        "messages": [{"role": "user", "content": "t5 t6"}],
        "logprobs": True,
        "top_logprobs": 2,
        "max_tokens": 4,
        "temperature": 0,
    }
    whole = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()[
        "choices"
    ][0]
    streamed = [
        x
        for c in _stream(server, "/v1/chat/completions", chat)
        if c["logprobs"]
        for x in c["logprobs"]["content"]
    ]
    assert streamed == whole["logprobs"]["content"] and len(streamed) == 4


def test_chat_logprobs_parse_as_openais(server, model_dir):
    r = client(server).chat.completions.create(
        model=model_dir.name,
        messages=[{"role": "user", "content": "t5"}],
        logprobs=True,
        top_logprobs=3,
        max_tokens=4,
        temperature=0,
    )
    content = r.choices[0].logprobs.content
    assert "".join(f" {c.token}" for c in content).strip() == r.choices[0].message.content.strip()
    for c in content:
        assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(
            c.logprob
        )
        assert c.logprob <= 0 and sorted((t.logprob for t in c.top_logprobs), reverse=True) == [
            t.logprob for t in c.top_logprobs
        ]
    plain = client(server).chat.completions.create(
        model=model_dir.name,
        messages=[{"role": "user", "content": "t5"}],
        logprobs=True,
        max_tokens=2,
        temperature=0,
    )
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)
    assert (
        client(server)
        .chat.completions.create(
            model=model_dir.name, messages=[{"role": "user", "content": "t5"}], max_tokens=2
        )
        .choices[0]
        .logprobs
        is None
    )


def test_logit_bias_and_stop_token_ids_through_the_api(server, model_dir):
    c = client(server)
    r = c.completions.create(
        model=model_dir.name, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={"9": 100}
    )
    assert r.choices[0].text.split() == ["t9"] * 4
    greedy = c.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=6, temperature=0)
    words = greedy.choices[0].text.split()
    stop = int(words[2][1:])
    cut = c.completions.create(
        model=model_dir.name,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [stop]},
    )
    assert (
        cut.choices[0].text.split() == words[: words.index(words[2])]
        and cut.choices[0].finish_reason == "stop"
    )


@pytest.mark.parametrize(
    "route, field, value",
    [
        ("completions", "frequency_penalty", 2.5),
        ("completions", "presence_penalty", -2.1),
        ("completions", "logit_bias", {"5": 101}),
        ("completions", "logit_bias", {"t5": 1}),
        ("completions", "logit_bias", {"300": 1}),
        ("completions", "min_p", 1.5),
        ("completions", "min_tokens", -1),
        ("completions", "min_tokens", 50),
        ("completions", "logprobs", 21),
        ("completions", "stop_token_ids", [300]),
        ("completions", "max_tokens", 0),
        ("chat", "top_logprobs", 21),
        ("chat", "top_logprobs", 2),
        ("chat", "max_tokens", 0),
        ("chat", "presence_penalty", 3),
    ],
)
def test_out_of_range_values_are_400s_naming_the_field(server, route, field, value):
    body = {"max_tokens": 10, field: value}
    if route == "chat":
        url, body = (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "t5"}], **body},
        )
    else:
        url, body = "/v1/completions", {"prompt": PROMPT, **body}
    r = httpx.post(server.url + url, json=body, timeout=60)
    err = r.json()["error"]
    assert (
        r.status_code == 400 and err["param"] == field and err["type"] == "invalid_request_error"
    ), r.text


def test_a_byte_level_tokens_bytes_are_the_bytes_it_stands_for(shared_data):
    """An emoji that GPT-2's BPE splits over several tokens: each token's text alone is U+FFFD,
    and their `bytes` put together are the emoji's UTF-8, as OpenAI's field is meant to be read."""
    from lmforge.serve.logprobs import TokenText
    from lmforge.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(shared_data / "tokenizers" / "gpt2")
    text = " caf\u00e9 \U0001f9ec"
    ids = tokenizer.encode(text)
    pieces = [TokenText(tokenizer)(i) for i in ids]
    assert any("\ufffd" in t for t, _ in pieces)  # a token that is part of a character
    assert b"".join(bytes(raw) for _, raw in pieces) == text.encode()
