"""Request fields that change the answer are done or refused by name, never answered 200 while
ignored: vLLM's extensions to both routes and to chat, OpenAI's deprecated `functions`, and TGI's
`grammar` and `adapter_id` on /invocations (its 422 shape). vLLM's
`include_stop_str_in_output` and `max_completion_tokens` on completions are done (the sampling
fields and logprobs: test_sampling_fields.py, test_logprobs.py), as are tools (test_tools.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from lmforge.inference import generate_text

PROMPT = "t5 t17 t33 t101"
CHAT = [{"role": "user", "content": "t5 t17"}]


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


@pytest.mark.parametrize(
    "field, value",
    [
        ("include_stop_str_in_output", "yes"),
        ("allowed_token_ids", [5, 6]),
        ("bad_words", ["t5"]),
        ("truncate_prompt_tokens", 2),
        ("prompt_logprobs", 1),
        ("prompt_embeds", "AAAA"),
        ("suffix", "t9"),
    ],
)
def test_completion_fields_that_change_the_answer_are_refused_by_name(server, field, value):
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, field: value})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field, r.text
    if field != "include_stop_str_in_output":  # that one is done: a string is the wrong type for it
        assert (
            err["code"] == "unsupported_parameter"
            and f"'{field}' is not supported" in err["message"]
        )


@pytest.mark.parametrize(
    "field, value",
    [
        ("add_generation_prompt", False),
        ("continue_final_message", True),
        ("chat_template", "{{ 'x' }}"),
        ("chat_template_kwargs", {"enable_thinking": False}),
        ("documents", [{"text": "t5"}]),
        ("echo", True),
        ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
        ("function_call", {"name": "f"}),
        ("bad_words", ["t9"]),
    ],
)
def test_chat_fields_that_change_the_prompt_or_answer_are_refused_by_name(server, field, value):
    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, field: value})
    err = r.json()["error"]
    assert (
        r.status_code == 400 and err["param"] == field and err["code"] == "unsupported_parameter"
    ), r.text


def test_values_that_ask_for_nothing_and_metadata_are_answered(server, caplog):
    for body in (
        {"min_p": 0.0},
        {"stop_token_ids": []},
        {"bad_words": []},
        {"logprobs": None},
        {"user": "u"},
        {"store": False, "metadata": {"k": "v"}, "service_tier": "auto"},
    ):
        r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, **body})
        assert r.status_code == 200, (body, r.text)
    for body in (
        {"add_generation_prompt": True},
        {"continue_final_message": False},
        {"chat_template_kwargs": {}},
        {"function_call": "none"},
        {"tool_choice": "auto"},
        {"echo": False},
        {"store": True},
    ):
        r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, **body})
        assert r.status_code == 200, (body, r.text)
    # a chat field on completions: not read there
    with caplog.at_level("WARNING", logger="lmforge.serve.protocol"):
        assert (
            _post(
                server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "chat_template": "x"}
            ).status_code
            == 200
        )
    assert "'chat_template'" in caplog.text


def test_max_completion_tokens_is_max_tokens_on_completions_too(server):
    body = {"prompt": PROMPT, "temperature": 0}
    three = _post(server, "/v1/completions", {**body, "max_completion_tokens": 3}).json()
    assert (
        three["choices"][0]["text"]
        == _post(server, "/v1/completions", {**body, "max_tokens": 3}).json()["choices"][0]["text"]
    )
    # ignored, it was the server's default: 256 or the context
    assert three["usage"]["completion_tokens"] <= 3
    # the server's limit is 100
    r = _post(server, "/v1/completions", {**body, "max_completion_tokens": 101})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def _stream_text(server, route: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", server.url + route, json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text") or choice.get("delta", {}).get("content") or ""
    return text


def test_include_stop_str_in_output_keeps_the_requests_stop_string(server, reference):
    model, tok = reference
    full = generate_text(model, tok, [PROMPT], 12, temperature=0)[0]
    stop = full.split()[2]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": [stop]}
    cut = full[: full.find(stop)]
    assert _post(server, "/v1/completions", body).json()["choices"][0]["text"] == cut
    kept = {**body, "include_stop_str_in_output": True}
    choice = _post(server, "/v1/completions", kept).json()["choices"][0]
    assert choice["text"] == cut + stop and choice["finish_reason"] == "stop"
    assert _stream_text(server, "/v1/completions", kept) == cut + stop
    chat = {"messages": CHAT, "max_tokens": 12, "temperature": 0}
    reply = _post(server, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    stop = reply.split()[1]
    kept = {**chat, "stop": [stop], "include_stop_str_in_output": True}
    cut = reply[: reply.find(stop)]
    assert (
        _post(server, "/v1/chat/completions", kept).json()["choices"][0]["message"]["content"]
        == cut + stop
    )
    assert _stream_text(server, "/v1/chat/completions", kept) == cut + stop


def test_a_chat_formats_own_stop_string_is_not_kept():
    """The chat format's stop strings (the fallback's "\\nUser:") end the reply where vLLM's eos would: not text."""
    from lmforge.serve.protocol import ChatRequest, parse
    from lmforge.serve.server import kept_stop

    body = parse(
        ChatRequest, {"messages": CHAT, "stop": ["t9"], "include_stop_str_in_output": True}
    )
    assert (
        kept_stop(body, "t9") == "t9"
        and kept_stop(body, "\nUser:") == ""
        and kept_stop(body, None) == ""
    )


def test_tgi_parameters_that_change_the_answer_are_refused_and_unknown_ones_logged(server, caplog):
    url = server.url + "/invocations"
    for name, value in (
        ("grammar", {"type": "json", "value": {"type": "object"}}),
        ("adapter_id", "my-lora"),
    ):
        r = httpx.post(
            url,
            json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2, name: value}},
            timeout=60,
        )
        assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
        assert f"'parameters.{name}' is not supported" in r.json()["error"]
    for harmless in ({"grammar": None}, {"adapter_id": ""}):
        r = httpx.post(
            url,
            json={"inputs": PROMPT, "parameters": {"max_new_tokens": 1, **harmless}},
            timeout=60,
        )
        assert r.status_code == 200, (harmless, r.text)
    with caplog.at_level("WARNING", logger="lmforge.serve.protocol"):
        r = httpx.post(url, json={"inputs": PROMPT, "parameters": {"max_new_token": 1}}, timeout=60)
    assert r.status_code == 200
    assert (
        "TGI parameters ignored" in caplog.text
        and "'max_new_token' (did you mean 'max_new_tokens'?)" in caplog.text
    )
