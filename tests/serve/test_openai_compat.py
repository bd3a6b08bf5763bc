"""What OpenAI's API and vLLM do that clients rely on: usage counts each prompt once, a too-long
prompt names the length that fits and the field to change, null means the default, vLLM's idioms
are honoured or refused by name (never ignored), and an error names the field it is about."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _post(server, route: str, **body) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def test_usage_counts_each_prompt_once_whatever_n(server, model_dir):
    c, name = client(server), model_dir.name
    r = c.completions.create(
        model=name, prompt="t5 t6 t7 t8 t9", max_tokens=2, n=3, temperature=1.0, seed=1
    )
    assert len(r.choices) == 3 and r.usage.prompt_tokens == 5 and r.usage.completion_tokens <= 6
    r = c.completions.create(
        model=name, prompt=["t5 t6", "t7 t8 t9"], max_tokens=2, n=2, temperature=1.0, seed=1
    )
    assert len(r.choices) == 4 and r.usage.prompt_tokens == 5  # two prompts, each counted once
    one = c.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "t5"}], max_tokens=2
    )
    three = c.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "t5"}], max_tokens=2, n=3
    )
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    stream = c.completions.create(
        model=name,
        prompt="t5 t6 t7",
        max_tokens=2,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert [ch.usage for ch in stream if ch.usage][-1].prompt_tokens == 3


def test_a_prompt_past_the_context_names_the_length_that_fits_and_the_field(server, model_dir):
    c, name = client(server), model_dir.name  # context 128
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt=" ".join(["t5"] * 200), max_tokens=3)
    assert "shorten the prompt to at most 125 tokens (with max_tokens 3)" in e.value.message
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    # and it does
    assert c.completions.create(model=name, prompt=" ".join(["t5"] * 125), max_tokens=3).choices
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=name, messages=[{"role": "user", "content": " ".join(["t5"] * 200)}], max_tokens=3
        )
    assert e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt=" ".join(["t5"] * 200), max_tokens=100)
    assert "shorten the prompt to at most 28 tokens (with max_tokens 100)" in e.value.message
    # the new tokens alone fill the context: say both
    from lmforge.inference.generate import context_overflow

    assert context_overflow(200, 128, 128, "max_tokens").endswith(
        "lower max_tokens below 128 and shorten the prompt to fit beside it"
    )
    assert context_overflow(200, None, 128).endswith("shorten the prompt to at most 127 tokens")


def test_null_means_the_default_and_errors_name_their_field(server, model_dir):
    name = model_dir.name
    r = _post(
        server,
        "/v1/completions",
        model=name,
        prompt="t5",
        max_tokens=2,
        temperature=None,
        top_p=None,
        n=None,
        stream=None,
        stop=None,
        seed=None,
        stream_options=None,
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    for field, value in (("stream", "yes"), ("stream_options", "x"), ("n", "2"), ("top_p", "high")):
        r = _post(
            server,
            "/v1/chat/completions",
            model=name,
            messages=[{"role": "user", "content": "t5"}],
            **{field: value},
        )
        err = r.json()["error"]
        assert (
            r.status_code == 400
            and err["param"] == field
            and f"invalid value for '{field}'" in err["message"]
        )
    image = [
        {"type": "text", "text": "t5"},
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
    ]
    r = _post(
        server, "/v1/chat/completions", model=name, messages=[{"role": "user", "content": image}]
    )
    err = r.json()["error"]
    assert (
        r.status_code == 400 and "reads text only, not 'image_url' content parts" in err["message"]
    )
    assert err["param"].startswith("messages.0.content")
    parts = [{"type": "text", "text": "t5 "}, {"type": "text", "text": "t6"}]
    assert (
        _post(
            server,
            "/v1/chat/completions",
            model=name,
            messages=[{"role": "user", "content": parts}],
            max_tokens=2,
        ).status_code
        == 200
    )


def test_vllm_idioms_are_honoured_or_refused_by_name(server, model_dir):
    c, name = client(server), model_dir.name
    greedy = (
        c.completions.create(model=name, prompt="t5 t6", max_tokens=4, temperature=0)
        .choices[0]
        .text
    )
    off = c.completions.create(
        model=name, prompt="t5 t6", max_tokens=4, temperature=0, extra_body={"top_k": -1}
    )
    assert off.choices[0].text == greedy  # vLLM's top_k -1: no top-k
    for extra in ({"guided_choice": ["t5", "t6"]}, {"guided_json": {"type": "object"}}):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=name, prompt="t5", max_tokens=2, extra_body=extra)
        assert e.value.code == "unsupported_parameter" and e.value.param == next(iter(extra)), extra
    for harmless in (
        {"min_tokens": 0},
        {"ignore_eos": False},
        {"min_tokens": 2, "ignore_eos": True},
        {"response_format": {"type": "text"}},
        {"some_future_field": 1},
    ):
        assert c.completions.create(
            model=name, prompt="t5", max_tokens=2, extra_body=harmless
        ).choices, harmless
    # n past 16: --max-choices caps it (128)
    r = c.completions.create(model=name, prompt="t5", max_tokens=1, n=20)
    assert len(r.choices) == 20
    # when the server loaded the model, as vLLM's
    assert c.models.list().data[0].created > 1_600_000_000


def test_a_raw_prompt_reads_special_token_text_as_the_token_and_a_chat_turn_does_not(shared_data):
    from lmforge.serve.chat import ChatFormat
    from lmforge.serve.server import ServeConfig, Server
    from lmforge.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(shared_data / "tokenizers" / "gpt2")
    server = Server(
        None,
        tokenizer,
        ChatFormat(tokenizer, shared_data / "tokenizers" / "gpt2"),
        ServeConfig("m"),
    )
    # as vLLM and transformers read it
    assert server.prompts.encode_text("Hi<|endoftext|>") == [17250, 50256]
    assert not tokenizer.parse_special_tokens  # only for that prompt
    # a user cannot forge a boundary
    assert 50256 not in server.chat.encode([("user", "Hi<|endoftext|>")])


def test_invocations_answer_as_tgi_does(server, model_dir):
    """Hugging Face's TGI container, which SageMaker's LLM images run: it samples when
    temperature/top_k/top_p ask to (not only with do_sample), keeps the stop sequence in the
    text, names finish reasons eos_token / stop_sequence / length, reports the seed it drew, and
    answers a request it cannot take with 422 {"error", "error_type"}; its parameters lmforge
    does not do are refused by name, not ignored."""
    from lmforge.inference import generate_text
    from lmforge.models import load_pretrained
    from lmforge.tokenizers import load_tokenizer

    model, tok = load_pretrained(model_dir), load_tokenizer(model_dir)
    url = server.url + "/invocations"

    def call(**parameters):
        r = httpx.post(
            url,
            json={"inputs": "t5 t17 t33", "parameters": {"details": True, **parameters}},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        return r.json()[0]

    sampled = call(max_new_tokens=8, temperature=0.7, seed=3)
    assert (
        sampled["generated_text"]
        == generate_text(model, tok, ["t5 t17 t33"], 8, temperature=0.7, seed=3)[0]
    )
    assert sampled["details"]["seed"] == 3
    drawn = call(max_new_tokens=4, top_k=5)  # sampling without a seed: the one drawn is reported
    assert isinstance(drawn["details"]["seed"], int)
    greedy = call(max_new_tokens=8)
    assert greedy["details"] == {"finish_reason": "length", "generated_tokens": 8, "seed": None}
    words = greedy["generated_text"].split()
    stopped = call(max_new_tokens=8, stop=[words[2]])
    assert (
        stopped["generated_text"]
        == greedy["generated_text"][: greedy["generated_text"].find(words[2])] + words[2]
    )
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    for body in (
        {"inputs": "t5", "parameters": {"typical_p": 0.5}},
        {"inputs": "t5", "stream": True},
        {"inputs": "t5", "parameters": {"temperature": 0}},
    ):
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 422 and r.json()["error_type"] == "validation", body
    assert (
        "'parameters.typical_p' is not supported"
        in httpx.post(url, json={"inputs": "t5", "parameters": {"typical_p": 0.5}}).json()["error"]
    )


def test_an_ignored_request_field_is_named_in_the_log_with_the_parameter_it_resembles(caplog):
    """A typo ("max_token": 8) was answered as if absent, filling the context, with no trace; as
    vLLM does, the request is still answered and the log names what was ignored."""
    from lmforge.serve.protocol import ChatRequest, CompletionRequest, parse

    with caplog.at_level("WARNING", logger="lmforge.serve.protocol"):
        body = parse(CompletionRequest, {"prompt": "t5", "max_token": 8, "min_tokens": 0})
    assert body.max_tokens is None  # answered: ignored, not refused
    assert (
        "request fields ignored" in caplog.text
        and "'max_token' (did you mean 'max_tokens'?)" in caplog.text
    )
    # vLLM's, read (and refused when it would change the answer)
    assert "min_tokens" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="lmforge.serve.protocol"):
        parse(
            ChatRequest,
            {"messages": [{"role": "user", "content": "t5"}], "max_tokens": 2, "user": "u"},
        )
    assert not caplog.text
